"""``/admin/config`` and ``atb-mem ctl`` on a live server: validation that changes nothing,
one watched change at a time, loopback-only access, persistence of kept changes, and — under a
steady load — a change that visibly hurts (``max_num_seqs=1``) rolled back by the guard while
every in-flight request completes with ``Engine.generate``'s output."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

MODEL = "tiny"


def new_engine(checkpoint: Path) -> Any:
    from atb_mem.serving import Engine

    return Engine.from_pretrained(str(checkpoint), device="cpu", num_blocks=128, block_size=4,
                                  max_num_seqs=8, max_num_batched_tokens=128)


@pytest.fixture()
def server(checkpoint: Path, tmp_path: Path) -> Iterator[Any]:
    from atb_mem.serving.api_server import ApiServer
    from atb_mem.serving.config_guard import ConfigGuard

    engine = new_engine(checkpoint)
    guard = ConfigGuard(dict(engine.scheduler.config), window_s=2.0)
    running = ApiServer(engine, MODEL, port=0, guard=guard, admin_token="s3cret",
                        config_path=str(tmp_path / "config.json")).start()
    yield running
    running.shutdown()


def admin(server: Any, body: dict[str, Any] | None = None) -> Any:
    import httpx

    url = f"{server.url}/admin/config"
    return httpx.post(url, json=body, timeout=60) if body is not None else httpx.get(url)


def ctl(*args: str) -> int:
    from atb_mem.tools.cli import main

    return main(["ctl", *args])


def test_get_shows_the_configuration(server: Any) -> None:
    state = admin(server).json()
    assert state["config"]["max_num_seqs"] == 8 and state["stable"] == state["config"]
    assert state["watching"] is False and state["history"] == []


@pytest.mark.parametrize(("changes", "fragment"), [
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"max_num_seqs": "many"}, "max_num_seqs"),
    ({"preemption": "drop"}, "preemption"),
    ({"speed": 11}, "unknown setting"),
])
def test_a_bad_value_is_refused_and_changes_nothing(server: Any, changes: dict[str, Any],
                                                    fragment: str) -> None:
    before = admin(server).json()
    response = admin(server, {"set": changes, "live": True, "watch_s": 1})
    assert response.status_code == 400 and fragment in response.json()["error"]["message"]
    assert admin(server).json() == before


def test_without_live_nothing_is_applied(server: Any) -> None:
    answer = admin(server, {"set": {"max_num_seqs": 4}}).json()
    assert answer == {"applied": False, "would_be": {**admin(server).json()["config"],
                                                     "max_num_seqs": 4}}
    assert admin(server).json()["config"]["max_num_seqs"] == 8


def test_a_kept_change_is_persisted_and_concurrent_changes_are_serialised(server: Any) -> None:
    answers: list[Any] = []

    def change(value: int) -> None:
        answers.append(admin(server, {"set": {"max_num_seqs": value}, "live": True,
                                      "watch_s": 1.5, "persist": True}))

    threads = [threading.Thread(target=change, args=(value,)) for value in (4, 5, 6, 7)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    codes = sorted(answer.status_code for answer in answers)
    assert codes == [200, 409, 409, 409]
    [kept] = [answer.json() for answer in answers if answer.status_code == 200]
    value = kept["config"]["max_num_seqs"]
    assert kept["previous"]["max_num_seqs"] == 8
    # An idle server has nothing to compare: the change is kept when its watch ends.
    assert ctl("--url", server.url, "--set", f"watermark={0.02}", "--live", "--watch",
               "0.5s") == 1  # refused: the first change is still watched ...
    deadline = time.monotonic() + 30
    while admin(server).json()["watching"] and time.monotonic() < deadline:
        time.sleep(0.1)
    state = admin(server).json()
    assert state["history"][-1]["outcome"] == "stable"
    assert state["stable"]["max_num_seqs"] == value == state["config"]["max_num_seqs"]
    assert json.loads(server.admin.config_path.read_text())["max_num_seqs"] == value


def test_non_loopback_clients_need_the_token(server: Any) -> None:
    """Driven through ASGI with a peer address that is not loopback."""

    def call(headers: list[tuple[bytes, bytes]]) -> int:
        sent: list[dict[str, Any]] = []

        async def run() -> None:
            async def receive() -> dict[str, Any]:
                return {"type": "http.request", "body": b"", "more_body": False}

            async def send(message: dict[str, Any]) -> None:
                sent.append(message)

            scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                     "method": "GET", "scheme": "http", "path": "/admin/config",
                     "raw_path": b"/admin/config", "query_string": b"", "root_path": "",
                     "headers": headers, "client": ("10.1.2.3", 40000),
                     "server": ("10.0.0.1", 8000)}
            await server.app(scope, receive, send)

        asyncio.run(run())
        return int(sent[0]["status"])

    assert call([]) == 403
    assert call([(b"authorization", b"Bearer wrong")]) == 403
    assert call([(b"authorization", b"Bearer s3cret")]) == 200


def test_a_change_that_hurts_is_rolled_back_under_load(server: Any, checkpoint: Path) -> None:
    import httpx

    from atb_mem.serving import SamplingParams

    prompts = [f"the cache holds block {'table ' * (i % 4)}keys" for i in range(8)]
    outputs: dict[int, list[str]] = {i: [] for i in range(len(prompts))}
    stop = threading.Event()
    errors: list[BaseException] = []

    def load(index: int) -> None:
        # One client per thread, as a real load generator keeps its connections: a new
        # client per request spends its time (and the GIL) building TLS contexts, so the
        # server would be measured waiting on its clients rather than serving them.
        try:
            with httpx.Client(timeout=120) as client:
                while not stop.is_set():
                    response = client.post(f"{server.url}/v1/completions", json={
                        "model": MODEL, "prompt": prompts[index], "max_tokens": 24,
                        "temperature": 0, "ignore_eos": True})
                    response.raise_for_status()
                    outputs[index].append(response.json()["choices"][0]["text"])
        except BaseException as error:  # reported by the test thread
            errors.append(error)

    threads = [threading.Thread(target=load, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    try:
        # Let the guard see the load first: its window is 2 s.
        deadline = time.monotonic() + 60
        while sum(map(len, outputs.values())) < 16 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ctl("--url", server.url, "--set", "max_num_seqs=1", "--live", "--watch",
                   "3s") == 1  # rolled back: the command fails
    finally:
        stop.set()
        for thread in threads:
            thread.join(120)
    assert not errors
    state = admin(server).json()
    decision = state["history"][-1]
    assert (decision["outcome"], decision["reason"]) == ("rollback", "throughput"), (
        decision["before"],
        decision["after"],
    )
    assert decision["after"]["throughput"] < 0.9 * decision["before"]["throughput"]
    assert state["config"]["max_num_seqs"] == 8
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'atb_mem_config_rollbacks_total{reason="throughput"} 1.0' in metrics
    reference = new_engine(checkpoint)
    for index, prompt in enumerate(prompts):
        [want] = reference.generate(prompt, SamplingParams(max_tokens=24, temperature=0,
                                                           ignore_eos=True))
        assert outputs[index] and set(outputs[index]) == {want.outputs[0].text}


def test_the_shipped_alerting_rules_name_metrics_the_server_exports(server: Any) -> None:
    import httpx
    import yaml

    rules_file = Path(__file__).resolve().parents[2] / "examples" / "prometheus_alerts.yml"
    rules = yaml.safe_load(rules_file.read_text())["groups"][0]["rules"]
    from atb_mem.serving.server_metrics import ServerMetrics

    exported = httpx.get(f"{server.url}/metrics").text
    # The device's utilisation is exported only where it can be read: not on this CPU.
    exported += ServerMetrics(server.engine_loop.engine, MODEL,
                              device_utilization=lambda: 80.0).render().decode()
    for rule in rules:
        for name in re.findall(r"atb_mem_\w+", rule["expr"]):
            assert re.search(rf"^{name}[{{ ]", exported, flags=re.M), (rule["alert"], name)
    assert {rule["alert"] for rule in rules} >= {"AtbMemKvCacheNearlyFull",
                                                   "AtbMemModelTimeShareLow",
                                                   "AtbMemDeviceUnderused",
                                                   "AtbMemConfigRolledBack"}


def test_tune_applies_its_best_configuration_through_the_guard(server: Any,
                                                              tmp_path: Path) -> None:
    from atb_mem.tools.cli import main

    out = tmp_path / "tune.json"
    assert main(["tune", "--requests", "60", "--trials", "4", "--latency-p99", "1000",
                 "--json", str(out), "--apply-to", server.url, "--watch", "0.3s"]) == 0
    report = json.loads(out.read_text())
    best, state = report["best"], admin(server).json()
    assert [step["outcome"] for step in report["applied"]] == ["stable", "stable"]
    assert [list(entry["changes"]) for entry in state["history"]] == [
        ["max_num_batched_tokens"], ["max_num_seqs"]]
    for key in ("max_num_batched_tokens", "max_num_seqs"):
        assert state["config"][key] == state["stable"][key] == best[key]


def test_tune_checks_the_server_before_it_searches(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from atb_mem.tools.cli import main

    out = tmp_path / "tune.json"
    assert main(["tune", "--requests", "30", "--trials", "2", "--latency-p99", "1000",
                 "--json", str(out), "--apply-to", "http://127.0.0.1:9"]) == 1
    assert "cannot reach http://127.0.0.1:9/admin/config" in capsys.readouterr().err
    assert not out.exists()  # failed before the search, not after it

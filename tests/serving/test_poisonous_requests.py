"""No request stops the server for the others: extreme but valid values, requests that fail
in the engine, refused requests that change nothing, forks within ``max_num_seqs``, live
settings that would strand a request, and the admin API's trust in the real peer — each
among healthy requests, which complete with HF's greedy output."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atb_mem.serving import Engine, SamplingParams
from tests.support.models import hf_greedy, model_pair

GREEDY = SamplingParams(max_tokens=5, temperature=0)


def prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 256, size=length).tolist()


def engine_pair(**kwargs: Any) -> tuple[Engine, Any]:
    model, reference = model_pair("llama")
    kwargs = {"num_blocks": 64, "block_size": 4, **kwargs}
    return Engine(model, **kwargs), reference


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]
        ) -> dict[str, Any]:
    for request_id, (tokens, params) in requests.items():
        engine.add_request(request_id, tokens, params)
    finals: dict[str, Any] = {}
    tokens_of: dict[str, list[int]] = {}
    for _ in range(200):
        for output in engine.step():
            tokens_of.setdefault(output.request_id, [])
            tokens_of[output.request_id] += output.outputs[0].token_ids if output.outputs else []
            if output.finished:
                finals[output.request_id] = (output, tokens_of[output.request_id])
        if not engine.has_unfinished_requests():
            return finals
    raise AssertionError(f"unfinished after 200 steps: {engine.num_unfinished_requests}")


def test_a_tiny_temperature_is_greedy_and_a_neighbour_runs_on() -> None:
    engine, reference = engine_pair()
    healthy, tiny = prompt(1, 7), prompt(2, 6)
    finals = run(engine, {"healthy": (healthy, GREEDY),
                          "tiny": (tiny, SamplingParams(max_tokens=5, temperature=1e-39)),
                          "tinier": (tiny, SamplingParams(max_tokens=5, temperature=1e-300))})
    assert finals["healthy"][1] == hf_greedy(reference, healthy, 5)
    assert finals["tiny"][1] == finals["tinier"][1] == hf_greedy(reference, tiny, 5)


def test_a_request_whose_sampling_fails_ends_alone() -> None:
    engine, reference = engine_pair()
    broken = SamplingParams(max_tokens=5, temperature=1.0, seed=3)
    object.__setattr__(broken, "temperature", float("nan"))  # past validation: softmax NaN
    healthy = prompt(1, 7)
    finals = run(engine, {"healthy": (healthy, GREEDY), "broken": (prompt(2, 6), broken)})
    assert finals["healthy"][1] == hf_greedy(reference, healthy, 5)
    output = finals["broken"][0]
    assert output.error is not None and "sampling failed" in output.error
    assert {one.finish_reason for one in output.outputs} == {"error"}
    engine.step()
    assert engine.kv_cache.stats()["blocks_used"] == 0


def test_seeds_are_bounded_for_every_sample() -> None:
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64 - 1, n=2)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64)
    with pytest.raises(ValueError, match="finite"):
        SamplingParams(temperature=float("inf"))
    engine, _ = engine_pair()
    finals = run(engine, {"last": (prompt(3, 5), SamplingParams(max_tokens=3, seed=2**64 - 1))})
    assert len(finals["last"][1]) == 3


def state(engine: Engine) -> Any:
    return (engine.kv_cache.stats(), engine.scheduler.stats(), engine.num_unfinished_requests,
            engine.kv_cache.num_free_blocks)


@pytest.mark.parametrize("case", ["seed past validation", "n over max_num_seqs", "too long"])
def test_a_refused_request_changes_nothing(case: str) -> None:
    engine, reference = engine_pair(max_num_seqs=4)
    engine.add_request("existing", prompt(1, 5), GREEDY)
    params = SamplingParams(max_tokens=3, seed=1)
    if case == "seed past validation":
        object.__setattr__(params, "seed", 2**64)
    elif case == "n over max_num_seqs":
        params = dataclasses.replace(params, n=5)
    else:
        params = SamplingParams(max_tokens=300)
    before = state(engine)
    with pytest.raises(ValueError) as refused:
        engine.add_request("bad", prompt(2, 5), params)
    assert state(engine) == before
    if case == "too long":
        assert "request 'bad'" in str(refused.value)  # its own id, not a sequence number
    engine.abort_request("existing")
    engine.step()
    tokens = prompt(4, 6)
    [output] = engine.generate(tokens, GREEDY)
    assert output.outputs[0].token_ids == hf_greedy(reference, tokens, 5)


def test_forked_samples_count_against_max_num_seqs() -> None:
    engine, _ = engine_pair(max_num_seqs=4)
    engine.add_request("n4", prompt(1, 6), SamplingParams(max_tokens=6, n=4, seed=1))
    engine.add_request("other", prompt(2, 6), SamplingParams(max_tokens=6, seed=2))
    most = 0
    for _ in range(100):
        engine.step()
        counts = engine.scheduler.stats()
        most = max(most, counts["running"])
        if not engine.has_unfinished_requests():
            break
    assert not engine.has_unfinished_requests()
    assert most == 4 and engine.scheduler.stats()["preemptions"] == 0


def test_a_setting_that_would_strand_a_request_is_refused() -> None:
    engine, _ = engine_pair(num_blocks=33)
    with pytest.raises(ValueError, match="no request could ever be admitted"):
        engine.scheduler.reconfigure(watermark=0.999999)
    engine.add_request("long", prompt(1, 75), SamplingParams(max_tokens=5, temperature=0))
    with pytest.raises(ValueError, match="the cache fits"):
        engine.scheduler.reconfigure(watermark=0.5)
    for value in ("yes", 2, None):
        with pytest.raises(TypeError, match="enable_chunked_prefill"):
            engine.scheduler.reconfigure(enable_chunked_prefill=value)
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine.scheduler.reconfigure(max_num_seqs=10**9)
    finals = run(engine, {})
    assert len(finals["long"][1]) == 5


def test_a_window_wider_than_the_pool_serves_what_fits() -> None:
    from atb_mem import KVCachePool

    kv = KVCachePool(64, 4, num_layers=2, num_kv_heads=1, head_dim=8, device=None,
                     layer_types=["sliding_attention", "full_attention"],
                     sliding_window=2**20)
    kv.alloc_sequence(1, 29)
    for _ in range(10):
        kv.append_tokens([1])
    assert kv.seq_len(1) == 39


# ---- over HTTP ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Any:
    from atb_mem.serving.api_server import ApiServer

    engine = Engine.from_pretrained(str(checkpoint), device="cpu", num_blocks=64, block_size=4,
                                    max_num_seqs=8, max_num_batched_tokens=64)
    running = ApiServer(engine, "tiny", port=0).start()
    yield running
    running.shutdown()


def test_poisonous_requests_among_healthy_ones(server: Any, checkpoint: Path) -> None:
    import concurrent.futures

    import httpx

    reference = Engine.from_pretrained(str(checkpoint), device="cpu", num_blocks=64,
                                       block_size=4)
    healthy = [[5, 6, 7, 8 + index] for index in range(4)]
    bad = [({"prompt": [5, 6, 7, 8], "max_tokens": 3, "temperature": 1e-39}, 200),
           ({"prompt": [5, 6, 7, 8], "max_tokens": 3, "seed": 2**64 - 1, "n": 2}, 400),
           ({"prompt": [5, 6, 7, 8], "max_tokens": "5"}, 400),
           ({"prompt": [5, 6, 7, 8], "stream": "yes"}, 400),
           ({"prompt": [5, 6, 7, 8], "max_tokens": 3, "n": 9}, 400),
           # Extreme but valid retention and priority; then malformed retention.
           ({"prompt": [5, 6, 7, 8], "max_tokens": 3, "priority": 2**32 - 1,
             "retention": [[0, None, 100, 1e308], [2, 2**63 - 1, 0, None]],
             "decode_retention": [100, 0]}, 200),
           ({"prompt": [5, 6, 7, 8], "max_tokens": 3, "priority": 2**32}, 400),
           ({"prompt": [5, 6, 7, 8], "max_tokens": 3, "retention": [[0, 4, 101, None]]}, 400),
           ({"prompt": [5, 6, 7, 8], "max_tokens": 3, "retention": [[0, 2**63, 50, None]]},
            400),
           ({"prompt": [5, 6, 7, 8], "max_tokens": 3, "retention": [{"start": 0}]}, 400),
           ({"prompt": [5, 6, 7, 8], "max_tokens": 3, "retention": "all"}, 400),
           ({"prompt": [5, 6, 7, 8], "max_tokens": 3,
             "retention": [[0, 4, 50, None]] * 50_000}, 400),
           ({"prompt": [5, 6, 7, 8], "max_tokens": 3, "decode_retention": [50, "1s"]}, 400)]

    def post(body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", **body},
                          timeout=120)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        good = [pool.submit(post, {"prompt": ids, "max_tokens": 5, "temperature": 0})
                for ids in healthy]
        poisoned = [(pool.submit(post, body), status) for body, status in bad]
        for (future, status) in poisoned:
            response = future.result()
            assert response.status_code == status, response.text
            if status >= 400:
                assert "message" in response.json()["error"]
        for ids, future in zip(healthy, good, strict=True):
            [want] = reference.generate(ids, SamplingParams(max_tokens=5, temperature=0))
            assert future.result().json()["choices"][0]["text"] == want.outputs[0].text
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    missing = httpx.get(f"{server.url}/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def test_the_admin_check_reads_the_real_peer(server: Any,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Through uvicorn's own app stack, with every proxy trusted by the environment: a remote
    client that claims to be loopback is refused."""
    import asyncio

    import uvicorn

    from atb_mem.serving.admin import AdminState

    monkeypatch.setenv("FORWARDED_ALLOW_IPS", "*")
    config = uvicorn.Config(server.app, proxy_headers=server.server.config.proxy_headers)
    config.load()

    async def get(client: str, headers: list[tuple[bytes, bytes]]) -> int:
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "GET", "scheme": "http", "path": "/admin/config",
                 "raw_path": b"/admin/config", "query_string": b"", "root_path": "",
                 "headers": headers, "client": (client, 5000), "server": ("127.0.0.1", 80)}
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await config.loaded_app(scope, receive, send)
        return int(sent[0]["status"])

    forged = [(b"x-forwarded-for", b"127.0.0.1")]
    assert asyncio.run(get("203.0.113.7", forged)) == 403
    assert asyncio.run(get("127.0.0.1", forged)) == 403  # a local proxy: not trusted either
    assert asyncio.run(get("127.0.0.1", [])) == 200
    with pytest.raises(ValueError, match="empty"):
        AdminState(admin_token="")
    assert not AdminState(admin_token="t", allow_loopback=False).allow_loopback


@pytest.mark.parametrize(("extra", "fragment"), [
    ({"live": "false"}, "live must be true or false"),
    ({"persist": 1}, "persist must be true or false"),
    ({"watch_s": 1e308}, "watch_s"),
])
def test_admin_flags_are_strict(server: Any, extra: dict[str, Any], fragment: str) -> None:
    import httpx

    body = {"set": {"max_num_seqs": 4}, "live": True, "watch_s": 1, **extra}
    response = httpx.post(f"{server.url}/admin/config", json=body, timeout=30)
    assert response.status_code == 400 and fragment in response.json()["error"]["message"]
    assert httpx.get(f"{server.url}/admin/config").json()["config"]["max_num_seqs"] == 8


def test_a_watch_can_be_cancelled_and_persisting_nowhere_is_refused(server: Any) -> None:
    import httpx

    url = f"{server.url}/admin/config"
    nowhere = httpx.post(url, json={"set": {"max_num_seqs": 4}, "live": True, "watch_s": 1,
                                    "persist": True}, timeout=30)
    assert nowhere.status_code == 400  # the server has no --config
    applied = httpx.post(url, json={"set": {"max_num_seqs": 4}, "live": True,
                                    "watch_s": 3600}, timeout=30)
    assert applied.status_code == 200, applied.text
    cancelled = httpx.delete(f"{url}/watch", timeout=30)
    assert cancelled.status_code == 200 and cancelled.json()["config"]["max_num_seqs"] == 8
    state = httpx.get(url).json()
    assert state["watching"] is False and state["config"]["max_num_seqs"] == 8
    assert state["history"][-1]["reason"] == "cancelled"
    assert httpx.delete(f"{url}/watch", timeout=30).status_code == 409


def test_persisting_into_a_missing_directory_is_refused(checkpoint: Path,
                                                        tmp_path: Path) -> None:
    import httpx

    from atb_mem.serving.api_server import ApiServer

    engine = Engine.from_pretrained(str(checkpoint), device="cpu", num_blocks=32,
                                    block_size=4)
    running = ApiServer(engine, "tiny", port=0,
                        config_path=str(tmp_path / "missing" / "config.json")).start()
    try:
        response = httpx.post(f"{running.url}/admin/config", json={
            "set": {"max_num_seqs": 4}, "live": True, "watch_s": 0.2, "persist": True},
            timeout=30)
        assert response.status_code == 400 and "cannot write" in response.text
        assert httpx.get(f"{running.url}/health").status_code == 200
    finally:
        running.shutdown()


def test_health_reports_a_stuck_engine(checkpoint: Path) -> None:
    import threading
    import time

    import httpx

    from atb_mem.serving.api_server import ApiServer

    engine = Engine.from_pretrained(str(checkpoint), device="cpu", num_blocks=32,
                                    block_size=4)
    release = threading.Event()
    execute = engine.runner.execute

    def hang(plan: Any) -> Any:
        release.wait(30)
        return execute(plan)

    engine.runner.execute = hang  # type: ignore[method-assign]
    running = ApiServer(engine, "tiny", port=0, health_stall_s=0.3).start()
    try:
        assert httpx.get(f"{running.url}/health").status_code == 200
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
        request = threading.Thread(target=lambda: httpx.post(
            f"{running.url}/v1/completions", json=body, timeout=60))
        request.start()
        statuses = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and 503 not in statuses:
            statuses.append(httpx.get(f"{running.url}/health").status_code)
            time.sleep(0.1)
        assert statuses[-1] == 503
        release.set()
        request.join(60)
        assert httpx.get(f"{running.url}/health").status_code == 200
    finally:
        release.set()
        running.shutdown()

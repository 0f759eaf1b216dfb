"""Admission batching on ``atb-mem serve``: requests wait in a ``DynamicBatchScheduler`` and
reach the engine together; its ``max_batch_size``/``timeout_ms`` change live through
``/admin/config`` like the engine scheduler's settings, all or nothing; an abort takes a waiting
request out before the engine sees it."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.serving.test_admin import MODEL, admin, new_engine

LONG_MS = 600_000.0  # a batch that never times out within a test


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def batcher(max_batch_size: int = 2, timeout_ms: float = LONG_MS) -> Any:
    from atb_mem.scheduling.request_batching import DynamicBatchScheduler

    return DynamicBatchScheduler(max_batch_size, timeout_ms)


@pytest.fixture()
def server(checkpoint: Path) -> Iterator[Any]:
    from atb_mem.serving.api_server import ApiServer

    running = ApiServer(new_engine(checkpoint), MODEL, port=0, admission=batcher()).start()
    yield running
    running.shutdown()


class Completion(threading.Thread):
    """One /v1/completions request from its own thread; ``text`` once it has answered."""

    def __init__(self, url: str, prompt: str) -> None:
        super().__init__(daemon=True)
        self.url, self.prompt = url, prompt
        self.text: str | None = None

    def run(self) -> None:
        import httpx

        answer = httpx.post(f"{self.url}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": self.prompt, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True})
        assert answer.status_code == 200, answer.text
        self.text = answer.json()["choices"][0]["text"]


def expected_text(checkpoint: Path, prompt: str) -> str:
    from atb_mem.serving import SamplingParams

    [output] = new_engine(checkpoint).generate(
        prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    return str(output.outputs[0].text)


def test_requests_wait_for_their_batch_then_complete_together(server: Any,
                                                              checkpoint: Path) -> None:
    admission, engine = server.engine_loop.admission, server.engine_loop.engine
    first = Completion(server.url, "the first prompt")
    first.start()
    wait_for(lambda: len(admission) == 1, "the request to wait in the batcher")
    time.sleep(0.2)  # would let a request that skipped the batcher reach the engine
    assert first.is_alive() and not engine.has_unfinished_requests()

    second = Completion(server.url, "and the second one")
    second.start()
    first.join(120)
    second.join(120)
    assert admission.stats()["batches"] == 1
    assert admission.stats()["last_batch_size"] == 2
    assert first.text == expected_text(checkpoint, "the first prompt")
    assert second.text == expected_text(checkpoint, "and the second one")


def test_a_live_timeout_change_releases_a_waiting_request(server: Any) -> None:
    waiting = Completion(server.url, "a lonely prompt")
    waiting.start()
    wait_for(lambda: len(server.engine_loop.admission) == 1, "the request to wait")
    answer = admin(server, {"set": {"timeout_ms": 1}, "live": True, "watch_s": 600})
    assert answer.status_code == 200, answer.text
    assert answer.json()["previous"]["timeout_ms"] == LONG_MS
    waiting.join(120)
    assert waiting.text is not None
    config = admin(server).json()["config"]
    assert (config["max_batch_size"], config["timeout_ms"]) == (2, 1)


def test_a_bad_value_for_either_scheduler_changes_neither(server: Any) -> None:
    before = admin(server).json()["config"]
    for changes in ({"max_num_seqs": 3, "max_batch_size": 0},
                    {"max_num_seqs": 0, "max_batch_size": 5},
                    {"timeout_ms": "soon"}):
        answer = admin(server, {"set": changes, "live": True, "watch_s": 60})
        assert answer.status_code == 400, changes
        assert admin(server).json()["config"] == before
    assert server.engine_loop.admission.config["max_batch_size"] == 2


def test_a_server_without_a_batcher_says_how_to_get_one(checkpoint: Path) -> None:
    from atb_mem.serving.api_server import ApiServer

    running = ApiServer(new_engine(checkpoint), MODEL, port=0).start()
    try:
        answer = admin(running, {"set": {"max_batch_size": 4}, "live": True})
        assert answer.status_code == 400
        assert "--max-batch-size" in answer.json()["error"]["message"]
        assert "max_batch_size" not in admin(running).json()["config"]
    finally:
        running.shutdown()


def test_live_settings_roll_back_both_schedulers(checkpoint: Path) -> None:
    from atb_mem.serving.live_settings import LiveSettings

    engine = new_engine(checkpoint)
    settings = LiveSettings(engine.scheduler, batcher())
    original = settings.check()
    previous = settings.apply(max_num_seqs=3, max_batch_size=7, timeout_ms=5)
    assert previous == original
    assert settings.check() == original | {"max_num_seqs": 3, "max_batch_size": 7,
                                           "timeout_ms": 5}
    settings.apply(**previous)
    assert settings.check() == original


def test_an_abort_takes_a_waiting_request_out_before_the_engine_sees_it(
        checkpoint: Path) -> None:
    from atb_mem.serving import SamplingParams
    from atb_mem.serving.engine_loop import ACCEPTED, EngineLoop

    engine = new_engine(checkpoint)
    loop = EngineLoop(engine, admission=batcher()).start()
    params = SamplingParams(max_tokens=4)

    async def scenario() -> list[Any]:
        gone = loop.submit("a client that leaves", params)
        wait_for(lambda: len(loop.admission) == 1, "the request to wait")
        loop.abort(gone.request_id)
        assert len(loop.admission) == 0
        streams = [loop.submit(prompt, params) for prompt in ("one", "two")]
        outputs = []
        for stream in streams:
            assert await stream.get() == ACCEPTED
            while not stream.finished:
                outputs.append(await stream.get())
        assert gone.queue.empty()  # neither accepted nor refused: it never reached the engine
        return outputs

    try:
        outputs = asyncio.run(scenario())
    finally:
        loop.stop()
    assert {output.request_id for output in outputs} == {"req-2", "req-3"}
    assert loop.admission.stats()["requests_batched"] == 2


def test_stopping_refuses_the_requests_still_waiting(checkpoint: Path) -> None:
    from atb_mem.serving import SamplingParams
    from atb_mem.serving.engine_loop import EngineLoop

    loop = EngineLoop(new_engine(checkpoint), admission=batcher()).start()

    async def scenario() -> Any:
        stream = loop.submit("never batched", SamplingParams(max_tokens=4))
        wait_for(lambda: len(loop.admission) == 1, "the request to wait")
        await asyncio.to_thread(loop.stop)
        return await asyncio.wait_for(stream.get(), 10)

    item = asyncio.run(scenario())
    assert isinstance(item, RuntimeError) and "stopped" in str(item)

"""DynamicBatchScheduler: deterministic with an injected clock, plus threads and asyncio."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import CancelledError

import pytest

import atb_mem
from atb_mem import DynamicBatchScheduler, QueueFullError, RequestTimeoutError


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def scheduler(**kwargs) -> tuple[DynamicBatchScheduler, Clock]:
    clock = Clock()
    return DynamicBatchScheduler(clock=clock, **kwargs), clock


def test_released_exactly_at_the_timeout_and_never_above_max() -> None:
    batcher, clock = scheduler(max_batch_size=4, timeout_ms=50)
    futures = [batcher.submit(i) for i in range(10)]
    sizes = []
    while (batch := batcher.next_batch(timeout=0)) is not None:
        sizes.append(len(batch))
        batch.set_results(batch.items)
    assert sizes == [4, 4]
    clock.now += 0.049999
    assert batcher.next_batch(timeout=0) is None
    clock.now += 0.000001
    batch = batcher.next_batch(timeout=0)
    assert batch.items == [8, 9]
    batch.set_results(["a", "b"])
    assert [f.result() for f in futures] == [*range(8), "a", "b"]


def test_priorities_first_come_first_served_and_preferred_sizes() -> None:
    batcher, _ = scheduler(max_batch_size=8, timeout_ms=10, priority_levels=3,
                               preferred_batch_sizes=[3])
    for item, priority in [("low1", 2), ("mid", 1), ("low2", 2)]:
        batcher.submit(item, priority=priority)
    batch = batcher.next_batch(timeout=0)  # a preferred size of 3 is there: no waiting
    assert batch.items == ["mid", "low1", "low2"]
    batcher.submit("x", priority=0)
    assert batcher.next_batch(timeout=0) is None
    with pytest.raises(ValueError, match="priority 3"):
        batcher.submit("bad", priority=3)
    assert len(batcher) == 1


def test_queue_full_rejects_at_once_and_changes_nothing() -> None:
    batcher, _ = scheduler(max_batch_size=8, timeout_ms=10, max_queue_size=2)
    batcher.submit(1)
    batcher.submit(2)
    with pytest.raises(QueueFullError, match="full"):
        batcher.submit(3)
    assert len(batcher) == 2


def test_request_timeouts_reject_or_delay() -> None:
    batcher, clock = scheduler(max_batch_size=8, timeout_ms=1000, default_timeout_ms=20)
    late = batcher.submit("late")
    patient = batcher.submit("patient", timeout_ms=500)
    clock.now += 0.02
    assert batcher.next_batch(timeout=0) is None
    with pytest.raises(RequestTimeoutError):
        late.result(timeout=0)
    assert not patient.done() and len(batcher) == 1
    delayed, clock = scheduler(max_batch_size=8, timeout_ms=100, default_timeout_ms=20,
                               timeout_action="delay")
    kept = delayed.submit("kept")
    clock.now += 0.1
    batch = delayed.next_batch(timeout=0)
    batch.set_results(["done"])
    assert kept.result() == "done"


def test_cancelled_requests_leave_the_queue() -> None:
    batcher, _ = scheduler(max_batch_size=2, timeout_ms=10)
    first, second, third = (batcher.submit(i) for i in range(3))
    assert second.cancel()
    assert len(batcher) == 2
    batch = batcher.next_batch(timeout=0)
    assert batch.items == [0, 2]
    batch.set_exception(ValueError("model failed"))
    with pytest.raises(ValueError, match="model failed"):
        first.result()
    assert second.cancelled() and isinstance(third.exception(), ValueError)


def test_batch_misuse_is_refused_and_resolves_nothing() -> None:
    batcher, _ = scheduler(max_batch_size=2, timeout_ms=0)
    futures = [batcher.submit(i) for i in range(2)]
    batch = batcher.next_batch(timeout=0)
    with pytest.raises(ValueError, match="expected 2 results"):
        batch.set_results([1])
    assert not any(f.done() for f in futures)
    batch.set_results([1, 2])
    with pytest.raises(atb_mem.AtbMemError, match="already completed"):
        batch.set_results([1, 2])
    with pytest.raises(TypeError):
        batch.set_exception("not an exception")


def test_preserve_ordering_delivers_batches_in_release_order() -> None:
    batcher, _ = scheduler(max_batch_size=1, timeout_ms=0, preserve_ordering=True)
    first, second = batcher.submit("a"), batcher.submit("b")
    batch_a, batch_b = batcher.next_batch(timeout=0), batcher.next_batch(timeout=0)
    batch_b.set_results(["B"])
    assert not second.done()
    batch_a.set_results(["A"])
    assert (first.result(), second.result()) == ("A", "B")


def test_close_drains_or_cancels() -> None:
    batcher, clock = scheduler(max_batch_size=8, timeout_ms=1000)
    kept = batcher.submit("kept")
    batcher.close(drain=True)
    with pytest.raises(atb_mem.AtbMemError, match="closed"):
        batcher.submit("late")
    batch = batcher.next_batch(timeout=0) or batcher.next_batch(timeout=0)
    clock.now += 1.0
    batch = batch or batcher.next_batch(timeout=0)
    batch.set_results(["ok"])
    assert kept.result() == "ok"
    assert batcher.next_batch() is None  # closed and empty: returns at once
    dropped, _ = scheduler(max_batch_size=8, timeout_ms=1000)
    waiting = dropped.submit("x")
    dropped.close(drain=False)
    assert waiting.cancelled() and dropped.next_batch() is None


def test_bad_configuration_is_refused() -> None:
    for kwargs, error in [({"max_batch_size": 0}, ValueError), ({"timeout_ms": -1}, ValueError),
                          ({"timeout_ms": "5"}, TypeError), ({"priority_levels": 0}, ValueError),
                          ({"preferred_batch_sizes": [9]}, ValueError),
                          ({"max_queue_size": 0}, ValueError),
                          ({"timeout_action": "drop"}, ValueError)]:
        with pytest.raises(error):
            DynamicBatchScheduler(**kwargs)


def test_reconfigure_validates_then_applies_at_the_next_batch() -> None:
    batcher, _ = scheduler(max_batch_size=4, timeout_ms=10)
    with pytest.raises(ValueError):
        batcher.reconfigure(max_batch_size=0)
    with pytest.raises(ValueError, match="unknown"):
        batcher.reconfigure(batch=3)
    assert batcher.config["max_batch_size"] == 4
    for i in range(6):
        batcher.submit(i)
    previous = batcher.reconfigure(max_batch_size=2)
    assert previous["max_batch_size"] == 4
    assert len(batcher.next_batch(timeout=0)) == 2
    assert batcher.config["max_batch_size"] == 2
    batcher.reconfigure(**previous)
    assert len(batcher.next_batch(timeout=0)) == 4


def test_eight_producers_every_request_ends_exactly_once() -> None:
    batcher = DynamicBatchScheduler(max_batch_size=32, timeout_ms=1, max_queue_size=100_000)
    seen: list[int] = []
    consumers = [batcher.run(lambda items: (seen.extend(items), [i * 2 for i in items])[1])
                 for _ in range(2)]
    futures: dict[int, object] = {}
    lock = threading.Lock()
    start = threading.Barrier(8)

    def produce(worker: int) -> None:
        start.wait()
        mine = {worker * 10_000 + i: batcher.submit(worker * 10_000 + i) for i in range(10_000)}
        with lock:
            futures.update(mine)

    producers = [threading.Thread(target=produce, args=(w,)) for w in range(8)]
    for thread in producers:
        thread.start()
    for thread in producers:
        thread.join(60)
    assert all(f.result(timeout=60) == key * 2 for key, f in futures.items())
    batcher.close()
    for thread in consumers:
        thread.join(10)
        assert not thread.is_alive()
    assert len(futures) == 80_000 and sorted(seen) == sorted(futures)


def test_reconfigure_while_eight_threads_submit() -> None:
    batcher = DynamicBatchScheduler(max_batch_size=16, timeout_ms=1)
    sizes: list[int] = []
    consumer = batcher.run(lambda items: (sizes.append(len(items)), items)[1])
    start = threading.Barrier(9)
    futures = []
    lock = threading.Lock()

    def produce() -> None:
        start.wait()
        mine = [batcher.submit(i) for i in range(2000)]
        with lock:
            futures.extend(mine)

    threads = [threading.Thread(target=produce) for _ in range(8)]
    for thread in threads:
        thread.start()
    start.wait()
    previous = batcher.reconfigure(max_batch_size=4, timeout_ms=2)
    assert previous["max_batch_size"] == 16
    for thread in threads:
        thread.join(60)
    assert all(f.result(timeout=60) is not None for f in futures)
    batcher.close()
    consumer.join(10)
    assert max(sizes) <= 16 and sum(sizes) == 16_000
    assert batcher.config["max_batch_size"] == 4


def test_asyncio_server_shape() -> None:
    async def main() -> list[int]:
        batcher = DynamicBatchScheduler(max_batch_size=8, timeout_ms=2)

        async def serve() -> None:
            async for batch in batcher:
                batch.set_results([item + 1 for item in batch.items])

        server = asyncio.create_task(serve())
        results = await asyncio.gather(*(batcher.submit_async(i) for i in range(200)))
        batcher.close()
        await asyncio.wait_for(server, 10)
        return results

    assert asyncio.run(main()) == [i + 1 for i in range(200)]


def test_cancelled_future_never_reaches_a_handler() -> None:
    batcher, _ = scheduler(max_batch_size=2, timeout_ms=0)
    future = batcher.submit("x")
    future.cancel()
    assert batcher.next_batch(timeout=0) is None
    with pytest.raises(CancelledError):
        future.result()


def test_core_configuration_round_trips_and_refuses_bad_dicts() -> None:
    from atb_mem import _core

    batcher = DynamicBatchScheduler(max_batch_size=4, timeout_ms=5, priority_levels=2)
    core = batcher._core
    config = core.config()
    assert core.set_config(config) == config  # what config() returns is a valid configuration
    for bad, error in [({**config, "speed": 1}, ValueError), ({"max_batch_size": 4}, ValueError),
                       ([("max_batch_size", 4)], TypeError),
                       ({**config, "timeout_action": 3}, ValueError)]:
        with pytest.raises(error):
            core.set_config(bad)
        with pytest.raises(error):
            _core.RequestBatcher(bad)
    assert core.config() == config


def test_bad_submit_arguments_change_nothing() -> None:
    batcher, _ = scheduler(max_batch_size=4, timeout_ms=10, priority_levels=2)
    batcher.submit("kept")
    for kwargs, error in [({"timeout_ms": -1}, ValueError), ({"timeout_ms": "5"}, TypeError),
                          ({"priority": -1}, ValueError), ({"priority": 2}, ValueError),
                          ({"priority": 1.5}, TypeError)]:
        with pytest.raises(error):
            batcher.submit("bad", **kwargs)
        assert len(batcher) == 1 and batcher.stats()["queue_length"] == 1


async def cancel_one_wait_then_serve(round_: int) -> tuple[list, list[int]]:
    """Cancels an ``__anext__`` (timed out or cancelled outright) at a racing moment, with
    requests submitted before and after it, then serves the rest with a fresh ``async for``."""
    batcher = DynamicBatchScheduler(max_batch_size=4, timeout_ms=1)
    futures = [batcher.submit(i) for i in range(round_ % 3 * 3)]  # 0, 3 or 6 waiting already
    served: list[int] = []

    def serve(batch: atb_mem.Batch) -> None:
        served.extend(batch.items)
        batch.set_results([item * 10 for item in batch.items])

    delay = round_ % 5 * 0.001
    if round_ % 2:
        try:  # a batch that arrives in time is this consumer's own: it must serve it
            serve(await asyncio.wait_for(anext(batcher), delay))
        except asyncio.TimeoutError:
            pass
    else:
        waiting = asyncio.ensure_future(anext(batcher))
        await asyncio.sleep(delay)
        if not waiting.cancel():
            serve(waiting.result())
    futures += [batcher.submit(i) for i in range(len(futures), len(futures) + 5)]
    await asyncio.sleep(0.002)  # long enough for a stray thread to take a batch
    batcher.close()

    async def serve_all() -> None:
        async for batch in batcher:
            serve(batch)

    await asyncio.wait_for(serve_all(), 5)
    return futures, served


def test_cancelled_async_wait_loses_no_request() -> None:
    for round_ in range(60):
        futures, served = asyncio.run(cancel_one_wait_then_serve(round_))
        assert [future.result(timeout=5) for future in futures] == \
            [i * 10 for i in range(len(futures))], f"round {round_}"
        assert sorted(served) == list(range(len(futures)))  # each request served once

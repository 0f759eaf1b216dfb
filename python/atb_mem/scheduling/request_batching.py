"""Request batching: ``DynamicBatchScheduler`` (what Triton's dynamic batcher and Ray Serve's
``@serve.batch`` do), for servers that batch whole requests.

The policy (which requests form the next batch, and when) is the Rust core's
``RequestBatcher``, deterministic with time as an argument. This module keeps the items and
their futures, wakes consumers when a batch is due, and guarantees that every submitted
request ends exactly once: with a result, an exception, or a cancellation.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, cast

from atb_mem import _core
from atb_mem._core import AtbMemError, RequestTimeoutError
from atb_mem._types import (
    DynamicBatchSchedulerConfig,
    DynamicBatchSchedulerStats,
    RequestBatcherConfig,
    TimeoutAction,
)
from atb_mem.scheduling._settings import merged_settings
from atb_mem.scheduling._times import MILLISECOND_NS, to_ns

__all__ = ["Batch", "DynamicBatchScheduler"]

_SETTINGS = ("max_batch_size", "timeout_ms", "preferred_batch_sizes", "max_queue_size",
             "priority_levels", "default_timeout_ms", "timeout_action")


def _ms_to_ns(name: str, value: Any) -> int | None:
    return None if value is None else to_ns(name, value, MILLISECOND_NS, "milliseconds")


class _AsyncClaim:
    """One ``__anext__``'s claim on the batch its executor thread takes. Both fields change
    only under the scheduler's lock, which is what makes cancelling it race-free."""

    __slots__ = ("batch", "cancelled")

    def __init__(self) -> None:
        self.batch: Batch | None = None
        self.cancelled = False


class Batch:
    """Requests released together. Complete it once, with ``set_results`` (one result per
    item, in order) or ``set_exception``."""

    __slots__ = ("_done", "_futures", "_scheduler", "_sequence", "items")

    def __init__(self, scheduler: DynamicBatchScheduler, sequence: int, items: list[Any],
                 futures: list[Future[Any]]) -> None:
        self.items = items
        self._futures = futures
        self._scheduler = scheduler
        self._sequence = sequence
        self._done = False

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.items)

    def __repr__(self) -> str:
        return f"Batch(size={len(self.items)})"

    def set_results(self, results: Iterable[Any]) -> None:
        results = list(results)
        if len(results) != len(self.items):
            raise ValueError(f"expected {len(self.items)} results, got {len(results)}")
        self._scheduler._complete(self, [(future, result, None)
                                         for future, result in zip(self._futures, results,
                                                                   strict=True)])

    def set_exception(self, exception: BaseException) -> None:
        if not isinstance(exception, BaseException):
            raise TypeError(f"expected an exception, got {type(exception).__name__}")
        self._scheduler._complete(self, [(future, None, exception) for future in self._futures])


class DynamicBatchScheduler:
    """Groups submitted requests into batches of up to ``max_batch_size``.

    A batch is released when ``max_batch_size`` requests wait, when one of
    ``preferred_batch_sizes`` can be formed, or when its oldest request has waited
    ``timeout_ms``, whichever comes first; lower ``priority`` numbers go first, and within a
    level first come, first served. A full queue (``max_queue_size``) rejects at once with
    ``QueueFullError``. A request that outlives its own timeout (``timeout_ms=`` at submit, or
    ``default_timeout_ms``) fails with ``RequestTimeoutError``, or is kept with
    ``timeout_action="delay"``. With ``preserve_ordering``, batches' results are delivered in
    the order the batches were released.

    Consumers pull (``next_batch()``, then ``batch.set_results(...)``), run a handler in a
    thread (``run(handler)``), or iterate asynchronously (``async for batch in scheduler``).
    ``clock`` (seconds, monotonic) can be injected for deterministic tests.
    """

    def __init__(self, max_batch_size: int = 8, timeout_ms: float = 50, *,
                 preferred_batch_sizes: Sequence[int] = (), max_queue_size: int | None = None,
                 priority_levels: int = 1, default_timeout_ms: float | None = None,
                 timeout_action: TimeoutAction = "reject", preserve_ordering: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._settings = self._validated({
            "max_batch_size": max_batch_size, "timeout_ms": timeout_ms,
            "preferred_batch_sizes": tuple(preferred_batch_sizes),
            "max_queue_size": max_queue_size, "priority_levels": priority_levels,
            "default_timeout_ms": default_timeout_ms, "timeout_action": timeout_action})
        self._core = self._make_core(self._settings)
        self._clock = clock
        self._preserve_ordering = bool(preserve_ordering)
        self._condition = threading.Condition()
        self._pending: dict[int, tuple[Any, Future[Any]]] = {}
        self._next_id = 0
        self._next_sequence = 0
        self._next_to_deliver = 0
        self._held: dict[int, list[tuple[Future[Any], Any, BaseException | None]]] = {}
        # Released batches whose async consumer was cancelled; served before any new one.
        self._returned: deque[Batch] = deque()
        self._new_settings: DynamicBatchSchedulerConfig | None = None
        self._closed = False
        self._released = (0, 0, 0)  # batches, requests, size of the last batch

    # ---- configuration ---------------------------------------------------------------------

    @staticmethod
    def _core_config(settings: DynamicBatchSchedulerConfig) -> RequestBatcherConfig:
        """The settings in the core's terms (nanoseconds)."""
        return {"max_batch_size": settings["max_batch_size"],
                "timeout_ns": to_ns("timeout_ms", settings["timeout_ms"], MILLISECOND_NS,
                                    "milliseconds"),
                "preferred_batch_sizes": list(settings["preferred_batch_sizes"]),
                "max_queue_size": settings["max_queue_size"],
                "priority_levels": settings["priority_levels"],
                "default_timeout_ns": _ms_to_ns("default_timeout_ms",
                                                settings["default_timeout_ms"]),
                "timeout_action": settings["timeout_action"]}

    @classmethod
    def _make_core(cls, settings: DynamicBatchSchedulerConfig) -> _core.RequestBatcher:
        return _core.RequestBatcher(cls._core_config(settings))

    def _validated(self, settings: DynamicBatchSchedulerConfig) -> DynamicBatchSchedulerConfig:
        if settings["timeout_ms"] is None:
            raise TypeError("timeout_ms must be a number of milliseconds, got None")
        _core.RequestBatcher.check_config(self._core_config(settings))
        return settings

    @property
    def config(self) -> DynamicBatchSchedulerConfig:
        """The configuration in force (a reconfiguration counts once applied)."""
        with self._condition:
            return self._settings.copy()

    def reconfigure(self, **changes: Any) -> DynamicBatchSchedulerConfig:
        """Changes settings while requests flow. Validated at once (a bad value changes
        nothing, and raises); applied atomically at the next batch boundary. Returns the
        previous configuration, so a caller can roll back with ``reconfigure(**previous)``."""
        with self._condition:
            new = self.check_settings(**changes)
            previous = self._settings.copy()
            self._new_settings = new
            self._condition.notify_all()
            return previous

    def check_settings(self, **changes: Any) -> DynamicBatchSchedulerConfig:
        """The configuration ``changes`` would make (over a reconfiguration not yet applied),
        validated (``ValueError``/``TypeError`` otherwise); changes nothing."""
        with self._condition:
            new = merged_settings(_SETTINGS, self._new_settings or self._settings, changes)
        if "preferred_batch_sizes" in changes:
            new["preferred_batch_sizes"] = tuple(changes["preferred_batch_sizes"])
        # _validated checks the result: the core refuses what is not a setting of its own.
        return self._validated(cast(DynamicBatchSchedulerConfig, new))

    def _apply_new_settings(self) -> None:
        if self._new_settings is None:
            return
        settings, self._new_settings = self._new_settings, None
        self._core.set_config(self._core_config(settings))
        self._settings = settings

    # ---- producers -------------------------------------------------------------------------

    def _now_ns(self) -> int:
        return int(self._clock() * 1e9)

    def submit(self, item: Any, *, priority: int = 0,
               timeout_ms: float | None = None) -> Future[Any]:
        """Queues a request; returns the ``Future`` of its result."""
        timeout_ns = _ms_to_ns("timeout_ms", timeout_ms)
        future: Future[Any] = Future()
        with self._condition:
            if self._closed:
                raise AtbMemError("the scheduler is closed")
            request_id = self._next_id
            self._core.submit(request_id, priority, self._now_ns(), timeout_ns)
            self._next_id += 1
            self._pending[request_id] = (item, future)
            self._condition.notify_all()
        future.add_done_callback(lambda done: self._on_cancel(request_id, done))
        return future

    async def submit_async(self, item: Any, *, priority: int = 0,
                           timeout_ms: float | None = None) -> Any:
        """``submit`` for asyncio servers: awaits the result."""
        return await asyncio.wrap_future(self.submit(item, priority=priority,
                                                     timeout_ms=timeout_ms))

    def _on_cancel(self, request_id: int, future: Future[Any]) -> None:
        if future.cancelled():
            with self._condition:
                if self._pending.pop(request_id, None) is not None:
                    self._core.cancel(request_id)

    def __len__(self) -> int:
        """Requests waiting."""
        with self._condition:
            return len(self._pending)

    # ---- consumers -------------------------------------------------------------------------

    def next_batch(self, timeout: float | None = None) -> Batch | None:
        """The next batch, waiting up to ``timeout`` seconds (forever with None or infinity) for
        one to be due. None on timeout, or once the scheduler is closed and empty."""
        if timeout is not None:
            if timeout != timeout:  # NaN, the one number unequal to itself
                raise ValueError("timeout must be a number of seconds or None, got nan")
            if timeout >= threading.TIMEOUT_MAX:
                timeout = None  # Condition.wait() refuses a longer wait; forever is the same
        return self._next_batch(timeout, None)

    def _next_batch(self, timeout: float | None, claim: _AsyncClaim | None) -> Batch | None:
        give_up = None if timeout is None else time.monotonic() + timeout
        while True:
            expired: list[Future[Any]] = []
            batch = None
            wakeup_ns = None
            with self._condition:
                if claim is not None and claim.cancelled:
                    return None  # nobody awaits this thread any more: take nothing
                if self._returned:
                    batch = self._returned.popleft()
                else:
                    self._apply_new_settings()
                    ids, expired_ids, wakeup_ns = self._core.poll(self._now_ns())
                    expired = [self._pending.pop(i)[1] for i in expired_ids]
                    if ids:
                        batch = self._start_batch(ids)
                if claim is not None:
                    claim.batch = batch
                finished = self._closed and not self._pending and not self._returned
                if batch is None and not finished and not expired:
                    waits = [] if give_up is None else [give_up - time.monotonic()]
                    if wakeup_ns is not None:
                        waits.append(max(0.0, (wakeup_ns - self._now_ns()) / 1e9))
                    wait = min(waits) if waits else None
                    if wait is not None and wait <= 0 and give_up is not None and \
                            time.monotonic() >= give_up:
                        return None
                    self._condition.wait(wait)
            for future in expired:
                if future.set_running_or_notify_cancel():
                    future.set_exception(RequestTimeoutError(
                        "the request waited longer than its timeout"))
            if batch is not None:
                return batch
            if finished:
                return None

    def _start_batch(self, ids: list[int]) -> Batch | None:
        items, futures = [], []
        for request_id in ids:
            item, future = self._pending.pop(request_id)
            if future.set_running_or_notify_cancel():
                items.append(item)
                futures.append(future)
        if not items:
            return None
        sequence = self._next_sequence
        self._next_sequence += 1
        batches, requests, _ = self._released
        self._released = (batches + 1, requests + len(items), len(items))
        return Batch(self, sequence, items, futures)

    def _complete(self, batch: Batch, outcomes: list[tuple[Future[Any], Any, Any]]) -> None:
        with self._condition:
            if batch._done:
                raise AtbMemError("this batch was already completed")
            batch._done = True
            if not self._preserve_ordering:
                ready = outcomes
            else:
                self._held[batch._sequence] = outcomes
                ready = []
                # Deliver in release order: batch k waits for every batch before it.
                while self._next_to_deliver in self._held:
                    ready.extend(self._held.pop(self._next_to_deliver))
                    self._next_to_deliver += 1
            self._condition.notify_all()
        for future, result, exception in ready:  # outside the lock: callbacks run here
            if exception is None:
                future.set_result(result)
            else:
                future.set_exception(exception)

    def run(self, handler: Callable[[list[Any]], Iterable[Any]]) -> threading.Thread:
        """Serves batches in a daemon thread: ``handler(items)`` returns one result per item;
        if it raises, every request of the batch fails with that exception. The thread ends
        once the scheduler is closed and empty."""
        def serve() -> None:
            while (batch := self.next_batch()) is not None:
                try:
                    results = handler(batch.items)
                    batch.set_results(results)
                except BaseException as error:  # every request must end
                    if not batch._done:
                        batch.set_exception(error)

        thread = threading.Thread(target=serve, name="atb-mem-batcher", daemon=True)
        thread.start()
        return thread

    def __aiter__(self) -> DynamicBatchScheduler:
        return self

    async def __anext__(self) -> Batch:
        claim = _AsyncClaim()
        try:
            batch = await asyncio.get_running_loop().run_in_executor(
                None, self._next_batch, None, claim)
        except BaseException:
            # Cancelled (a timeout, task.cancel()), and the executor thread cannot be stopped
            # from here: tell it to take nothing, and if it took a batch already, hand that
            # batch to the next consumer, so its requests still end.
            with self._condition:
                claim.cancelled = True
                if claim.batch is not None:
                    self._returned.append(claim.batch)
                self._condition.notify_all()
            raise
        if batch is None:
            raise StopAsyncIteration
        return batch

    def close(self, *, drain: bool = True) -> None:
        """Stops accepting requests. With ``drain`` the waiting ones are still released to
        consumers; without, they are cancelled (a batch already released, such as one a
        cancelled ``async for`` handed back, still goes to a consumer). Consumers get None once
        nothing is left."""
        with self._condition:
            self._closed = True
            cancelled = []
            if not drain:
                for request_id in self._core.drain():
                    cancelled.append(self._pending.pop(request_id)[1])
            self._condition.notify_all()
        for future in cancelled:
            future.cancel()

    def stats(self) -> DynamicBatchSchedulerStats:
        """Queue length, and the batches released so far."""
        with self._condition:
            batches, requests, last = self._released
            return {"queue_length": len(self._pending), "batches": batches,
                    "requests_batched": requests, "last_batch_size": last}

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> DynamicBatchScheduler:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

"""One thread owns the ``Engine``; everything else talks to it through commands.

HTTP handlers (asyncio) ``submit`` a request and read its outputs from a ``RequestStream``;
they never touch the engine. The loop thread applies the queued commands (add, abort)
between steps, steps while there is work, and hands each step's outputs to their streams
through the streams' event loops. A request the engine refuses gets the error as its first
item, so a handler can answer 400 before it starts a response.

A failure ends a request, never the loop: a request the engine fails (its sampling, say)
gets ``RequestFailed`` on its stream and the others run on; a step that raises fails the
requests in flight and the loop goes on serving new ones. Only ``stop()`` ends it.

With an ``admission`` batcher (a ``DynamicBatchScheduler``), submitted requests wait there
and reach the engine together, up to ``max_batch_size`` at a time or once the oldest has
waited ``timeout_ms``, so their prefills share steps instead of trickling in one per step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from atb_mem.scheduling.request_batching import DynamicBatchScheduler
from atb_mem.serving.config_guard import ConfigGuard, Decision, StepSample
from atb_mem.serving.engine import Engine
from atb_mem.serving.live_settings import LiveSettings
from atb_mem.serving.params import RequestOutput, SamplingParams
from atb_mem.serving.prompts import Prompt

__all__ = ["ChangeInProgress", "EngineLoop", "RequestFailed", "RequestStream"]

log = logging.getLogger("atb_mem.engine")


class ChangeInProgress(RuntimeError):
    """A configuration change is still being watched: one at a time."""


class RequestFailed(RuntimeError):
    """The engine ended this request with an error; the other requests went on."""

ACCEPTED = "accepted"


@dataclass
class RequestStream:
    """A request's outputs, as the loop thread produces them: first ``ACCEPTED`` or the
    exception that refused it, then ``RequestOutput`` deltas, the last one ``finished``."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    finished: bool = False
    arrival: float = field(default_factory=time.perf_counter)
    last_token_time: float | None = None

    def put(self, item: Any) -> bool:
        """From the loop thread: hands ``item`` to the stream's event loop; False when that
        loop is closed (nobody can read the stream any more)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            return False
        return True

    async def get(self) -> Any:
        item = await self.queue.get()
        if isinstance(item, RequestOutput) and item.finished:
            self.finished = True
        return item


class EngineLoop:
    """Runs ``engine`` in a thread of its own until ``stop()``. ``observe`` (optional) is
    called in the loop thread with (stream, output, now) for every delivered output.

    With a ``guard``, every step is sampled for it, configuration changes go through
    :meth:`reconfigure`, and the guard's decisions are applied here (a rollback reconfigures
    the scheduler back) and then passed to ``on_decision``.
    """

    def __init__(self, engine: Engine, observe: Any = None, guard: ConfigGuard | None = None,
                 on_decision: Any = None, admission: DynamicBatchScheduler | None = None) -> None:
        self.engine = engine
        self.admission = admission
        self.settings = LiveSettings(engine.scheduler, admission)
        # Requests in the admission batcher, with their place in its queue (None for a moment
        # while being submitted); an abort takes a request out of here, so it never reaches
        # the engine.
        self._admitting: dict[str, tuple[RequestStream, Future[Any] | None]] = {}
        self.observe = observe
        self.guard = guard
        self.on_decision = on_decision
        self._preemptions = 0
        self._step_tokens = 0
        self._first_token_latencies: list[float] = []
        self._commands: deque[tuple[str, Any]] = deque()
        self._wake = threading.Condition()
        self._streams: dict[str, RequestStream] = {}
        self._ids = itertools.count(1)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="atb-mem-engine", daemon=True)
        self.error: BaseException | None = None
        self.failed_steps = 0
        """Steps that raised (their requests in flight failed; the loop went on)."""
        self._progress_at = time.monotonic()

    def start(self) -> EngineLoop:
        self._thread.start()
        if self.admission is not None:
            self.admission.run(self._admit)
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def stalled_for(self) -> float:
        """Seconds since the engine last made progress (a step that ran tokens through the
        model, or ended requests) while work was pending; 0 when idle."""
        with self._wake:
            pending = self._commands or self._streams or self._admitting
        if not pending:
            return 0.0
        return max(time.monotonic() - self._progress_at, 0.0)

    def submit(self, prompt: Prompt, params: SamplingParams, prefix: str = "req") -> RequestStream:
        """Queues a request (call from a running event loop); returns its stream."""
        stream = RequestStream(f"{prefix}-{next(self._ids)}", asyncio.get_running_loop())
        if not self.alive:
            stream.queue.put_nowait(RuntimeError("the engine is not running"))
            return stream
        if self.admission is None:
            self._command("add", (stream, prompt, params))
            return stream
        with self._wake:
            self._admitting[stream.request_id] = (stream, None)
        try:
            future = self.admission.submit((stream, prompt, params))
        except Exception as error:  # a full queue, or a server stopping
            with self._wake:
                self._admitting.pop(stream.request_id, None)
            stream.queue.put_nowait(error)
            return stream
        with self._wake:
            if stream.request_id in self._admitting:
                self._admitting[stream.request_id] = (stream, future)
            else:  # aborted while being submitted
                future.cancel()
        return stream

    def _admit(self, items: list[Any]) -> list[None]:
        """The admission batcher's handler (its thread): a released batch goes to the engine
        in one go, less the requests aborted while they waited."""
        with self._wake:
            for item in items:
                if self._admitting.pop(item[0].request_id, None) is not None:
                    self._commands.append(("add", item))
            self._wake.notify()
        return [None] * len(items)

    def reconfigure(self, changes: dict[str, Any], watch_s: float) -> Future[dict[str, Any]]:
        """Applies scheduler settings at the next step boundary and has the guard watch them
        for ``watch_s`` seconds. The future gives the configuration they replaced, or the
        error that refused them (``ValueError``; ``ChangeInProgress``), nothing changed."""
        if self.guard is None:
            raise RuntimeError("this engine loop has no guard: changes are not watched")
        future: Future[dict[str, Any]] = Future()
        if not self.alive:
            future.set_exception(RuntimeError("the engine is not running"))
            return future
        self._command("reconfigure", (dict(changes), watch_s, future))
        return future

    def cancel_watch(self) -> Future[dict[str, Any]]:
        """Ends the watched change now and rolls it back; the future gives the configuration
        restored (``ChangeInProgress`` is not raised; ``ValueError`` when nothing is
        watched)."""
        future: Future[dict[str, Any]] = Future()
        if not self.alive:
            future.set_exception(RuntimeError("the engine is not running"))
            return future
        self._command("cancel_watch", future)
        return future

    def abort(self, request_id: str) -> None:
        """Cancels a request (a client that went away); its blocks are freed."""
        with self._wake:
            admitting = self._admitting.pop(request_id, None)
        if admitting is None:
            self._command("abort", request_id)
        elif admitting[1] is not None:
            admitting[1].cancel()  # leaves the batcher's queue, unless already released

    def stop(self, timeout: float = 10.0) -> None:
        """Aborts every request, stops the thread and waits for it."""
        if self.admission is not None:
            self.admission.close(drain=False)
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _command(self, kind: str, payload: Any) -> None:
        with self._wake:
            self._commands.append((kind, payload))
            self._wake.notify()

    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    while not (self._commands or self._stopping
                               or self.engine.has_unfinished_requests()):
                        if self.guard is not None and self.guard.watching:
                            # Idle while a change is watched: its period still ends.
                            self._wake.wait(1.0)
                            self.guard.check(time.perf_counter(), self._decide)
                        else:
                            self._wake.wait()
                    if self._stopping:
                        break
                    commands = list(self._commands)
                    self._commands.clear()
                if not (self._streams or self.engine.has_unfinished_requests()):
                    self._progress_at = time.monotonic()  # idle until now: nothing stalled
                busy_since = time.perf_counter()
                for kind, payload in commands:
                    self._apply(kind, payload)
                # A step also reports aborts (and drops the engine's record of them).
                if self.engine.has_unfinished_requests() or \
                        any(kind == "abort" for kind, _ in commands):
                    self._step()
                    self._sample_step(busy_since)
        except BaseException as error:  # not an Exception (a KeyboardInterrupt, say)
            self.error = error
        finally:
            self._close_all()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as error:
            # The engine could not confine it: the requests in flight fail, new ones are
            # still served.
            log.exception("atb-mem: an engine step failed; its requests in flight end")
            self.failed_steps += 1
            self._fail_in_flight(RequestFailed(f"the engine's step failed: {error}"))
            self._progress_at = time.monotonic()
            return
        if outputs or self.engine.last_step_tokens:
            self._progress_at = time.monotonic()
        self._deliver(outputs)

    def _fail_in_flight(self, error: RequestFailed) -> None:
        for request_id, stream in list(self._streams.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:  # a broken engine: the stream still hears why
                log.exception("atb-mem: aborting %s failed", request_id)
            stream.put(error)
        self._streams.clear()

    def _apply(self, kind: str, payload: Any) -> None:
        if kind == "add":
            stream, prompt, params = payload
            try:
                self.engine.add_request(stream.request_id, prompt, params)
            except Exception as error:  # refused (ValueError, TypeError), or worse: its own
                stream.put(error)
                return
            self._streams[stream.request_id] = stream
            if not stream.put(ACCEPTED):
                self._drop(stream.request_id)
        elif kind == "abort":
            self.engine.abort_request(payload)
        elif kind == "reconfigure":
            changes, watch_s, future = payload
            assert self.guard is not None
            try:
                if self.guard.watching:
                    raise ChangeInProgress("a configuration change is being watched; wait for "
                                           "its decision")
                previous = self.settings.apply(**changes)
                self.guard.begin(time.perf_counter(), changes, previous, watch_s)
            except Exception as error:  # ValueError, TypeError, ChangeInProgress
                future.set_exception(error)
            else:
                future.set_result(previous)
        elif kind == "cancel_watch":
            assert self.guard is not None
            try:
                decision = self.guard.cancel(time.perf_counter(), self._decide)
            except Exception as error:  # nothing watched
                payload.set_exception(error)
            else:
                payload.set_result(decision.config)

    def _sample_step(self, busy_since: float) -> None:
        if self.guard is None:
            return
        now = time.perf_counter()
        preemptions = self.engine.scheduler.stats()["preemptions"]
        stats = self.engine.kv_cache.stats()
        model_seconds, step_seconds = self.engine.last_step_seconds
        sample = StepSample(
            now=now, output_tokens=self._step_tokens,
            unfinished=self.engine.num_unfinished_requests,
            kv_usage=stats["blocks_used"] / max(stats["num_blocks"] - 1, 1),
            preemptions=preemptions - self._preemptions, model_seconds=model_seconds,
            step_seconds=step_seconds, busy_seconds=now - busy_since,
            first_token_latencies=tuple(self._first_token_latencies))
        self._preemptions = preemptions
        self._first_token_latencies.clear()
        self.guard.on_step(sample, self._decide)

    def _decide(self, decision: Decision) -> None:
        if decision.outcome == "rollback":
            try:
                self.settings.apply(**decision.config)
            except (ValueError, TypeError):
                # The old settings would strand a request admitted since: keep the new ones.
                log.exception("atb-mem: the rollback to %s was refused", decision.config)
        if self.on_decision is not None:
            try:
                self.on_decision(decision)
            except Exception:  # logging, counting, persisting: never the loop's end
                log.exception("atb-mem: handling the decision %s failed", decision.outcome)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        self._step_tokens = 0
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            new = sum(len(one.token_ids) for one in output.outputs)
            self._step_tokens += new
            if new and stream.last_token_time is None:
                self._first_token_latencies.append(now - stream.arrival)
            if self.observe is not None:
                try:
                    self.observe(stream, output, now)
                except Exception:  # metrics must not cost a request its output
                    log.exception("atb-mem: observing an output failed")
            if new:
                stream.last_token_time = now
            if output.error is not None:
                del self._streams[output.request_id]
                stream.put(RequestFailed(output.error))
            elif output.finished:
                del self._streams[output.request_id]
                stream.put(output)
            elif not stream.put(output):
                self._drop(output.request_id)

    def _drop(self, request_id: str) -> None:
        """A stream whose event loop has closed: its request is aborted, not left running,
        through the queue like a client's abort, so it is reported (and counted) as one."""
        self._command("abort", request_id)

    def _close_all(self) -> None:
        error = self.error or RuntimeError("the engine stopped")
        if self.admission is not None:
            self.admission.close(drain=False)
        with self._wake:
            refused = [stream for stream, _ in self._admitting.values()]
            refused += [payload[0] for kind, payload in self._commands if kind == "add"]
            self._admitting.clear()
            self._commands.clear()
        for stream in refused:
            stream.put(error)
        for request_id, stream in list(self._streams.items()):
            self.engine.abort_request(request_id)
            stream.put(error)
        self._streams.clear()

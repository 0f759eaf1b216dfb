"""One thread owns the ``Engine``; everything else talks to it through commands.

HTTP handlers (asyncio) ``submit`` a request and read its outputs from a ``RequestStream``;
they never touch the engine. The loop thread applies the queued commands (add, abort)
between steps, steps while there is work, and hands each step's outputs to their streams
through the streams' event loops. A request the engine refuses gets the error as its first
item, so a handler can answer 400 before it starts a response.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from atb_mem.serving.engine import Engine, Prompt
from atb_mem.serving.params import RequestOutput, SamplingParams

__all__ = ["EngineLoop", "RequestStream"]

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
    called in the loop thread with (stream, output, now) for every delivered output."""

    def __init__(self, engine: Engine, observe: Any = None) -> None:
        self.engine = engine
        self.observe = observe
        self._commands: deque[tuple[str, Any]] = deque()
        self._wake = threading.Condition()
        self._streams: dict[str, RequestStream] = {}
        self._ids = itertools.count(1)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="atb-mem-engine", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(self, prompt: Prompt, params: SamplingParams, prefix: str = "req") -> RequestStream:
        """Queues a request (call from a running event loop); returns its stream."""
        stream = RequestStream(f"{prefix}-{next(self._ids)}", asyncio.get_running_loop())
        if not self.alive:
            stream.queue.put_nowait(RuntimeError("the engine is not running"))
            return stream
        self._command("add", (stream, prompt, params))
        return stream

    def abort(self, request_id: str) -> None:
        """Cancels a request (a client that went away); its blocks are freed."""
        self._command("abort", request_id)

    def stop(self, timeout: float = 10.0) -> None:
        """Aborts every request, stops the thread and waits for it."""
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
                        self._wake.wait()
                    if self._stopping:
                        break
                    commands = list(self._commands)
                    self._commands.clear()
                for kind, payload in commands:
                    self._apply(kind, payload)
                # A step also reports aborts (and drops the engine's record of them).
                if self.engine.has_unfinished_requests() or \
                        any(kind == "abort" for kind, _ in commands):
                    self._deliver(self.engine.step())
        except BaseException as error:  # the engine broke: every waiting client must hear it
            self.error = error
        finally:
            self._close_all()

    def _apply(self, kind: str, payload: Any) -> None:
        if kind == "add":
            stream, prompt, params = payload
            try:
                self.engine.add_request(stream.request_id, prompt, params)
            except (ValueError, TypeError) as error:
                stream.put(error)
                return
            self._streams[stream.request_id] = stream
            if not stream.put(ACCEPTED):
                self._drop(stream.request_id)
        elif kind == "abort":
            self.engine.abort_request(payload)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.perf_counter()
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if self.observe is not None:
                self.observe(stream, output, now)
            if output.finished:
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
        for kind, payload in self._commands:
            if kind == "add":
                payload[0].put(error)
        self._commands.clear()
        for request_id, stream in list(self._streams.items()):
            self.engine.abort_request(request_id)
            stream.put(error)
        self._streams.clear()

"""``ZmqEventPublisher``: KV-event batches on a ZMQ PUB socket, with a ROUTER socket that
replays the batches a late subscriber missed — the transport vLLM uses, so the consumers
built for it (llm-d's indexer, Dynamo's ZMQ listener) read ours unchanged.

Each batch goes out as three frames: ``topic``, an 8-byte big-endian sequence number (0, 1,
2, ...), and the msgpack payload (``atb_mem.events.vllm``). A subscriber that joins late, or
sees a gap in the numbers, sends the first number it wants to the replay socket
(``[b"", start]`` from a DEALER/REQ socket, ``start`` exactly 8 bytes) and gets back every
buffered batch from there up to the last one published before it asked, as
``[b"", seq, payload]``, then ``[b"", -1, b""]``. A start that is not 8 bytes gets the end
marker alone.

ZMQ sockets belong to one thread: ``publish`` only queues the events, and a thread of the
publisher's own encodes them and owns both sockets, so the engine's step pays for neither.
That thread sends the live batches first, then gives replays a bounded turn (a few requests,
a chunk of each replay) and never waits on a peer: a peer that asks and asks but never reads
costs it little and cannot hold up publishing or ``close()``.
"""

from __future__ import annotations

import queue
import threading
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import zmq

from atb_mem.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventList,
)
from atb_mem.events.vllm import encode_batch

__all__ = ["ZmqEventPublisher"]

_END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
# Per pass of the thread: live batches go first, but are capped so replays, and a stop,
# are still seen while the engine publishes faster than the thread encodes.
_LIVE_PER_PASS = 256
_REQUESTS_PER_PASS = 8
_REPLAY_CHUNK = 64  # batches of each replay per pass: a long replay cannot delay live ones
_MAX_REPLAYS = 32  # peers replaying at once; each costs a little every pass
_REPLAY_STALL_S = 5.0  # a replay whose peer has taken nothing for this long is given up
_IDLE_WAIT_S = 0.05


@dataclass
class _Replay:
    next_seq: int
    stop_seq: int  # the publisher's next number when asked: later batches came live
    progress_at: float


class ZmqEventPublisher:
    """Publishes KV-event batches on ``endpoint`` (bound, e.g. ``tcp://*:5557``); keeps the
    last ``buffer_batches`` for replay on ``replay_endpoint`` when given.

    At most ``max_queued_batches`` wait for the publisher's thread. Past that, ``publish``
    drops the batch it is given, the newest: it never blocks nor raises for it, the queued
    batches keep their order, and the engine's thread never takes from the queue the
    publisher's thread reads. A dropped batch still takes its sequence number, so
    subscribers see the gap, and a replay request shows it cannot be filled.

    Counters, plain ints: ``dropped_batches`` (by a full queue), ``refused_replays``
    (answered with the end marker alone: a start frame that is not 8 bytes, or more than
    ``_MAX_REPLAYS`` peers replaying), ``abandoned_replays`` (the peer read nothing for
    ``_REPLAY_STALL_S`` s; it gets no end marker). ``queued_batches`` is the queue's length
    now, ``alive`` whether the thread runs.
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "", *,
                 buffer_batches: int = 10_000, max_queued_batches: int = 10_000,
                 data_parallel_rank: int | None = None) -> None:
        if buffer_batches < 1:
            raise ValueError(f"buffer_batches must be at least 1, got {buffer_batches}")
        if isinstance(max_queued_batches, bool) or not isinstance(max_queued_batches, int):
            raise TypeError(f"max_queued_batches must be an int, got {max_queued_batches!r}")
        if max_queued_batches < 1:
            raise ValueError(f"max_queued_batches must be at least 1, got {max_queued_batches}")
        if not isinstance(topic, str):
            raise TypeError(f"topic must be a str, got {type(topic).__name__}")
        if data_parallel_rank is not None and (isinstance(data_parallel_rank, bool) or
                                               not isinstance(data_parallel_rank, int)):
            raise TypeError(f"data_parallel_rank must be an int or None, got "
                            f"{data_parallel_rank!r}")
        self.topic = topic.encode()
        self.data_parallel_rank = data_parallel_rank
        self.max_queued_batches = max_queued_batches
        self.dropped_batches = 0
        self.refused_replays = 0
        self.abandoned_replays = 0
        self._context = zmq.Context()
        self._publisher = self._context.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._publisher.bind(endpoint)
            if replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                # A full peer raises Again at once (we stop its replay for this pass)
                # rather than losing batches silently; the low marks bound what a peer that
                # never reads, or sends huge requests, makes us hold.
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                self._replay.setsockopt(zmq.SNDHWM, 4 * _REPLAY_CHUNK)
                self._replay.setsockopt(zmq.RCVHWM, 2 * _REQUESTS_PER_PASS)
                self._replay.setsockopt(zmq.LINGER, 0)  # no one waits on a replay at close
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as error:
            self._context.destroy(linger=0)
            raise ValueError(f"cannot bind the KV-event sockets: {error}") from error
        self.endpoint = self._publisher.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = None if self._replay is None else \
            self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        # Each batch with the number of batches dropped just before it: its number skips them.
        self._queue: queue.Queue[tuple[Sequence[KVCacheEvent], int]] = \
            queue.Queue(max_queued_batches)
        self._lock = threading.Lock()  # the queue and the count of drops not yet numbered
        self._unnumbered_drops = 0
        self._replays: dict[bytes, _Replay] = {}
        self._next_seq = 0
        # An event, not a sentinel in the queue: a full queue must not delay the stop.
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="atb-mem-kv-events",
                                        daemon=True)
        self._thread.start()

    @property
    def queued_batches(self) -> int:
        """Batches waiting for the publisher's thread now (at most ``max_queued_batches``)."""
        return self._queue.qsize()

    @property
    def alive(self) -> bool:
        """Whether the publisher's thread still runs (False once ``close`` has finished)."""
        return self._thread.is_alive()

    def publish(self, events: Sequence[KVCacheEvent]) -> None:
        """Queues one batch (nothing for no events); returns at once, dropping the batch if
        the queue is full. A pool's drain (``KVEventList``) is queued as it is: the
        publisher's thread types and encodes it."""
        if isinstance(events, KVEventList):
            if len(events):
                self._put(events)
            return
        for event in events:  # refused here: the thread that encodes must not fail
            if not isinstance(event, (BlockStored, BlockRemoved, AllBlocksCleared)):
                raise TypeError(f"not a KV-cache event: {event!r}")
        if events:
            self._put(list(events))

    def close(self, timeout: float = 5.0) -> None:
        """Sends what is queued, then closes the sockets; waits at most ``timeout`` seconds
        for the thread to end."""
        self._stop.set()
        self._thread.join(timeout)

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _put(self, events: Sequence[KVCacheEvent]) -> None:
        with self._lock:
            try:
                self._queue.put_nowait((events, self._unnumbered_drops))
            except queue.Full:
                self._unnumbered_drops += 1
                self.dropped_batches += 1
            else:
                self._unnumbered_drops = 0

    def _run(self) -> None:
        try:
            wait = _IDLE_WAIT_S
            while not self._stop.is_set():
                busy = self._send_live(_LIVE_PER_PASS, wait) == _LIVE_PER_PASS
                if self._replay is not None and self._serve_replays(self._replay):
                    busy = True
                wait = 0.0 if busy else _IDLE_WAIT_S
            # Bounded even if the engine keeps publishing while we close.
            self._send_live(self.max_queued_batches, 0.0)
        finally:
            self._context.destroy(linger=1000)

    def _send_live(self, limit: int, wait: float) -> int:
        """Sends up to ``limit`` queued batches, waiting up to ``wait`` s for the first."""
        for sent in range(limit):
            try:
                events, dropped_before = self._queue.get(timeout=wait if sent == 0 else 0)
            except queue.Empty:
                return sent
            self._next_seq += dropped_before
            self._send(encode_batch(events, data_parallel_rank=self.data_parallel_rank))
        return limit

    def _send(self, payload: bytes) -> None:
        seq = self._next_seq
        self._next_seq += 1
        self._buffer.append((seq, payload))
        self._publisher.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    def _serve_replays(self, socket: zmq.Socket[bytes]) -> bool:
        """One bounded turn: a few requests, a chunk of each replay. True if it did work."""
        now = time.monotonic()
        busy = False
        for _ in range(_REQUESTS_PER_PASS):
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            busy = True
            self._take_request(socket, frames, now)
        for client, replay in list(self._replays.items()):
            before = replay.next_seq
            if self._advance(socket, client, replay, now):
                del self._replays[client]
            busy = busy or replay.next_seq != before
        return busy

    def _take_request(self, socket: zmq.Socket[bytes], frames: list[bytes],
                      now: float) -> None:
        client, start = frames[0], frames[-1]
        if len(frames) < 2 or len(start) != 8 or \
                (client not in self._replays and len(self._replays) >= _MAX_REPLAYS):
            self.refused_replays += 1
            try:
                socket.send_multipart([client, b"", _END_OF_REPLAY, b""], zmq.NOBLOCK)
            except zmq.ZMQError:  # full or gone: a peer that reads nothing gets nothing
                pass
            return
        # A new request from a peer replaces its replay: it wants to start again.
        self._replays[client] = _Replay(int.from_bytes(start, "big"), self._next_seq, now)

    def _advance(self, socket: zmq.Socket[bytes], client: bytes, replay: _Replay,
                 now: float) -> bool:
        """Sends the next chunk of one replay; True when it is over (ended or given up)."""
        buffer = self._buffer
        # Numbers are increasing but not contiguous (drops skip some): search, not offset.
        index = bisect_left(buffer, replay.next_seq, key=lambda entry: entry[0])
        try:
            for _ in range(_REPLAY_CHUNK):
                if index == len(buffer) or buffer[index][0] >= replay.stop_seq:
                    socket.send_multipart([client, b"", _END_OF_REPLAY, b""], zmq.NOBLOCK)
                    return True
                seq, payload = buffer[index]
                socket.send_multipart([client, b"", seq.to_bytes(8, "big"), payload],
                                      zmq.NOBLOCK)
                replay.next_seq, replay.progress_at = seq + 1, now
                index += 1
            return False
        except zmq.Again:  # the peer's queue is full: it reads slowly, or not at all
            if now - replay.progress_at < _REPLAY_STALL_S:
                return False
            self.abandoned_replays += 1
            return True
        except zmq.ZMQError:  # the peer has gone (EHOSTUNREACH)
            return True

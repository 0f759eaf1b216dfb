"""``ZmqEventPublisher``: KV-event batches on a ZMQ PUB socket, with a ROUTER socket that
replays the batches a late subscriber missed — the transport vLLM uses, so the consumers
built for it (llm-d's indexer, Dynamo's ZMQ listener) read ours unchanged.

Each batch goes out as three frames: ``topic``, an 8-byte big-endian sequence number (0, 1,
2, ...), and the msgpack payload (``atb_mem.events.vllm``). A subscriber that joins late, or
sees a gap in the numbers, sends the first number it wants to the replay socket
(``[b"", start]`` from a DEALER/REQ socket) and gets back every buffered batch from there
as ``[b"", seq, payload]``, then ``[b"", -1, b""]``.

ZMQ sockets belong to one thread: ``publish`` only queues the events, and a thread of the
publisher's own encodes them and owns both sockets, so the engine's step pays for neither.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Sequence

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


class ZmqEventPublisher:
    """Publishes KV-event batches on ``endpoint`` (bound, e.g. ``tcp://*:5557``); keeps the
    last ``buffer_batches`` for replay on ``replay_endpoint`` when given."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "", *,
                 buffer_batches: int = 10_000, data_parallel_rank: int | None = None) -> None:
        if buffer_batches < 1:
            raise ValueError(f"buffer_batches must be at least 1, got {buffer_batches}")
        if not isinstance(topic, str):
            raise TypeError(f"topic must be a str, got {type(topic).__name__}")
        if data_parallel_rank is not None and (isinstance(data_parallel_rank, bool) or
                                               not isinstance(data_parallel_rank, int)):
            raise TypeError(f"data_parallel_rank must be an int or None, got "
                            f"{data_parallel_rank!r}")
        self.topic = topic.encode()
        self.data_parallel_rank = data_parallel_rank
        self._context = zmq.Context()
        self._publisher = self._context.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._publisher.bind(endpoint)
            if replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as error:
            self._context.destroy(linger=0)
            raise ValueError(f"cannot bind the KV-event sockets: {error}") from error
        self.endpoint = self._publisher.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = None if self._replay is None else \
            self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._queue: queue.Queue[Sequence[KVCacheEvent] | None] = queue.Queue()
        self._next_seq = 0
        self._thread = threading.Thread(target=self._run, name="atb-mem-kv-events",
                                        daemon=True)
        self._thread.start()

    def publish(self, events: Sequence[KVCacheEvent]) -> None:
        """Queues one batch (nothing for no events); returns at once. A pool's drain
        (``KVEventList``) is queued as it is: the publisher's thread types and encodes it."""
        if isinstance(events, KVEventList):
            if len(events):
                self._queue.put(events)
            return
        for event in events:  # refused here: the thread that encodes must not fail
            if not isinstance(event, (BlockStored, BlockRemoved, AllBlocksCleared)):
                raise TypeError(f"not a KV-cache event: {event!r}")
        if events:
            self._queue.put(list(events))

    def close(self, timeout: float = 5.0) -> None:
        """Sends what is queued, then closes the sockets."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _run(self) -> None:
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            while True:
                try:
                    events = self._queue.get(timeout=0.05)
                except queue.Empty:
                    events = []
                if events is None:
                    break
                if events:
                    self._send(encode_batch(events,
                                            data_parallel_rank=self.data_parallel_rank))
                while self._replay is not None and poller.poll(0):
                    self._serve_replay(self._replay)
        finally:
            self._context.destroy(linger=1000)

    def _send(self, payload: bytes) -> None:
        seq = self._next_seq
        self._next_seq += 1
        self._buffer.append((seq, payload))
        self._publisher.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    def _serve_replay(self, socket: zmq.Socket[bytes]) -> None:
        frames = socket.recv_multipart()
        client, start = frames[0], frames[-1]
        first = int.from_bytes(start, "big") if len(start) == 8 else 0
        for seq, payload in self._buffer:
            if seq >= first:
                socket.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
        socket.send_multipart([client, b"", _END_OF_REPLAY, b""])

"""``ZmqEventPublisher`` under hostile or broken peers: replay requests that flood in from
peers that never read must not starve live publishing nor block ``close()``, the publish
queue stays bounded (drops counted, the engine's thread never blocked), and a start frame
that is not 8 bytes replays nothing."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import msgspec
import pytest
import zmq

from atb_mem.events import BlockRemoved, BlockStored, KVCacheEvent
from atb_mem.events import zmq_publisher as zmq_publisher_module
from atb_mem.events.zmq_publisher import ZmqEventPublisher

FILLER: list[KVCacheEvent] = [BlockStored(1, (11, 22), None, (1, 2, 3, 4), 2, "device", 0)]
END = (-1).to_bytes(8, "big", signed=True)
LIVE_BASE = 1_000_000  # the block hash of live batch i is LIVE_BASE + i


def live(i: int) -> list[KVCacheEvent]:
    return [BlockRemoved(i, (LIVE_BASE + i,), "device")]


def live_index(payload: bytes) -> int | None:
    """The i of a ``live(i)`` batch (vLLM's array-like batch: ts, events, rank), else None."""
    events = msgspec.msgpack.decode(payload)[1]
    if events and events[0][0] == "BlockRemoved" and events[0][1][0] >= LIVE_BASE:
        return int(events[0][1][0]) - LIVE_BASE
    return None


def subscribe(context: zmq.Context[zmq.Socket[bytes]], publisher: ZmqEventPublisher,
              ) -> zmq.Socket[bytes]:
    """A SUB socket that has provably joined: a PUB drops what it sends before the
    subscription arrives, so probe until one batch gets through."""
    subscriber = context.socket(zmq.SUB)
    subscriber.setsockopt(zmq.RCVHWM, 0)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    subscriber.connect(publisher.endpoint)
    for _ in range(100):
        publisher.publish(FILLER)
        if subscriber.poll(100):
            subscriber.recv_multipart()
            return subscriber
    raise AssertionError("the subscriber never joined")


def fill(publisher: ZmqEventPublisher, subscriber: zmq.Socket[bytes], count: int) -> None:
    """Publishes ``count`` batches and waits (bounded) until the publisher's thread has sent
    them all, so they are in its replay buffer: a later probe's number proves it."""
    for _ in range(count):
        publisher.publish(FILLER)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        publisher.publish(FILLER)
        while subscriber.poll(50):
            if int.from_bytes(subscriber.recv_multipart()[1], "big") >= count:
                return
    raise AssertionError(f"the {count} batches were not sent in 30 s")


@contextmanager
def flooding(endpoint: str | None, peers: int = 3, seconds: float = 30.0) -> Iterator[None]:
    """``peers`` DEALER sockets that ask for a full replay, over and over, and never read;
    for at most ``seconds`` (a publisher that stays stuck must not hang the test run)."""
    assert endpoint is not None
    stop = threading.Event()
    started = threading.Event()

    def flood() -> None:
        context = zmq.Context()
        sockets = [context.socket(zmq.DEALER) for _ in range(peers)]
        for socket in sockets:
            socket.connect(endpoint)
        deadline = time.monotonic() + seconds
        sent = 0
        while not stop.is_set() and time.monotonic() < deadline:
            for socket in sockets:
                try:
                    socket.send_multipart([b"", (0).to_bytes(8, "big")], zmq.NOBLOCK)
                    sent += 1
                except zmq.Again:
                    pass
            if sent >= 100:
                started.set()
            time.sleep(0.001)  # leaves the GIL to the threads under test
        context.destroy(linger=0)

    thread = threading.Thread(target=flood, name="replay-flood", daemon=True)
    thread.start()
    try:
        assert started.wait(10), "the flood never started"
        time.sleep(0.5)  # lets the requests pile up in the replay socket
        yield
    finally:
        stop.set()
        thread.join(10)


def replay(socket: zmq.Socket[bytes], start: bytes, most: int = 1000) -> list[list[bytes]]:
    """Every reply to one request, up to the end marker (bounded in count and time)."""
    socket.send_multipart([b"", start])
    replies = []
    for _ in range(most):
        if not socket.poll(5000):
            break
        replies.append(socket.recv_multipart())
        if replies[-1][1] == END:
            break
    return replies


@pytest.fixture
def context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def test_live_batches_get_through_while_peers_flood_replay_requests(
        context: zmq.Context[zmq.Socket[bytes]]) -> None:
    publisher = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*",
                                  buffer_batches=5_000)
    try:
        subscriber = subscribe(context, publisher)
        fill(publisher, subscriber, 3_000)
        with flooding(publisher.replay_endpoint):
            seen: set[int] = set()
            deadline = time.monotonic() + 15
            for i in range(50):
                publisher.publish(live(i))
                time.sleep(0.01)
            while len(seen) < 50 and time.monotonic() < deadline:
                while subscriber.poll(50):
                    index = live_index(subscriber.recv_multipart()[2])
                    if index is not None:
                        seen.add(index)
            assert seen == set(range(50)), f"{len(seen)} of 50 live batches arrived in 15 s"
            assert publisher.queued_batches == 0
            # A peer that reads still gets its whole replay, in order, amid the flood.
            assert publisher.replay_endpoint is not None
            reader = context.socket(zmq.DEALER)
            reader.connect(publisher.replay_endpoint)
            replies = replay(reader, (0).to_bytes(8, "big"), most=10_000)
            assert replies[-1] == [b"", END, b""]
            numbers = [int.from_bytes(reply[1], "big") for reply in replies[:-1]]
            assert numbers == list(range(len(numbers))) and len(numbers) > 3_050
            started = time.monotonic()
            publisher.close(timeout=5)
            assert time.monotonic() - started < 5
            assert not publisher.alive
    finally:
        publisher.close(timeout=5)


def test_close_ends_the_thread_while_peers_flood(
        context: zmq.Context[zmq.Socket[bytes]]) -> None:
    publisher = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*",
                                  buffer_batches=5_000)
    subscriber = subscribe(context, publisher)
    fill(publisher, subscriber, 2_000)
    with flooding(publisher.replay_endpoint):
        for i in range(20):
            publisher.publish(live(i))
        started = time.monotonic()
        publisher.close(timeout=5)
        elapsed = time.monotonic() - started
        assert not publisher._thread.is_alive(), "close() returned with the thread alive"
        assert not publisher.alive
        assert elapsed < 5
    # What was queued before close() went out first: close sends it, then ends.
    seen = set()
    while subscriber.poll(500):
        if (index := live_index(subscriber.recv_multipart()[2])) is not None:
            seen.add(index)
    assert seen == set(range(20))


def test_the_publish_queue_is_bounded_and_drops_are_counted(
        context: zmq.Context[zmq.Socket[bytes]], monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="max_queued_batches"):
        ZmqEventPublisher("tcp://127.0.0.1:*", max_queued_batches=0)
    with pytest.raises(TypeError, match="max_queued_batches"):
        ZmqEventPublisher("tcp://127.0.0.1:*", max_queued_batches=10.0)  # type: ignore[arg-type]
    with ZmqEventPublisher("tcp://127.0.0.1:*") as default:
        assert default.max_queued_batches == 10_000
    publisher = ZmqEventPublisher("tcp://127.0.0.1:*", max_queued_batches=100)
    entered, release = threading.Event(), threading.Event()
    try:
        subscriber = subscribe(context, publisher)
        # A thread that cannot keep up: its encoder waits until released.
        encode = zmq_publisher_module.encode_batch

        def slow_encode(events: Sequence[KVCacheEvent], **kwargs: int | None) -> bytes:
            entered.set()
            assert release.wait(30)
            return encode(events, **kwargs)

        monkeypatch.setattr(zmq_publisher_module, "encode_batch", slow_encode)
        publisher.publish(live(0))
        assert entered.wait(10), "the thread never took the first batch"
        started = time.monotonic()
        most = 0
        for i in range(1, 20_000):
            publisher.publish(live(i))  # never blocks, never raises
            most = max(most, publisher.queued_batches)
        assert time.monotonic() - started < 10
        assert most <= 100
        assert isinstance(publisher.dropped_batches, int)
        # One batch in the waiting thread, 100 queued, the rest dropped.
        assert publisher.dropped_batches == 20_000 - 101
        kept = 101
        release.set()
        frames: list[list[bytes]] = []
        deadline = time.monotonic() + 10
        while len(frames) < kept and time.monotonic() < deadline:
            if subscriber.poll(100):
                frames.append(subscriber.recv_multipart())
        assert [live_index(frame[2]) for frame in frames] == list(range(kept))
        # The dropped batches keep their numbers: a subscriber sees the gap they leave.
        publisher.publish(live(20_000))
        assert subscriber.poll(5000)
        after = subscriber.recv_multipart()
        gap = int.from_bytes(after[1], "big") - int.from_bytes(frames[-1][1], "big") - 1
        assert gap == publisher.dropped_batches
        assert live_index(after[2]) == 20_000
    finally:
        release.set()
        publisher.close(timeout=5)
    assert not publisher.alive


def test_a_start_frame_that_is_not_8_bytes_replays_nothing(
        context: zmq.Context[zmq.Socket[bytes]]) -> None:
    with ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as publisher:
        subscriber = subscribe(context, publisher)
        fill(publisher, subscriber, 10)
        dealer = context.socket(zmq.DEALER)
        assert publisher.replay_endpoint is not None
        dealer.connect(publisher.replay_endpoint)
        for refused, start in enumerate((b"\x00\x00\x00", b"", b"\x00" * (1 << 20)), 1):
            assert replay(dealer, start) == [[b"", END, b""]], f"a {len(start)}-byte start"
            assert publisher.refused_replays == refused
        # A well-formed request still replays, from the number it asks for.
        replies = replay(dealer, (5).to_bytes(8, "big"))
        assert replies[-1] == [b"", END, b""]
        numbers = [int.from_bytes(reply[1], "big") for reply in replies[:-1]]
        assert numbers[:6] == [5, 6, 7, 8, 9, 10] and numbers == sorted(numbers)
        assert publisher.refused_replays == 3

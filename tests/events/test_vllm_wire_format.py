"""The vLLM wire format and its ZMQ transport: golden bytes (a schema change must be
deliberate), a round trip through vLLM's own structs as its docs publish them, live
publishing and replay for a subscriber that joined late."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import zmq

from atb_mem import KVCachePool
from atb_mem.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from atb_mem.events.vllm import SCHEMA_VERSION, encode_batch
from atb_mem.events.zmq_publisher import ZmqEventPublisher

EVENTS: list[KVCacheEvent] = [
    BlockStored(1, (11, 22), None, (1, 2, 3, 4), 2, "device", 0),
    BlockRemoved(2, (22,), "host"),
    AllBlocksCleared(3),
]

# [1.5, [["BlockStored", [11, 22], nil, [1, 2, 3, 4], 2, nil, "GPU", nil, nil, nil, nil, nil],
#        ["BlockRemoved", [22], "CPU", nil], ["AllBlocksCleared"]], nil, 2]
GOLDEN = bytes.fromhex(
    "94cb3ff8000000000000"
    "93"
    "9cab426c6f636b53746f726564920b16c0940102030402c0a3475055c0c0c0c0c0"
    "94ac426c6f636b52656d6f766564 9116 a3435055 c0".replace(" ", "")
    + "91b0416c6c426c6f636b73436c6561726564"
    "c002"
)


# vLLM's structs, in the field order vllm.distributed.kv_events publishes (2026: with
# lora_name, extra_keys and the KV-cache group's index and kind).
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEventStruct(msgspec.Struct, array_like=True, omit_defaults=True, gc=False,
                         tag=True):
    pass


class BlockStoredStruct(KVCacheEventStruct, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemovedStruct(KVCacheEventStruct, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksClearedStruct(KVCacheEventStruct, tag="AllBlocksCleared"):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStoredStruct | BlockRemovedStruct | AllBlocksClearedStruct]


decoder = msgspec.msgpack.Decoder(type=KVEventBatch)


# vLLM's stores before lora_name (2025): its decoder ignores the fields it does not know.
class OldBlockStoredStruct(KVCacheEventStruct, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class OldKVEventBatch(EventBatch):
    events: list[OldBlockStoredStruct | AllBlocksClearedStruct]


def test_golden_bytes() -> None:
    assert SCHEMA_VERSION == 2, "a new schema version needs new golden bytes"
    assert encode_batch(EVENTS, timestamp=1.5) == GOLDEN
    assert encode_batch(EVENTS, timestamp=1.5, data_parallel_rank=3)[-2:] == b"\x03\x02"


def test_vllms_decoder_reads_a_live_pools_events() -> None:
    pool = KVCachePool(4, 2, device=None, enable_kv_events=True, num_host_blocks=4)
    pool.alloc_sequence(1, [5, 6, 7, 8, 9])
    pool.mark_computed(1)
    pool.swap_out([1])
    pool.alloc_sequence(2, 6)
    events = pool.take_events()
    batch = decoder.decode(encode_batch(events, data_parallel_rank=0))
    assert batch.data_parallel_rank == 0
    stored, host, removed = batch.events
    assert isinstance(stored, BlockStoredStruct) and stored.medium == "GPU"
    assert stored.token_ids == [5, 6, 7, 8] and stored.block_size == 2
    assert stored.parent_block_hash is None and stored.lora_id is None
    assert isinstance(host, BlockStoredStruct) and host.medium == "CPU"
    assert isinstance(removed, BlockRemovedStruct) and removed.medium == "GPU"
    assert sorted(removed.block_hashes) == sorted(stored.block_hashes)
    with pytest.raises(TypeError):
        encode_batch(["not an event"])  # type: ignore[list-item]


def test_an_older_vllm_decoder_still_reads_stores() -> None:
    old = msgspec.msgpack.decode(encode_batch([EVENTS[0], EVENTS[2]]), type=OldKVEventBatch)
    assert old.events[0] == OldBlockStoredStruct([11, 22], None, [1, 2, 3, 4], 2, None, "GPU")


def test_a_hybrid_pools_events_name_their_group() -> None:
    """Per group, as vLLM's hybrid manager reports them: group_idx, the kind (vLLM's
    KVCacheSpecKind values) and the sliding window."""
    pool = KVCachePool(32, 2, num_layers=3, device=None, enable_kv_events=True,
                       layer_types=["sliding_attention", "full_attention", "chunked_attention"],
                       sliding_window=4, attention_chunk_size=4)
    pool.alloc_sequence(1, list(range(9)))
    pool.mark_computed(1)
    pool.free_sequence(1)
    pool.reset_prefix_cache()
    batch = decoder.decode(encode_batch(pool.take_events()))
    stores = [event for event in batch.events if isinstance(event, BlockStoredStruct)]
    assert [(event.group_idx, event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window)
            for event in stores] == [(0, "sliding_window", 4), (1, "full_attention", None),
                                     (2, "chunked_local_attention", None)]
    assert len({tuple(event.block_hashes) for event in stores}) == 1  # same tokens, same hashes
    assert isinstance(batch.events[-1], AllBlocksClearedStruct)


def receive(socket: zmq.Socket[bytes], timeout_ms: int = 200) -> list[bytes] | None:
    if socket.poll(timeout_ms):
        return socket.recv_multipart()
    return None


def test_published_batches_arrive_numbered_and_a_late_subscriber_replays_them() -> None:
    context = zmq.Context()
    with ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv") as publisher:
        subscriber = context.socket(zmq.SUB)
        subscriber.setsockopt(zmq.SUBSCRIBE, b"kv")
        subscriber.connect(publisher.endpoint)
        # A PUB socket drops what it sends before the subscription arrives: publish until
        # one batch gets through, then the next ones must follow in order.
        first = None
        for _ in range(100):
            publisher.publish(EVENTS[:1])
            if (first := receive(subscriber)) is not None:
                break
        assert first is not None, "nothing arrived"
        publisher.publish(EVENTS[1:])
        publisher.publish([])  # nothing to send: no batch, no number used
        while (frames := receive(subscriber, 5000)) is not None:
            if decoder.decode(frames[2]).events[0] != BlockStoredStruct(
                    [11, 22], None, [1, 2, 3, 4], 2, None, "GPU", None):
                break
        assert frames is not None
        topic, seq, payload = frames
        assert topic == b"kv"
        last = int.from_bytes(seq, "big")
        assert last > int.from_bytes(first[1], "big")  # numbered in publishing order
        assert [type(event) for event in decoder.decode(payload).events] == [
            BlockRemovedStruct, AllBlocksClearedStruct]

        replay = context.socket(zmq.DEALER)
        replay.connect(publisher.replay_endpoint)
        replay.send_multipart([b"", (last - 1).to_bytes(8, "big")])
        replies = []
        while (reply := receive(replay, 5000)) is not None:
            replies.append(reply)
            if reply[1] == (-1).to_bytes(8, "big", signed=True):
                break
        assert [int.from_bytes(reply[1], "big") for reply in replies[:-1]] == [last - 1, last]
        assert replies[-1][2] == b"" and replies[-2][2] == payload
    context.destroy(linger=0)


def test_a_publisher_refuses_what_is_not_an_event_and_keeps_publishing() -> None:
    context = zmq.Context()
    with ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*") as publisher:
        with pytest.raises(TypeError, match="not a KV-cache event"):
            publisher.publish([EVENTS[0], "stored"])  # type: ignore[list-item]
        publisher.publish(EVENTS)
        replay = context.socket(zmq.DEALER)
        replay.connect(publisher.replay_endpoint)
        replay.send_multipart([b"", (0).to_bytes(8, "big")])
        first = receive(replay, 5000)
        assert first is not None and first[1] == (0).to_bytes(8, "big")
        assert decoder.decode(first[2]).events[1] == BlockRemovedStruct([22], "CPU")
    context.destroy(linger=0)


def test_an_endpoint_that_cannot_be_bound_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="cannot bind"):
        ZmqEventPublisher("not-a-transport://x")
    with pytest.raises(ValueError, match="buffer_batches"):
        ZmqEventPublisher("tcp://127.0.0.1:*", buffer_batches=0)

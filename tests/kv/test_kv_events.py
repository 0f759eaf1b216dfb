"""KV-cache events through the Python API: typed, in order, replayable by a router, nothing
recorded unless asked for, and nothing recorded by a call that fails."""

from __future__ import annotations

import collections.abc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atb_mem import KVCachePool
from atb_mem.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventList
from tests.support.kv_event_workload import Router, apply, operation


def events_pool(num_blocks: int = 8, **kwargs: object) -> KVCachePool:
    return KVCachePool(num_blocks, 2, device=None, enable_kv_events=True, num_host_blocks=4,
                       **kwargs)  # type: ignore[arg-type]


def test_stores_are_chains_and_a_prefix_hit_stores_only_its_new_blocks() -> None:
    pool = events_pool()
    pool.alloc_sequence(1, [1, 2, 3, 4, 5])
    assert pool.take_events() == []  # not computed yet
    pool.mark_computed(1)
    [first] = pool.take_events()
    assert isinstance(first, BlockStored)
    assert (first.event_id, first.parent_block_hash) == (1, None)
    assert first.token_ids.tolist() == [1, 2, 3, 4] and first.block_hashes.dtype == np.uint64
    assert (len(first.block_hashes), first.block_size, first.medium) == (2, 2, "device")
    assert first.cache_salt_hash == 0

    assert pool.alloc_sequence(2, [1, 2, 3, 4, 5, 6, 7]) == 4
    pool.mark_computed(2)
    [second] = pool.take_events()
    assert isinstance(second, BlockStored)
    assert second.parent_block_hash == first.block_hashes[-1]
    assert second.token_ids.tolist() == [5, 6] and second.event_id == 2


def test_the_same_tokens_get_the_same_hashes_and_a_salt_changes_them() -> None:
    def stored(**kwargs: object) -> BlockStored:
        pool = events_pool()
        pool.alloc_sequence(1, [7, 8, 9], **kwargs)  # type: ignore[arg-type]
        pool.mark_computed(1)
        [event] = pool.take_events()
        assert isinstance(event, BlockStored)
        return event

    assert stored().block_hashes.tolist() == stored().block_hashes.tolist()
    salted = stored(cache_salt="tenant-a")
    assert salted.block_hashes.tolist() != stored().block_hashes.tolist()
    assert salted.cache_salt_hash != 0
    assert stored(cache_salt="tenant-b").cache_salt_hash != salted.cache_salt_hash


def test_evictions_swaps_and_a_clearing_reset() -> None:
    pool = events_pool(4)  # three usable blocks
    pool.alloc_sequence(1, [1, 2, 3, 4])
    pool.mark_computed(1)
    [stored] = pool.take_events()
    pool.swap_out([1])
    [host] = pool.take_events()
    assert isinstance(host, BlockStored) and host.medium == "host"
    assert host.block_hashes.tolist() == stored.block_hashes.tolist()
    pool.alloc_sequence(2, 6)  # takes every device block: both cached ones are evicted
    [evicted] = pool.take_events()
    assert isinstance(evicted, BlockRemoved) and evicted.medium == "device"
    assert set(evicted.block_hashes) == set(stored.block_hashes)
    pool.free_sequence(2)
    pool.free_sequence(1)  # its host copies go
    [gone] = pool.take_events()
    assert isinstance(gone, BlockRemoved) and gone.medium == "host"

    pool.alloc_sequence(3, [5, 6, 7])
    pool.mark_computed(3)
    pool.free_sequence(3)
    pool.take_events()
    assert pool.reset_prefix_cache() == 1
    [cleared] = pool.take_events()
    assert isinstance(cleared, AllBlocksCleared)


def test_a_failing_call_records_nothing_and_no_events_unless_asked() -> None:
    pool = events_pool()
    pool.alloc_sequence(1, [1, 2, 3])
    with pytest.raises(ValueError):
        pool.alloc_sequence(1, [1, 2, 3])
    with pytest.raises(Exception, match="blocks"):
        pool.alloc_sequence(2, list(range(100)))
    assert pool.take_events() == []

    quiet = KVCachePool(8, 2, device=None)
    assert quiet.enable_kv_events is False
    quiet.alloc_sequence(1, [1, 2, 3])
    quiet.mark_computed(1)
    assert quiet.take_events() == []
    with pytest.raises(TypeError):
        KVCachePool(8, 2, device=None, enable_kv_events="yes")  # type: ignore[arg-type]
    config = {"num_blocks": 8, "block_size": 2, "device": None, "enable_kv_events": True}
    assert KVCachePool.from_config(config).enable_kv_events


@settings(max_examples=150, deadline=None)
@given(st.lists(operation, max_size=40))
def test_a_router_replaying_the_events_counts_the_cached_blocks(operations: list[tuple]) -> None:
    pool = events_pool(10)
    router = Router()
    for step in operations:
        apply(pool, step)
        router.replay(pool.take_events())
        # blocks_cached counts the cached blocks no sequence uses.
        assert pool.stats()["blocks_cached"] <= len(router.blocks["device"])
    for seq_id in range(6):
        if seq_id in pool:
            pool.free_sequence(seq_id)
    router.replay(pool.take_events())
    assert len(router.blocks["device"]) == pool.stats()["blocks_cached"]
    assert router.blocks["host"] == set()


def test_a_drain_is_a_list_typed_when_read() -> None:
    """``take_events()`` is a ``KVEventList``: its length without typing, then indexing,
    slices, iteration, equality and repr like the list of its events; the buffer it came as;
    two threads reading it first at once see the same events."""
    import threading

    pool = events_pool(num_blocks=4)
    empty = pool.take_events()
    assert isinstance(empty, KVEventList) and len(empty) == 0 and empty == [] and not empty
    assert isinstance(empty, collections.abc.Sequence)  # publishers may check for one
    pool.alloc_sequence(1, [1, 2, 3, 4, 5])
    pool.mark_computed(1)
    pool.free_sequence(1)
    pool.alloc_sequence(2, 6)  # evicts both cached blocks
    events = pool.take_events()
    assert len(events) == 2 and int(events.buffer[0]) == 2 and events.buffer.dtype == np.uint64
    seen: list[list[object]] = []
    readers = [threading.Thread(target=lambda: seen.append(list(events))) for _ in range(2)]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join()
    stored, removed = seen[0]
    assert seen[1] == seen[0] == list(events) == events[:] == [events[0], events[-1]]
    assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
    assert events == (stored, removed) and events != [stored] and events != "events"
    assert repr(events).startswith("KVEventList([BlockStored(event_id=1")
    with pytest.raises(IndexError):
        events[2]
    assert pool.take_events() == []  # drained


def test_the_bare_core_pools_events_are_typed_too() -> None:
    """``_core.KVCachePool`` (without the Python layer's attributes) types its drains."""
    from atb_mem import _core

    pool = _core.KVCachePool(8, 2, enable_kv_events=True)
    pool.alloc_sequence(1, [1, 2, 3])
    pool.mark_computed(1)
    [stored] = pool.take_events()
    assert isinstance(stored, BlockStored) and stored.token_ids.tolist() == [1, 2]

"""The public KVCachePool / BatchTable API, call by call."""

from __future__ import annotations

import numpy as np
import pytest

import atb_mem


def test_construction_and_shape_fields() -> None:
    kv = atb_mem.KVCachePool(
        num_blocks=1024, block_size=16, num_layers=32, num_kv_heads=8, head_dim=128,
        dtype="bfloat16",
    )
    assert (kv.num_blocks, kv.block_size, kv.num_layers) == (1024, 16, 32)
    assert (kv.num_kv_heads, kv.head_dim, kv.dtype) == (8, 128, "bfloat16")
    assert kv.num_free_blocks == 1023  # block 0 is the null block
    assert kv.bytes_per_block == 2 * 32 * 16 * 8 * 128 * 2
    assert kv.stats()["bytes_per_block"] == kv.bytes_per_block
    assert kv.enable_prefix_caching
    assert atb_mem.KVCachePool(4, 2, dtype=np.float32).dtype == "float32"
    assert atb_mem.KVCachePool(4, 2, dtype=np.dtype("int8")).dtype == "int8"


def test_from_config_accepts_the_seeds_form() -> None:
    kv = atb_mem.KVCachePool.from_config(
        {"memory_mode": "paged", "page_size": 64, "max_pages": 1024, "num_layers": 2,
         "dtype": "float32"}
    )
    assert isinstance(kv, atb_mem.KVCachePool)
    assert (kv.num_blocks, kv.block_size, kv.num_layers, kv.dtype) == (1024, 64, 2, "float32")
    with pytest.raises(ValueError, match="memory_mode"):
        atb_mem.KVCachePool.from_config({"memory_mode": "contiguous", "page_size": 4,
                                         "max_pages": 8})
    with pytest.raises(ValueError, match="unknown config key"):
        atb_mem.KVCachePool.from_config({"page_size": 4, "max_pages": 8, "pages": 3})
    with pytest.raises(ValueError, match="max_pages"):
        atb_mem.KVCachePool.from_config({"page_size": 4})
    with pytest.raises(TypeError):
        atb_mem.KVCachePool.from_config([("page_size", 4)])  # type: ignore[arg-type]


def test_alloc_by_count_and_block_tables(pool: atb_mem.KVCachePool) -> None:
    assert pool.alloc_sequence(7, 9) == 0
    assert pool.seq_len(7) == 9 and 7 in pool and len(pool) == 1
    assert pool.num_free_blocks == 16 - 3
    table = pool.block_tables([7])
    assert table.dtype == np.int32 and table.shape == (1, 3)
    assert 0 not in table
    assert pool.context_lens([7]).tolist() == [9]
    assert pool.can_allocate(13 * 4) and not pool.can_allocate(13 * 4 + 1)


def test_block_tables_pad_with_the_null_block(pool: atb_mem.KVCachePool) -> None:
    pool.alloc_sequence(1, 1)
    pool.alloc_sequence(2, 10)
    table = pool.block_tables(np.array([1, 2], dtype=np.int64))
    assert table.shape == (2, 3)
    assert table[0, 1:].tolist() == [atb_mem.NULL_BLOCK] * 2
    assert len(set(table[1].tolist())) == 3
    assert pool.block_tables([]).shape == (0, 0)


def test_slot_mapping_follows_the_block_table(pool: atb_mem.KVCachePool) -> None:
    pool.alloc_sequence(1, 10)
    blocks = pool.block_table(1)
    slots = pool.slot_mapping([1], [0], [10])
    expected = [blocks[i // 4] * 4 + i % 4 for i in range(10)]
    assert slots.dtype == np.int32 and slots.tolist() == expected
    assert pool.slot_mapping([1, 1], [2, 8], [5, 10]).tolist() == expected[2:5] + expected[8:10]


def test_append_tokens_is_batched_and_ordered(pool: atb_mem.KVCachePool) -> None:
    pool.alloc_sequence(1, 3)
    pool.alloc_sequence(2, 4)
    slots = pool.append_tokens([1, 2], n=2)
    assert slots.dtype == np.int32 and slots.shape == (4,)
    assert pool.seq_len(1) == 5 and pool.seq_len(2) == 6
    assert slots[:2].tolist() == pool.slot_mapping([1], [3], [5]).tolist()
    assert slots[2:].tolist() == pool.slot_mapping([2], [4], [6]).tolist()
    assert pool.append_tokens(np.array([2], dtype=np.uint64)).tolist() == pool.slot_mapping(
        [2], [6], [7]).tolist()


def test_prefix_cache_reuses_full_blocks_and_never_the_last_token(
    pool: atb_mem.KVCachePool,
) -> None:
    prompt = list(range(100, 112))  # exactly 3 blocks of 4
    assert pool.alloc_sequence(1, prompt) == 0
    assert pool.mark_computed(1) == 3  # the prefill ran: its three full blocks join the cache
    # Same prompt: the last token is recomputed, so only 2 of 3 blocks come from the cache.
    assert pool.alloc_sequence(2, prompt) == 8
    assert pool.block_table(2)[:2].tolist() == pool.block_table(1)[:2].tolist()
    assert pool.block_table(2)[2] != pool.block_table(1)[2]
    # A longer prompt gets all three.
    assert pool.alloc_sequence(3, [*prompt, 5]) == 12
    pool.mark_computed(3)
    # A different first block shares nothing after it (the hash is chained).
    assert pool.alloc_sequence(4, [0, *prompt[1:], 5]) == 0
    stats = pool.stats()
    assert stats["prefix_cache_hits"] == 5 and stats["prefix_cache_queries"] == 2 + 2 + 3 + 3
    assert stats["prefix_cache_hit_tokens"] == 20


def test_cached_blocks_survive_their_sequence_until_evicted(pool: atb_mem.KVCachePool) -> None:
    prompt = np.arange(9, dtype=np.int32)
    pool.alloc_sequence(1, prompt)
    pool.mark_computed(1)
    pool.free_sequence(1)
    assert pool.stats()["blocks_cached"] == 2  # the two full blocks stay findable
    assert pool.num_free_blocks == 16
    assert pool.alloc_sequence(2, prompt) == 8
    pool.free_sequence(2)
    # Fill the pool: the free blocks go first, then the cached ones (least recently used).
    pool.alloc_sequence(3, 14 * 4)
    assert pool.stats()["blocks_cached"] == 2
    pool.alloc_sequence(4, 4)
    assert pool.stats()["evictions"] == 1
    pool.free_sequence(3)
    pool.free_sequence(4)
    # The tail block of the prefix was evicted first; the head is still there.
    assert pool.alloc_sequence(5, prompt) == 4


def test_cache_salt_isolates_tenants(pool: atb_mem.KVCachePool) -> None:
    prompt = list(range(9))
    pool.alloc_sequence(1, prompt, cache_salt="tenant-a")
    pool.mark_computed(1)
    assert pool.alloc_sequence(2, prompt) == 0
    assert pool.alloc_sequence(3, prompt, cache_salt=b"tenant-b") == 0
    assert pool.alloc_sequence(4, prompt, cache_salt="tenant-a") == 8


def test_prefix_caching_can_be_switched_off() -> None:
    kv = atb_mem.KVCachePool(17, 4, enable_prefix_caching=False)
    kv.alloc_sequence(1, list(range(9)))
    assert kv.alloc_sequence(2, list(range(9))) == 0
    kv.free_sequence(1)
    assert kv.stats()["blocks_cached"] == 0


def test_appended_token_ids_fill_the_prefix_cache(pool: atb_mem.KVCachePool) -> None:
    pool.alloc_sequence(1, [1, 2, 3])
    pool.append_tokens([1], n=2, token_ids=[4, 5])  # block [1, 2, 3, 4] is now full
    assert pool.alloc_sequence(2, [1, 2, 3, 4, 9]) == 0  # but not computed yet
    assert pool.mark_computed(1) == 1
    assert pool.alloc_sequence(5, [1, 2, 3, 4, 9]) == 4
    pool.alloc_sequence(3, [1, 2, 3])
    pool.append_tokens([3], n=1)  # an unknown token breaks the chain
    pool.append_tokens([3], n=4, token_ids=np.array([[6, 7, 8, 9]], dtype=np.int64))
    assert pool.mark_computed(3) == 0
    assert pool.alloc_sequence(4, [1, 2, 3, 0, 6, 7, 8, 9, 1]) == 0


def test_blocks_join_the_prefix_cache_only_once_computed(pool: atb_mem.KVCachePool) -> None:
    # A prefill aborted after its first chunk: only what the chunk computed may be reused.
    prompt = list(range(200, 213))  # 3 full blocks of 4, and one token
    assert pool.alloc_sequence(1, prompt) == 0
    assert pool.num_computed(1) == 0
    assert pool.mark_computed(1, 6) == 1  # a 6-token chunk completes one block
    pool.free_sequence(1)
    assert pool.alloc_sequence(2, prompt) == 4
    assert pool.num_computed(2) == 4
    # Positive control: once the whole prompt is computed, the next one reuses all of it.
    assert pool.mark_computed(2) == 2
    assert pool.alloc_sequence(3, prompt) == 12
    # Counts are validated and never go back.
    with pytest.raises(ValueError, match="cannot be computed"):
        pool.mark_computed(3, 14)
    assert pool.mark_computed(3, 2) == 0 and pool.num_computed(3) == 12
    with pytest.raises(atb_mem.UnknownSequenceError):
        pool.mark_computed(99)


def test_fork_shares_blocks_and_copies_on_write(pool: atb_mem.KVCachePool) -> None:
    pool.alloc_sequence(1, 6)
    before = pool.num_free_blocks
    pool.fork(1, 2)
    assert pool.num_free_blocks == before
    assert pool.block_table(2).tolist() == pool.block_table(1).tolist()
    assert pool.take_pending_copies().shape == (0, 2)
    slot = pool.append_tokens([2])
    copies = pool.take_pending_copies()
    assert copies.dtype == np.int32 and copies.shape == (1, 2)
    src, dst = copies[0].tolist()
    assert src == pool.block_table(1)[1] and dst == pool.block_table(2)[1]
    assert slot.tolist() == [dst * 4 + 2]
    assert pool.block_table(2)[0] == pool.block_table(1)[0]  # full block still shared
    # The parent now owns its partial block alone: no copy.
    pool.append_tokens([1])
    assert pool.take_pending_copies().shape == (0, 2)
    pool.free_sequence(1)
    pool._check_invariants()


def test_page_table_csr(pool: atb_mem.KVCachePool) -> None:
    pool.alloc_sequence(1, 5)
    pool.alloc_sequence(2, 8)
    indptr, indices, last = pool.page_table_csr([1, 2])
    assert [a.dtype for a in (indptr, indices, last)] == [np.int32] * 3
    assert indptr.tolist() == [0, 2, 4]
    assert indices.tolist() == pool.block_table(1).tolist() + pool.block_table(2).tolist()
    assert last.tolist() == [1, 4]


def test_batch_table_updates_in_place(pool: atb_mem.KVCachePool) -> None:
    pool.alloc_sequence(1, 4)
    pool.alloc_sequence(2, 2)
    batch = pool.batch_table(max_seqs=3, max_blocks_per_seq=4)
    tables, lens, slots = batch.block_tables, batch.context_lens, batch.slot_mapping
    assert tables.shape == (3, 4) and tables.dtype == np.int32
    assert not tables.flags.writeable
    batch.add(1)
    batch.add(2)
    assert len(batch) == 2 and 2 in batch and batch.seq_ids == [1, 2]
    assert slots.tolist() == [atb_mem.PAD_SLOT] * 3
    address = tables.__array_interface__["data"][0]
    batch.append_tokens()
    # The same memory, updated: the views taken before the step see the new values.
    assert batch.block_tables.__array_interface__["data"][0] == address
    assert lens.tolist() == [5, 3, 0]
    assert tables[0, :2].tolist() == pool.block_table(1).tolist()
    assert slots[:2].tolist() == [*pool.slot_mapping([1], [4], [5]),
                                  *pool.slot_mapping([2], [2], [3])]
    batch.remove(1)  # the last row moves into the hole
    assert batch.seq_ids == [2] and lens.tolist() == [3, 0, 0]
    assert tables[1].tolist() == [0, 0, 0, 0]
    # A change made outside the table is picked up on its next append.
    pool.append_tokens([2], n=3)
    batch.append_tokens(token_ids=[5])
    assert lens[0] == 7 and tables[0, :2].tolist() == pool.block_table(2).tolist()
    batch.clear()
    assert len(batch) == 0 and lens.tolist() == [0, 0, 0]


def test_batch_table_views_outlive_the_table() -> None:
    kv = atb_mem.KVCachePool(8, 2)
    kv.alloc_sequence(1, 3)
    batch = kv.batch_table(2, 4)
    batch.add(1)
    lens = batch.context_lens
    del batch, kv
    assert lens.tolist() == [3, 0]


def test_stats_fragmentation(pool: atb_mem.KVCachePool) -> None:
    pool.alloc_sequence(1, 5)  # 2 blocks, 3 slots unused
    pool.fork(1, 2)  # the shared partial block counts once
    stats = pool.stats()
    assert stats["allocated_slots"] == 8 and stats["used_slots"] == 5
    assert stats["fragmentation"] == pytest.approx(3 / 8)
    assert stats["num_tokens"] == 10 and stats["num_sequences"] == 2
    assert stats["blocks_used"] + stats["blocks_free"] + stats["blocks_cached"] == 16


def test_reset_prefix_cache(pool: atb_mem.KVCachePool) -> None:
    pool.alloc_sequence(1, list(range(9)))
    pool.mark_computed(1)
    pool.free_sequence(1)
    assert pool.reset_prefix_cache() == 2
    assert pool.alloc_sequence(2, list(range(9))) == 0
    pool._check_invariants()


def test_large_batches_release_the_gil_and_stay_correct() -> None:
    kv = atb_mem.KVCachePool(70_000, 16)
    ids = np.arange(5000, dtype=np.int64)
    for seq_id in ids.tolist():
        kv.alloc_sequence(seq_id, 3)
    slots = kv.append_tokens(ids, n=1)
    assert len(np.unique(slots)) == 5000
    assert kv.block_tables(ids).shape == (5000, 1)
    kv._check_invariants()


def test_numpy_scalars_are_ints(pool: atb_mem.KVCachePool) -> None:
    assert pool.alloc_sequence(np.int64(5), np.int32(3)) == 0
    assert pool.seq_len(np.uint16(5)) == 3
    pool.append_tokens([np.int64(5)], n=np.int8(2))
    assert pool.seq_len(5) == 5
    assert pool.alloc_sequence(6, (1, 2, 3)) == 0  # a tuple of ids

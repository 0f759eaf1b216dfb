"""KV-cache groups through the Python API: layer types make groups that share one pool, each
with its own block tables and slot mappings; windows release blocks (the null block stands
in); prefix hits every group serves; explain_prefix and the miss counters say why a hit
stops; bad arguments change nothing; without layer types nothing changes."""

from __future__ import annotations

import numpy as np
import pytest

from atb_mem import ContinuousBatchScheduler, KVCachePool, OutOfMemoryError
from atb_mem.kv import GroupPrefix, KVCacheGroup
from tests.support.unchanged import assert_unchanged, kv_snapshot

SLIDING, FULL = "sliding_attention", "full_attention"
GEMMA_LIKE = [SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL]


def hybrid(num_blocks: int = 64, block_size: int = 2, **kwargs: object) -> KVCachePool:
    arguments: dict[str, object] = {"num_layers": 6, "num_kv_heads": 2, "head_dim": 4,
                                    "dtype": "float32", "layer_types": GEMMA_LIKE,
                                    "sliding_window": 4, **kwargs}
    return KVCachePool(num_blocks, block_size, **arguments)  # type: ignore[arg-type]


def test_layer_types_make_groups_of_equal_size_sharing_planes() -> None:
    pool = hybrid()
    assert pool.groups == [KVCacheGroup(SLIDING, (0, 1), 4), KVCacheGroup(FULL, (2, 5), None),
                           KVCacheGroup(SLIDING, (3, 4), 4)]
    assert pool.layers_per_block == 2
    plain = KVCachePool(64, 2, num_layers=6, num_kv_heads=2, head_dim=4, dtype="float32")
    assert plain.bytes_per_block * 2 == pool.bytes_per_block * 6  # a block holds 2 layers
    assert pool.kv_cache.shape == (2, 2, 64, 2, 2, 4)
    assert [pool.group_of_layer(layer) for layer in range(6)] == [
        (0, 0), (0, 1), (1, 0), (2, 0), (2, 1), (1, 1)]
    # Layers at the same place of different groups share a plane; a block is one group's.
    assert np.shares_memory(pool.key_cache(0), pool.key_cache(3))
    assert not np.shares_memory(pool.key_cache(0), pool.key_cache(1))
    # Without layer types: one full group of every layer, today's layout.
    assert plain.groups == [KVCacheGroup(FULL, tuple(range(6)), None)]
    assert plain.layers_per_block == 6 and plain.kv_cache.shape[0] == 6


def test_a_window_without_layer_types_makes_every_layer_slide() -> None:
    pool = KVCachePool(16, 2, num_layers=3, sliding_window=8, device=None)
    assert pool.groups == [KVCacheGroup(SLIDING, (0, 1, 2), 8)]


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"layer_types": [SLIDING] * 6, "sliding_window": None}, ValueError, "sliding_window"),
    ({"layer_types": [FULL] * 5}, ValueError, "names 5 layers"),
    ({"layer_types": ["mamba"] * 6}, ValueError, "unknown layer type"),
    ({"layer_types": "full_attention"}, TypeError, "list of str"),
    ({"layer_types": ["chunked_attention"] * 6}, ValueError, "attention_chunk_size"),
    ({"sliding_window": 0}, ValueError, "at least 1"),
])
def test_bad_group_arguments_are_refused(kwargs: dict[str, object], error: type[Exception],
                                         match: str) -> None:
    with pytest.raises(error, match=match):
        hybrid(**kwargs)


def test_each_group_has_its_own_tables_and_slots() -> None:
    pool = hybrid(device=None)
    pool.alloc_sequence(1, list(range(9)))
    slots = pool.append_tokens([1], 2)
    assert slots.shape == (3, 2)  # [groups, tokens]
    tables = [pool.block_table(1, group=g) for g in range(3)]
    assert len({int(b) for table in tables for b in table}) == 3 * 6  # no block in two groups
    for group, table in enumerate(tables):
        expected = [int(table[p // 2]) * 2 + p % 2 for p in (9, 10)]
        assert slots[group].tolist() == expected
        assert pool.slot_mapping([1], [9], [11], group=group).tolist() == expected
        assert pool.block_tables([1], group=group)[0].tolist() == table.tolist()
    with pytest.raises(ValueError, match="group 3 does not exist"):
        pool.block_table(1, group=3)


def test_marking_computed_releases_what_the_window_left_behind() -> None:
    pool = hybrid(device=None)
    pool.alloc_sequence(1, list(range(12)))
    pool.mark_computed(1, 12)                  # computing 0..12 reads from 0: nothing goes
    pool.append_tokens([1], 1)
    before = pool.stats()["blocks_used"]
    pool.mark_computed(1, 13)                  # token 12 reads 9..12: blocks 0..3 go
    for group in (0, 2):
        table = pool.block_table(1, group=group)
        assert table[:4].tolist() == [0] * 4 and (table[4:] != 0).all()
    assert (pool.block_table(1, group=1) != 0).all()
    assert pool.stats()["blocks_used"] == before - 2 * 4
    # Released tokens have no slots any more; the refusal changes nothing.
    with pytest.raises(ValueError, match="released"):
        pool.slot_mapping([1], [0], [13], group=0)
    assert pool.slot_mapping([1], [0], [13], group=1).shape == (13,)
    pool._check_invariants()


def test_scheduler_plans_give_one_array_per_group() -> None:
    pool = hybrid()
    scheduler = ContinuousBatchScheduler(pool, max_num_seqs=4, max_num_batched_tokens=64)
    scheduler.add_request(1, list(range(10)), max_new_tokens=3)
    scheduler.add_request(2, list(range(100, 107)), max_new_tokens=3)
    plan = scheduler.step()
    assert plan.slot_mapping.shape == (3, 17)
    assert plan.block_tables.shape == (3, 2, 5)
    for group in range(3):
        rows = [pool.block_table(seq, group=group) for seq in (1, 2)]
        assert plan.block_tables[group][0].tolist() == rows[0].tolist()
        assert plan.block_tables[group][1][:4].tolist() == rows[1].tolist()
    plain = KVCachePool(64, 2, num_layers=6, device=None)
    plain_scheduler = ContinuousBatchScheduler(plain, max_num_seqs=4)
    plain_scheduler.add_request(1, list(range(10)), max_new_tokens=3)
    plain_plan = plain_scheduler.step()
    assert plain_plan.slot_mapping.ndim == 1 and plain_plan.block_tables.ndim == 2


def test_explain_prefix_says_why_and_stats_count_misses() -> None:
    pool = hybrid(device=None)
    prompt = [int(t) for t in np.arange(20) * 7 % 11]
    why = pool.explain_prefix(prompt)
    assert (why.hit_tokens, why.reason, why.limited_by) == (0, "not_cached", 1)
    assert why.groups[1] == GroupPrefix(1, FULL, 0, "not_cached")
    pool.alloc_sequence(1, prompt)
    pool.mark_computed(1)
    why = pool.explain_prefix(prompt)
    assert (why.hit_tokens, why.reason, why.limited_by) == (18, "block_alignment", None)
    assert pool.explain_prefix(prompt[:2]).reason == "block_alignment"  # too short to hit
    stats = pool.stats()
    assert stats["prefix_cache_misses_not_cached"] == 1  # the first admission
    pool.alloc_sequence(2, prompt[:2])
    assert pool.stats()["prefix_cache_misses_block_alignment"] == 1
    off = KVCachePool(8, 2, enable_prefix_caching=False, device=None)
    assert off.explain_prefix([1, 2, 3]).reason == "prefix_caching_off"
    with pytest.raises(ValueError, match="at least one"):
        pool.explain_prefix([])


def test_a_call_that_fails_changes_nothing() -> None:
    pool = hybrid(num_blocks=12, device=None)
    pool.alloc_sequence(1, list(range(6)))     # 3 groups × 3 blocks: 2 of 11 left
    before = (pool.stats(), [pool.block_table(1, group=g).tolist() for g in range(3)])
    with pytest.raises(OutOfMemoryError):
        pool.alloc_sequence(2, list(range(6)))
    with pytest.raises(OutOfMemoryError):
        pool.append_tokens([1], 1)             # a block in each group
    with pytest.raises(ValueError):
        pool.mark_computed(1, 7)
    assert (pool.stats(), [pool.block_table(1, group=g).tolist() for g in range(3)]) == before
    pool._check_invariants()


def test_cache_pressure_does_not_collapse_hybrid_hits() -> None:
    """A trace with shared prefixes on the same bytes, roomy to tight: with groups the hit
    rate stays within half of a cache that keeps every block, and at over 80% occupancy it
    keeps at least 40% of what it gets when roomy (benches/hybrid_hit_rate.py reports the
    table)."""
    from tests.support.hybrid_replay import prompts, replay

    requests = prompts(200)
    grouped = {mib: replay(requests, mib << 20, True) for mib in (64, 128, 512)}
    plain = {mib: replay(requests, mib << 20, False) for mib in (64, 128, 512)}
    for mib in grouped:
        assert grouped[mib].hit_rate >= 0.5 * plain[mib].hit_rate, (mib, grouped, plain)
    assert grouped[64].occupancy > 0.8 and grouped[512].occupancy < 0.3, grouped
    assert grouped[64].hit_rate >= 0.4 * grouped[512].hit_rate, grouped


@pytest.mark.parametrize("bad", [-1, 2**70, 1.5, "2", None])
def test_bad_group_and_layer_arguments_are_clear_errors(bad: object) -> None:
    pool = hybrid(device=None)
    pool.alloc_sequence(1, list(range(5)))
    before = pool.stats()
    for call in (lambda: pool.block_table(1, group=bad),  # type: ignore[arg-type]
                 lambda: pool.block_tables([1], group=bad),  # type: ignore[arg-type]
                 lambda: pool.slot_mapping([1], [0], [5], group=bad),  # type: ignore[arg-type]
                 lambda: pool.page_table_csr([1], group=bad),  # type: ignore[arg-type]
                 lambda: pool.group_of_layer(bad)):  # type: ignore[arg-type]
        with pytest.raises((TypeError, ValueError, OverflowError)):
            call()
    with pytest.raises((TypeError, ValueError, OverflowError)):
        hybrid(sliding_window=bad)
    with pytest.raises(ValueError, match="layer 6 is not a layer"):
        pool.group_of_layer(6)
    assert pool.stats() == before


def test_flashinfers_page_table_of_a_window_lists_only_the_blocks_it_holds() -> None:
    """A sliding group's CSR starts at the first block its window still holds (FlashInfer
    reads those with ``window_left = W - 1``: the null block is never listed); a full group's
    lists every block."""
    pool = KVCachePool(64, 2, num_layers=2, device=None, sliding_window=3,
                       layer_types=["sliding_attention", "full_attention"])
    pool.alloc_sequence(1, list(range(7)))
    pool.mark_computed(1)
    for token in range(4):
        pool.append_tokens([1], token_ids=[token])
        pool.mark_computed(1)  # 11 tokens; token 10 read positions 8-10: blocks 4 and 5
    sliding, full = (pool.block_table(1, group=group) for group in (0, 1))
    assert (sliding[:4] == 0).all() and (sliding[4:] > 0).all()
    indptr, indices, last = pool.page_table_csr([1], group=0)
    assert indices.tolist() == sliding[4:].tolist() and indptr.tolist() == [0, 2]
    assert last.tolist() == [1]  # 11 tokens: the last page holds one
    indptr, indices, last = pool.page_table_csr([1], group=1)
    assert indices.tolist() == full.tolist() and indptr.tolist() == [0, 6]


def test_a_batch_table_has_a_table_and_a_slot_per_group() -> None:
    pool = hybrid(num_blocks=64, device=None)
    groups = len(pool.groups)
    for seq_id in (1, 2):
        pool.alloc_sequence(seq_id, list(range(5)))
    batch = pool.batch_table(max_seqs=3, max_blocks_per_seq=8)
    tables, slots = batch.block_tables, batch.slot_mapping
    assert tables.shape == (groups, 3, 8) and slots.shape == (groups, 3)
    batch.add(1)
    batch.add(2)
    for _ in range(6):
        batch.append_tokens(token_ids=[7, 8])
        for row, seq_id in enumerate((1, 2)):
            end = pool.seq_len(seq_id)
            for group in range(groups):
                blocks = pool.block_table(seq_id, group=group).tolist()
                assert tables[group, row, :len(blocks)].tolist() == blocks
                assert not tables[group, row, len(blocks):].any()
                assert slots[group, row] == pool.slot_mapping([seq_id], [end - 1], [end],
                                                              group=group)[0]
        # The model computed the tokens: the windows move, and the next append shows it.
        for seq_id in (1, 2):
            pool.mark_computed(seq_id)
    sliding = next(g for g, group in enumerate(pool.groups) if group.kind == SLIDING)
    assert tables[sliding, 0, 0] == 0, "a block the window left is the null block"
    assert slots[:, 2].tolist() == [-1] * groups and not tables[:, 2].any()
    # A single-group table keeps its shapes.
    plain = KVCachePool(8, 2).batch_table(2, 4)
    assert plain.block_tables.shape == (2, 4) and plain.slot_mapping.shape == (2,)


def test_a_batch_table_call_that_fails_changes_nothing() -> None:
    pool = hybrid(num_blocks=18, device=None)  # 3 groups: 6 + 9 of 17 blocks, 2 left
    pool.alloc_sequence(1, list(range(4)))
    pool.alloc_sequence(2, list(range(6)))
    batch = pool.batch_table(max_seqs=2, max_blocks_per_seq=3)
    batch.add(1)
    batch.add(2)
    observe = lambda: kv_snapshot(pool, batch)  # noqa: E731
    assert_unchanged(observe, ValueError, lambda: batch.add(2), match="already")
    assert_unchanged(observe, ValueError, lambda: batch.add(7))
    assert_unchanged(observe, ValueError, lambda: batch.append_tokens([1]), match="2 rows")
    # Sequence 2's next token needs a 4th block per row: wider than the table.
    assert_unchanged(observe, ValueError, lambda: batch.append_tokens(), match="holds 3")
    batch.remove(2)
    # Sequence 1's 5th token needs a block in each of the 3 groups; 2 are free.
    assert_unchanged(observe, OutOfMemoryError, lambda: batch.append_tokens())
    pool._check_invariants()

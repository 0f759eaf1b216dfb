"""Eviction policies from Python: a system prompt reused between one-off prompts survives a
flood under SLRU and LFU, where LRU lets it go; a bad name is a clear error."""

from __future__ import annotations

import pytest

import atb_mem

BLOCK_SIZE = 4
SYSTEM = list(range(1, 9))  # two full blocks


def survives_a_flood(policy: str) -> bool:
    """The system prompt is used twice, then 12 one-off prompts of two blocks each flow
    through a 9-block cache: is the system prompt still a hit?"""
    kv = atb_mem.KVCachePool(10, BLOCK_SIZE, device=None, eviction_policy=policy)
    seq = iter(range(1, 1000))
    for suffix in (100, 200):  # used twice: a reused prefix
        seq_id = next(seq)
        kv.alloc_sequence(seq_id, [*SYSTEM, suffix])
        kv.mark_computed(seq_id)
        kv.free_sequence(seq_id)
    for one_off in range(12):
        seq_id = next(seq)
        kv.alloc_sequence(seq_id, [1000 + 10 * one_off + t for t in range(9)])
        kv.mark_computed(seq_id)
        kv.free_sequence(seq_id)
    kv._check_invariants()
    return kv.explain_prefix([*SYSTEM, 7]).hit_tokens == len(SYSTEM)


@pytest.mark.parametrize("policy, survives", [("lru", False), ("lfu", True), ("slru", True)])
def test_a_reused_prefix_against_a_flood_of_one_off_prompts(policy: str, survives: bool) -> None:
    assert survives_a_flood(policy) is survives


def test_the_policy_is_named_and_a_bad_one_refused() -> None:
    assert atb_mem.KVCachePool(8, 4, device=None).eviction_policy == "priority"
    assert atb_mem.KVCachePool(8, 4, device=None, eviction_policy="slru").eviction_policy == \
        "slru"
    with pytest.raises(ValueError, match="unknown eviction_policy 'mru'"):
        atb_mem.KVCachePool(8, 4, device=None, eviction_policy="mru")
    with pytest.raises(TypeError):
        atb_mem.KVCachePool(8, 4, device=None, eviction_policy=3)

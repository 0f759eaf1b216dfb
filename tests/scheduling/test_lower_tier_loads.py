"""Loads from lower tiers through the Python scheduler: an offered prefix makes the admission
list its blocks to load (device block and chain hash), the request waits for
``finish_loads``, and bad calls raise and change nothing."""

from __future__ import annotations

import numpy as np
import pytest

import atb_mem
from tests.support.unchanged import kv_snapshot

BLOCK_SIZE = 4


def scheduler() -> tuple[atb_mem.KVCachePool, atb_mem.ContinuousBatchScheduler]:
    kv = atb_mem.KVCachePool(64, BLOCK_SIZE, device=None)
    return kv, atb_mem.ContinuousBatchScheduler(kv, max_num_batched_tokens=256, watermark=0)


def test_an_offered_prefix_is_loaded_then_served() -> None:
    kv, sched = scheduler()
    prompt = list(range(1, 14))  # 3 full blocks before the last token
    sched.add_request(1, prompt, 4)
    sched.offer_external_prefix(1, 3)
    plan = sched.step(now=0.0)
    assert len(plan) == 0 and sched.stats()["loading"] == 1
    assert plan.load_seq_ids.dtype == np.uint64 and plan.load_seq_ids.tolist() == [1, 1, 1]
    assert plan.load_blocks.tolist() == kv.block_table(1)[:3].tolist()
    np.testing.assert_array_equal(plan.load_keys, kv.block_hashes(prompt)[:3])
    assert kv.explain_prefix(prompt).hit_tokens == 0, "nothing hits a block being loaded"
    sched.finish_loads(plan.load_seq_ids[:1], [True])
    plan = sched.step(now=0.0)
    assert plan.prefill_seq_ids.tolist() == [1]
    assert plan.query_lens.tolist() == [len(prompt) - 3 * BLOCK_SIZE]
    stats = sched.stats()
    assert (stats["loads_started"], stats["loaded_blocks"], stats["load_failures"]) == (1, 3, 0)
    sched._check_invariants()


def test_a_failed_load_is_recomputed() -> None:
    _, sched = scheduler()
    sched.add_request(1, list(range(1, 14)), 4)
    sched.offer_external_prefix(1, 2)
    sched.step(now=0.0)
    sched.finish_loads([1], np.array([False]))
    plan = sched.step(now=0.0)
    assert plan.query_lens.tolist() == [13]
    assert sched.stats()["load_failures"] == 1


def test_bad_offers_and_reports_raise_and_change_nothing() -> None:
    kv, sched = scheduler()
    sched.add_request(1, list(range(1, 14)), 4)
    sched.add_request(2, 13, 4)
    before = kv_snapshot(kv)
    with pytest.raises(ValueError, match="cannot be loaded"):
        sched.offer_external_prefix(1, 4)
    with pytest.raises(ValueError, match="token ids"):
        sched.offer_external_prefix(2, 1)
    with pytest.raises(KeyError):
        sched.offer_external_prefix(9, 1)
    with pytest.raises(ValueError):
        sched.offer_external_prefix(1, -1)
    sched.offer_external_prefix(1, 2)
    sched.step(now=0.0)
    before, counts = kv_snapshot(kv), sched.stats()
    for seq_ids, done in (([2], [True]), ([1, 1], [True, True]), ([1], [])):
        with pytest.raises(ValueError):
            sched.finish_loads(seq_ids, done)
        assert kv_snapshot(kv) == before and sched.stats() == counts
    sched._check_invariants()

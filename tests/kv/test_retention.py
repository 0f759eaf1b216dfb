"""Retention by priority from Python (``eviction_policy="priority"``): a system prompt a
request pins at 100 survives a flood of one-off prompts that LRU, or an unpinned run, loses
it to; a duration ends the pin on the clock the caller advances; bad retention is a clear
error and changes nothing; a scheduler's request takes its retention at admission, all or
nothing."""

from __future__ import annotations

from typing import Any

import pytest

import atb_mem
from atb_mem.kv.retention import Retention
from atb_mem.scheduling.continuous import ContinuousBatchScheduler
from atb_mem.serving.params import SamplingParams

BLOCK_SIZE = 4
SYSTEM = list(range(1, 17))  # four full blocks
SECOND_NS = 1_000_000_000


def pin(kv: Any, seq_id: int, priority: int = 100, duration_ns: int | None = None) -> None:
    kv.set_retention(seq_id, [(0, len(SYSTEM), priority, duration_ns)])


def run(kv: Any, seq_id: int, tokens: list[int], pinned: bool = False, **pin_args: Any) -> None:
    kv.alloc_sequence(seq_id, tokens)
    if pinned:
        pin(kv, seq_id, **pin_args)
    kv.mark_computed(seq_id)
    kv.free_sequence(seq_id)


def flood(kv: Any, first_id: int = 100) -> None:
    """40 one-off prompts of five blocks each through a 23-block cache."""
    for n in range(40):
        run(kv, first_id + n, [10_000 + 100 * n + t for t in range(20)])
    kv._check_invariants()


def system_hit(kv: Any) -> int:
    hit: int = kv.explain_prefix([*SYSTEM, 9, 9, 9]).hit_tokens
    return hit


@pytest.mark.parametrize("policy, pinned, survives", [
    ("priority", True, True), ("priority", False, False), (None, True, True)])
def test_a_pinned_system_prompt_survives_a_flood(policy: str | None, pinned: bool,
                                                  survives: bool) -> None:
    """The default policy honours retention: a request that asks for it gets it."""
    kv = atb_mem.KVCachePool(24, BLOCK_SIZE, device=None, eviction_policy=policy)
    run(kv, 1, [*SYSTEM, 5, 6, 7], pinned)
    flood(kv)
    assert system_hit(kv) == (len(SYSTEM) if survives else 0)


@pytest.mark.parametrize("policy", ["lru", "lfu", "slru"])
def test_retention_under_a_policy_that_ignores_it_is_refused(policy: str) -> None:
    kv = atb_mem.KVCachePool(24, BLOCK_SIZE, device=None, eviction_policy=policy)
    kv.alloc_sequence(1, [*SYSTEM, 5])
    before = kv.stats()
    with pytest.raises(ValueError, match=f"eviction_policy='priority'.*'{policy}'"):
        pin(kv, 1)
    assert kv.stats() == before
    kv.set_retention(1, [])  # asking for nothing is no retention, under any policy


def test_on_a_tie_the_longer_duration_holds() -> None:
    """Two ranges of one priority over the same tokens: the pin without an end holds,
    whichever comes first."""
    for durations in [(SECOND_NS // 4, None), (None, SECOND_NS // 4)]:
        kv = atb_mem.KVCachePool(24, BLOCK_SIZE, device=None, eviction_policy="priority")
        kv.alloc_sequence(1, [*SYSTEM, 5, 6, 7])
        kv.set_retention(1, [(0, len(SYSTEM), 100, duration) for duration in durations])
        kv.mark_computed(1)
        kv.free_sequence(1)
        kv.advance_clock(SECOND_NS)
        flood(kv)
        assert system_hit(kv) == len(SYSTEM), durations


def test_a_pin_ends_with_its_duration() -> None:
    kv = atb_mem.KVCachePool(24, BLOCK_SIZE, device=None, eviction_policy="priority")
    run(kv, 1, [*SYSTEM, 5, 6, 7], True, duration_ns=SECOND_NS)
    kv.advance_clock(SECOND_NS // 2)
    flood(kv)
    assert system_hit(kv) == len(SYSTEM)
    kv.advance_clock(2 * SECOND_NS)
    flood(kv, 200)
    assert system_hit(kv) == 0


def test_bad_retention_is_a_clear_error_and_changes_nothing() -> None:
    kv = atb_mem.KVCachePool(24, BLOCK_SIZE, device=None, eviction_policy="priority")
    kv.alloc_sequence(1, [*SYSTEM, 5])
    before = kv.stats()
    with pytest.raises(ValueError, match="0 to 100"):
        kv.set_retention(1, [(0, 16, 101, None)])
    with pytest.raises(ValueError, match="0 to 100"):
        kv.set_retention(1, [(0, 16, 300, None)])
    with pytest.raises(ValueError, match="ends after it starts"):
        kv.set_retention(1, [(8, 8, 50, None)])
    with pytest.raises(ValueError):
        kv.set_retention(1, [(0, 16, 50, -1)])
    with pytest.raises(atb_mem.UnknownSequenceError):
        kv.set_retention(7, [(0, 16, 50, None)])
    for huge in (2**63, 2**64 - 1, 2**70):
        with pytest.raises(ValueError, match=r"too large: .* is above 2\*\*63 - 1"):
            kv.set_retention(1, [(0, 16, 50, huge)])
        with pytest.raises(ValueError, match=r"above 2\*\*63 - 1"):
            kv.advance_clock(huge)
    assert kv.stats() == before
    kv._check_invariants()


@pytest.mark.parametrize("bad, error", [
    ({"retention": [(0, 16, 101, None)]}, ValueError),
    ({"retention": [(0, 16, 50)]}, ValueError),
    ({"retention": [(-1, 16, 50, None)]}, ValueError),
    ({"retention": [(0, 16, 50, float("inf"))]}, ValueError),
    ({"retention": [(0, 16, "high", None)]}, TypeError),
    ({"decode_retention": (50,)}, ValueError),
    ({"decode_retention": (50, -2.0)}, ValueError),
    ({"priority": -1}, ValueError),
    ({"priority": 2**32}, ValueError),
    ({"retention": [(0, 4, 50, None)] * 65}, ValueError),
])
def test_sampling_params_check_their_retention(bad: dict[str, Any],
                                               error: type[Exception]) -> None:
    with pytest.raises(error):
        SamplingParams(**bad)


def test_sampling_params_make_one_retention() -> None:
    params = SamplingParams(retention=[[0, None, 90, 60.0]], decode_retention=(10, None))
    assert params.retention == ((0, None, 90, 60.0),)
    config = params.retention_config
    assert config == Retention(((0, None, 90, 60.0),), (10, None))
    assert config.core_args() == ([(0, None, 90, 60 * SECOND_NS)], (10, None), 35)
    assert SamplingParams().retention_config is None


def test_a_schedulers_request_is_admitted_with_its_retention() -> None:
    kv = atb_mem.KVCachePool(24, BLOCK_SIZE, device=None, eviction_policy="priority")
    scheduler = ContinuousBatchScheduler(kv, max_num_seqs=1, max_num_batched_tokens=64)
    with pytest.raises(TypeError, match="retention must be a Retention"):
        scheduler.add_request(1, [*SYSTEM, 5], 1, retention=[(0, 16, 100, None)])  # type: ignore[arg-type]
    assert scheduler.stats()["waiting"] == 0, "a refused request is not queued"
    pinned = Retention(((0, len(SYSTEM), 100, None),))
    scheduler.add_request(1, [*SYSTEM, 5, 6, 7], 1, retention=pinned)
    for _ in range(4):
        plan = scheduler.step(now=0.0)
        scheduler.on_tokens(plan.sample_seq_ids, [3] * len(plan.sample_seq_ids))
    assert not kv.seq_ids()
    flood(kv)
    assert system_hit(kv) == len(SYSTEM)

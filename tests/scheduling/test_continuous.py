"""ContinuousBatchScheduler: budgets, preemption (recompute and swap), prefix hits, errors,
reconfiguration, and a replay of a real request trace with no model."""

from __future__ import annotations

import numpy as np
import pytest

import atb_mem
from atb_mem import ContinuousBatchScheduler
from atb_mem.tools import simulate
from tests.support.data import AZURE_CODE_TRACE


def drive(scheduler: ContinuousBatchScheduler, requests: dict[int, int], max_steps: int = 100_000,
          on_step=None) -> dict[int, int]:
    """Runs steps until every request finished; returns the tokens each sampled."""
    sampled = dict.fromkeys(requests, 0)
    config = scheduler.config
    for step in range(max_steps):
        plan = scheduler.step(now=float(step))
        assert plan.num_batched_tokens == int(plan.query_lens.sum())
        assert plan.num_batched_tokens <= config["max_num_batched_tokens"]
        assert len(plan) <= config["max_num_seqs"]
        assert plan.block_tables.shape[0] == len(plan) == len(plan.context_lens)
        assert len(plan.slot_mapping) == plan.num_batched_tokens
        scheduler._check_invariants()
        if on_step:
            on_step(plan)
        for seq_id in plan.sample_seq_ids.tolist():
            sampled[seq_id] += 1
        scheduler.on_tokens(plan.sample_seq_ids, plan.sample_seq_ids % 1000)
        if all(sampled[s] == requests[s] for s in requests) and not len(scheduler.kv_cache):
            return sampled
    raise AssertionError("requests did not finish")


def test_every_request_finishes_with_exactly_its_tokens() -> None:
    kv = atb_mem.KVCachePool(64, 4, device=None)
    scheduler = ContinuousBatchScheduler(kv, max_num_seqs=4, max_num_batched_tokens=16)
    requests = {i: 1 + i % 5 for i in range(12)}
    for seq_id, new_tokens in requests.items():
        scheduler.add_request(seq_id, 5 + seq_id, new_tokens)
    assert drive(scheduler, requests) == requests
    assert scheduler.stats()["finished"] == 12 and kv.num_free_blocks == 63


def test_plan_arrays_match_the_cache() -> None:
    kv = atb_mem.KVCachePool(64, 4, device=None)
    scheduler = ContinuousBatchScheduler(kv, max_num_seqs=8, max_num_batched_tokens=10)
    scheduler.add_request(1, 7, 4)
    scheduler.add_request(2, 6, 4)
    plan = scheduler.step(now=0.0)
    # 10 tokens: sequence 1's whole prompt, then the first 3 of sequence 2's (chunked).
    assert plan.prefill_seq_ids.tolist() == [1, 2] and plan.prefill_tokens.tolist() == [7, 3]
    assert plan.sample_seq_ids.tolist() == [1]
    assert plan.context_lens.tolist() == [7, 3]
    assert plan.slot_mapping.tolist() == [*kv.slot_mapping([1], [0], [7]),
                                          *kv.slot_mapping([2], [0], [3])]
    assert plan.block_tables[0, :2].tolist() == kv.block_table(1).tolist()
    for array in (plan.query_lens, plan.context_lens, plan.block_tables, plan.slot_mapping):
        assert array.dtype == np.int32


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_preemption_resumes_and_finishes(preemption: str) -> None:
    kv = atb_mem.KVCachePool(12, 4, device=None, num_host_blocks=40)
    scheduler = ContinuousBatchScheduler(kv, max_num_seqs=8, max_num_batched_tokens=64,
                                         preemption=preemption, watermark=0.0)
    requests = {i: 12 for i in range(4)}
    for seq_id in requests:
        scheduler.add_request(seq_id, 8, 12)
    preempted: list[int] = []
    swaps: list[int] = []

    def record(plan) -> None:
        preempted.extend(plan.preempted_seq_ids.tolist())
        swaps.append(len(plan.swap_out))

    assert drive(scheduler, requests, on_step=record) == requests
    assert preempted and scheduler.stats()["preemptions"] == len(preempted)
    assert (sum(swaps) > 0) == (preemption == "swap")


def test_swap_moves_bytes_of_a_byte_backed_cache() -> None:
    kv = atb_mem.KVCachePool(12, 4, num_kv_heads=1, head_dim=4, dtype="float32",
                             num_host_blocks=40)
    scheduler = ContinuousBatchScheduler(kv, max_num_batched_tokens=64, preemption="swap",
                                         watermark=0.0)
    requests = {i: 12 for i in range(4)}
    for seq_id in requests:
        scheduler.add_request(seq_id, 8, 12)
    moved: list[int] = []

    def write_and_check(plan) -> None:
        # Each token's key holds its sequence id: a swap that lost bytes would show.
        values = np.repeat(plan.seq_ids, plan.query_lens).astype(np.float32) + 1
        keys = np.repeat(values[:, None, None], 4, axis=2)
        kv.write_kv(0, plan.slot_mapping, keys, np.zeros_like(keys))
        moved.append(len(plan.swap_in))
        for seq_id in plan.decode_seq_ids.tolist():
            computed = int(plan.context_lens[plan.seq_ids.tolist().index(seq_id)]) - 1
            slots = kv.slot_mapping([seq_id], [0], [computed])
            assert (kv.key_cache(0).reshape(-1, 1, 4)[slots] == seq_id + 1).all()

    drive(scheduler, requests, on_step=write_and_check)
    assert sum(moved) > 0


def test_prefix_hits_count_as_computed() -> None:
    kv = atb_mem.KVCachePool(64, 4, device=None)
    scheduler = ContinuousBatchScheduler(kv, max_num_batched_tokens=64)
    prompt = list(range(13))
    scheduler.add_request(1, prompt, 1)
    plan = scheduler.step(now=0.0)
    assert plan.prefill_tokens.tolist() == [13]
    scheduler.on_tokens(plan.sample_seq_ids, [5])
    scheduler.add_request(2, prompt, 1)
    plan = scheduler.step(now=1.0)
    assert plan.prefill_tokens.tolist() == [1]  # 12 tokens came from the cache


def test_priorities_are_admitted_first() -> None:
    kv = atb_mem.KVCachePool(64, 4, device=None)
    scheduler = ContinuousBatchScheduler(kv, max_num_seqs=1, max_num_batched_tokens=64)
    scheduler.add_request(1, 4, 1, priority=1, arrival_time=0.0)
    scheduler.add_request(2, 4, 1, priority=0, arrival_time=1.0)
    assert scheduler.step(now=1.0).prefill_seq_ids.tolist() == [2]


def test_bad_input_changes_nothing() -> None:
    kv = atb_mem.KVCachePool(16, 4, device=None)
    scheduler = ContinuousBatchScheduler(kv, max_num_batched_tokens=8,
                                         enable_chunked_prefill=False)
    scheduler.add_request(1, 4, 2)
    before = scheduler.stats()
    for call, error in [
        (lambda: scheduler.add_request(1, 4, 2), atb_mem.DuplicateSequenceError),
        (lambda: scheduler.add_request(2, 60, 4), ValueError),   # can never fit the cache
        (lambda: scheduler.add_request(3, 8, 4), ValueError),    # prefill above the budget
        (lambda: scheduler.add_request(4, 0, 4), ValueError),
        (lambda: scheduler.add_request(5, 4, 0), ValueError),
        (lambda: scheduler.add_request(6, [1.5], 1), TypeError),
        (lambda: scheduler.on_tokens([1], [3]), ValueError),     # nothing sampled yet
        (lambda: scheduler.on_tokens([9], [3]), atb_mem.UnknownSequenceError),
        (lambda: scheduler.abort(9), atb_mem.UnknownSequenceError),
        (lambda: scheduler.reconfigure(max_num_seqs=0), ValueError),
        (lambda: scheduler.reconfigure(watermark=1.5), ValueError),
        (lambda: scheduler.reconfigure(speed=2), ValueError),
    ]:
        with pytest.raises(error):
            call()
        assert scheduler.stats() == before
    with pytest.raises(ValueError, match="host tier"):
        ContinuousBatchScheduler(kv, preemption="swap")
    with pytest.raises(TypeError, match="KVCachePool"):
        ContinuousBatchScheduler(object())


def test_reconfigure_applies_at_the_next_step() -> None:
    kv = atb_mem.KVCachePool(64, 4, device=None)
    scheduler = ContinuousBatchScheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    for seq_id in range(4):
        scheduler.add_request(seq_id, 4, 8)
    previous = scheduler.reconfigure(max_num_seqs=2)
    assert previous["max_num_seqs"] == 4 and scheduler.config["max_num_seqs"] == 4
    assert len(scheduler.step(now=0.0)) == 2
    assert scheduler.config["max_num_seqs"] == 2


def test_abort_and_finish_free_the_blocks() -> None:
    kv = atb_mem.KVCachePool(64, 4, device=None)
    scheduler = ContinuousBatchScheduler(kv)
    scheduler.add_request(1, 10, 5)
    scheduler.add_request(2, 10, 5)
    scheduler.step(now=0.0)
    scheduler.abort(1)
    scheduler.finish(2)
    assert 1 not in scheduler and scheduler.stats()["finished"] == 1
    # Both have rows in the plan just returned, which the runner still executes: their
    # blocks stay until it has run, so no row writes into a block handed out again.
    assert len(kv) == 2
    plan = scheduler.step(now=0.0)
    assert len(kv) == 0 and sorted(plan.finished_seq_ids.tolist()) == [1, 2]


def load_trace(limit: int) -> list[tuple[float, int, int]]:
    return [(r.arrival, r.prompt, r.output) for r in simulate.load_trace(AZURE_CODE_TRACE, limit)]


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_trace_replay_forces_preemption_and_finishes_everything(preemption: str) -> None:
    # Arrivals 20x faster than recorded, on a cache of about 8k tokens: enough pressure that
    # decodes run out of blocks.
    trace = [(arrival / 20, prompt, generated) for arrival, prompt, generated in load_trace(300)]
    kv = atb_mem.KVCachePool(520, 16, device=None, num_host_blocks=4000)
    scheduler = ContinuousBatchScheduler(kv, max_num_seqs=64, max_num_batched_tokens=4096,
                                         preemption=preemption, watermark=0.0)
    expected = {seq_id: generated for seq_id, (_, _, generated) in enumerate(trace)}
    sampled = dict.fromkeys(expected, 0)
    now, next_request, steps = 0.0, 0, 0
    while next_request < len(trace) or len(kv) or scheduler.stats()["waiting"]:
        while next_request < len(trace) and trace[next_request][0] <= now:
            arrival, prompt, generated = trace[next_request]
            scheduler.add_request(next_request, prompt, generated, arrival_time=arrival)
            next_request += 1
        plan = scheduler.step(now=now)
        assert plan.num_batched_tokens <= 4096 and len(plan) <= 64
        scheduler._check_invariants()
        for seq_id in plan.sample_seq_ids.tolist():
            sampled[seq_id] += 1
        scheduler.on_tokens(plan.sample_seq_ids, plan.sample_seq_ids % 50_000)
        steps += 1
        # Cost model: 5 ms per step plus 0.1 ms per batched token; idle until the next arrival.
        now += 0.005 + 1e-4 * plan.num_batched_tokens
        if not len(plan) and next_request < len(trace):
            now = max(now, trace[next_request][0])
        assert steps < 200_000
    scheduler._check_invariants()
    assert sampled == expected
    assert len(kv) == 0 and scheduler.stats()["finished"] == len(trace)
    assert scheduler.stats()["preemptions"] > 0


def test_requests_wait_for_their_arrival_time() -> None:
    kv = atb_mem.KVCachePool(64, 4, device=None)
    scheduler = ContinuousBatchScheduler(kv)
    scheduler.add_request(1, 4, 1, arrival_time=10.0)
    scheduler.add_request(2, 4, 1, arrival_time=1.0)
    assert len(scheduler.step(now=0.5)) == 0
    assert scheduler.step(now=5.0).prefill_seq_ids.tolist() == [2]
    assert scheduler.step(now=10.0).prefill_seq_ids.tolist() == [1]


def test_core_configuration_round_trips_and_refuses_bad_dicts() -> None:
    from atb_mem import _core

    kv = atb_mem.KVCachePool(16, 4, device=None)
    core = ContinuousBatchScheduler(kv)._core
    config = core.config()
    assert core.set_config(config) == config
    for bad in ({**config, "speed": 1}, {"max_num_seqs": 4}, {**config, "preemption": 1},
                {**config, "watermark": "high"}):
        with pytest.raises((ValueError, TypeError)):
            core.set_config(bad)
        with pytest.raises((ValueError, TypeError)):
            _core.ContinuousScheduler(kv, bad)
    assert core.config() == config

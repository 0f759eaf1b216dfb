"""Controls of the continuous-batching state machine's byte check (it sees a prefix hit, and
one wrong byte), and the problems the machine found, minimised: each ``test_regression_*``
says what went wrong and what a fix must do."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import atb_mem
from tests.scheduling.fake_runner import (
    GARBAGE,
    check_bytes,
    execute_plan,
    kv_rows,
    make_kv,
    plan_codes,
)


def run_to_completion(kv: atb_mem.KVCachePool, sched: atb_mem.ContinuousBatchScheduler,
                      seq_id: int, codes: list[int]) -> None:
    """Steps until ``seq_id`` finishes, sampling token 3 each time, checking its bytes."""
    while seq_id in sched:
        plan = sched.step(now=0.0)
        execute_plan(kv, plan)
        check_bytes(kv, seq_id, codes)
        sched.on_tokens(plan.sample_seq_ids, [3] * len(plan.sample_seq_ids))
        codes.extend([3] * len(plan.sample_seq_ids))


def test_positive_control_identical_prompt_is_a_prefix_hit() -> None:
    kv = make_kv(16, 4, None)
    sched = atb_mem.ContinuousBatchScheduler(kv, max_num_batched_tokens=6, watermark=0.0)
    prompt = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    sched.add_request(1, prompt, 3)
    run_to_completion(kv, sched, 1, list(prompt))
    sched.add_request(2, prompt, 3)
    plan = sched.step(now=0.0)
    assert plan.seq_ids.tolist() == [2] and len(plan.prefill_seq_ids) == 1
    assert plan.query_lens[0] < len(prompt)  # 8 of the 10 tokens came from the cache
    assert plan.positions[0] == 8
    execute_plan(kv, plan)
    assert check_bytes(kv, 2, prompt) == len(prompt)


def test_negative_control_check_bytes_sees_one_wrong_byte() -> None:
    kv = make_kv(16, 4, 4)
    sched = atb_mem.ContinuousBatchScheduler(kv, max_num_batched_tokens=64, watermark=0.0)
    prompt = [2, 1, 0, 3, 3, 1]
    sched.add_request(1, prompt, 5)
    plan = sched.step(now=0.0)
    execute_plan(kv, plan)
    assert check_bytes(kv, 1, prompt) == 6
    block, offset = int(kv.block_table(1)[1]), 1  # position 5
    kv.value_cache(0)[block, offset, 0, 1] += 1
    with pytest.raises(AssertionError, match="position 5 of 6"):
        check_bytes(kv, 1, prompt)
    kv.value_cache(0)[block, offset, 0, 1] -= 1
    check_bytes(kv, 1, prompt)
    # On the host tier too.
    kv.swap_out([1])
    check_bytes(kv, 1, prompt)
    kv.host_kv_cache[0, 0, int(kv.block_table(1)[0]), 2, 0, 0] = GARBAGE
    with pytest.raises(AssertionError, match=r"\(host\): position 2"):
        check_bytes(kv, 1, prompt)
    # And a wrong reference token, as a prefix hit on another prompt's bytes would read.
    with pytest.raises(AssertionError, match="position 0"):
        check_bytes(kv, 1, [0, *prompt[1:]])


def test_regression_abort_between_plan_and_execution_serves_unwritten_blocks() -> None:
    """A request aborted after ``step()`` planned its prefill but before the runner executed
    the plan. The contract says the plan is still executed, every row ("even of requests
    aborted in the meantime"), because the blocks it computes joined the prefix cache when it
    was planned. But ``write_kv`` refuses the aborted rows' slots ("no sequence holds" their
    blocks), so a runner using it cannot write them — and the next identical prompt is served
    those never-written blocks as a prefix hit. Either ``write_kv`` must accept the rows of the
    plan just made, or an abort before execution must take their blocks out of the cache."""
    kv = make_kv(16, 4, None)
    sched = atb_mem.ContinuousBatchScheduler(kv, max_num_batched_tokens=64, watermark=0.0)
    prompt = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    sched.add_request(1, prompt, 3)
    plan = sched.step(now=0.0)
    sched.abort(1)  # the client went away while the forward pass was being launched
    refused = None
    try:
        execute_plan(kv, plan)  # every row, as the contract says
    except ValueError as error:  # found: "slot 4 is in block 1, which no sequence holds"
        refused = error
    sched.add_request(2, prompt, 3)
    plan = sched.step(now=0.0)
    execute_plan(kv, plan)
    try:
        check_bytes(kv, 2, prompt)
    except AssertionError as error:
        raise AssertionError(f"{error}; write_kv refused the aborted rows: {refused}") from None


def test_regression_abort_between_plan_and_execution_leaves_a_same_step_hit_unwritten() -> None:
    """The same, within one plan: request 2 (the same prompt, admitted in the same step) hits
    the blocks request 1's row computes — vLLM's rule, safe because the forward writes every
    row before attention reads. Request 1 is aborted before execution; ``write_kv`` refuses
    the plan (request 1's last block is held by nobody now), a runner can then write only the
    surviving rows, and request 2 — live, in this very plan — reads 8 positions nobody wrote.
    So it is ``write_kv`` (or abort, deferring its frees until the plan ran) that must give."""
    kv = make_kv(16, 4, None)
    sched = atb_mem.ContinuousBatchScheduler(kv, max_num_batched_tokens=64, watermark=0.0)
    prompt = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    sched.add_request(1, prompt, 3)
    sched.add_request(2, prompt, 3)
    plan = sched.step(now=0.0)
    assert plan.seq_ids.tolist() == [1, 2] and plan.query_lens.tolist() == [10, 2]
    sched.abort(1)
    refused = None
    try:
        execute_plan(kv, plan)  # every row, as the contract says
    except ValueError as error:  # found: "slot 12 is in block 3, which no sequence holds"
        refused = error
        keep = np.repeat(plan.seq_ids != 1, plan.query_lens)  # what write_kv still takes
        key, value = kv_rows(plan_codes(plan)[keep], plan.positions[keep])
        kv.write_kv(0, plan.slot_mapping[keep], key, value)
    try:
        check_bytes(kv, 2, prompt)
    except AssertionError as error:
        raise AssertionError(f"{error}; write_kv refused the plan: {refused}") from None


def test_regression_lowering_max_num_seqs_while_running_overfills_the_batch() -> None:
    """``reconfigure(max_num_seqs=2)`` with 4 sequences running: the next plan still has 4
    rows (more than a runner sized for 2 takes) and the scheduler's own invariant check
    fails ("4 running > max_num_seqs 2"). The next step should keep the batch within the new
    limit (preempting or pausing the extra sequences), or reconfigure should refuse."""
    kv = atb_mem.KVCachePool(64, 4, device=None)
    sched = atb_mem.ContinuousBatchScheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    for seq_id in range(4):
        sched.add_request(seq_id, 4, 8)
    plan = sched.step(now=0.0)
    sched.on_tokens(plan.sample_seq_ids, [1] * len(plan.sample_seq_ids))
    try:
        sched.reconfigure(max_num_seqs=2)
    except ValueError:
        return  # refusing while 4 run would be a fix too
    plan = sched.step(now=0.0)
    assert sched.config["max_num_seqs"] == 2
    assert len(plan) <= 2, f"{len(plan)} rows planned with max_num_seqs=2"
    sched._check_invariants()


def test_regression_swapped_out_while_its_token_is_pending_never_runs_again() -> None:
    """Pipelined sampling (``on_tokens`` for plan N reported after plan N+1 was made, which
    the scheduler allows: "a sequence whose last token was computed waits for its sampled
    token before it is scheduled again"). Request 2 finishes its prefill in plan 1; before
    its token is reported, plan 2 swaps it out to give request 1's decode a block. Then
    ``on_tokens`` refuses its token ("no token to sample now"), and once swapped back in it
    is running with every token computed — waiting for a token that can no longer be
    reported — so it is never scheduled again and holds its blocks forever. (With
    ``preemption="recompute"`` the same request recomputes and samples again.)"""
    kv = make_kv(6, 2, 8)  # 5 usable blocks
    sched = atb_mem.ContinuousBatchScheduler(kv, max_num_batched_tokens=64, preemption="swap",
                                             watermark=0.0)
    sched.add_request(1, [0, 1, 2, 3], 6)  # 2 blocks
    plan0 = sched.step(now=0.0)
    execute_plan(kv, plan0)
    sched.add_request(2, [1, 1, 2, 2, 3, 3], 4)  # 3 blocks: the cache is full
    plan1 = sched.step(now=0.0)  # request 1 waits for its token; request 2 is prefilled
    execute_plan(kv, plan1)
    assert plan1.sample_seq_ids.tolist() == [2]
    sched.on_tokens(plan0.sample_seq_ids, [3])  # plan 0's token, one step late
    plan2 = sched.step(now=0.0)  # request 1's decode needs a block: request 2 is swapped out
    execute_plan(kv, plan2)
    assert plan2.preempted_seq_ids.tolist() == [2] and kv.is_swapped(2)
    with contextlib.suppress(ValueError):  # found: "sequence 2 has no token to sample now"
        sched.on_tokens(plan1.sample_seq_ids, [2])
    pending = plan2.sample_seq_ids.tolist()
    for _ in range(40):
        if pending:
            sched.on_tokens(pending, [3] * len(pending))
        plan = sched.step(now=0.0)
        execute_plan(kv, plan)
        pending = plan.sample_seq_ids.tolist()
    assert 1 not in sched
    assert 2 not in sched, f"request 2 never ran again: {sched.stats()}"


def test_regression_lowering_the_budget_without_chunking_strands_a_request() -> None:
    """``add_request`` refuses, without chunked prefill, a request that may need a prefill
    above ``max_num_batched_tokens``; ``reconfigure`` lowers the budget below one accepted
    already. That request is then admitted (taking its blocks) and never scheduled: it holds
    5 blocks forever. ``reconfigure`` should refuse, or such a prefill be chunked anyway."""
    kv = atb_mem.KVCachePool(64, 4, device=None)
    sched = atb_mem.ContinuousBatchScheduler(kv, max_num_batched_tokens=32,
                                             enable_chunked_prefill=False)
    sched.add_request(1, 20, 4)  # 24 tokens at most: within the budget of 32
    try:
        sched.reconfigure(max_num_batched_tokens=8)
    except ValueError:
        return  # refusing is a fix too
    for _ in range(20):
        plan = sched.step(now=0.0)
        if len(plan.sample_seq_ids):
            sched.on_tokens(plan.sample_seq_ids, [1] * len(plan.sample_seq_ids))
    assert 1 not in sched, f"request 1 never ran: {sched.stats()}, {len(kv)} on the cache"


def test_regression_a_sequence_freed_behind_the_schedulers_back_fails_the_step_unchanged(
) -> None:
    """The step raised, but only after it had appended a slot to the other two sequences: the
    next step scheduled a position never computed. A step that raises must change nothing."""
    from tests.support.unchanged import kv_snapshot

    kv = atb_mem.KVCachePool(num_blocks=40, block_size=3, device=None)
    sched = atb_mem.ContinuousBatchScheduler(kv, max_num_batched_tokens=96, watermark=0.0)
    for seq_id, length in [(86, 7), (87, 8), (88, 5)]:
        sched.add_request(seq_id, length, 4)
    plan = sched.step(now=0.0)
    sched.on_tokens(plan.sample_seq_ids, [3] * len(plan.sample_seq_ids))
    kv.free_sequence(88)
    before = (kv_snapshot(kv), sched.stats(), [sched.progress(i) for i in (86, 87, 88)])
    with pytest.raises(atb_mem.UnknownSequenceError):
        sched.step(now=1.0)
    assert (kv_snapshot(kv), sched.stats(), [sched.progress(i) for i in (86, 87, 88)]) == before
    assert (kv.seq_len(86), kv.seq_len(87)) == (7, 8)


def test_a_refused_request_carries_its_id_and_the_reason_apart() -> None:
    """The engine renamed a refused request by rewriting the scheduler's message text; the
    refusal now carries ``seq_id`` and ``reason`` as fields, and changes nothing."""
    kv = atb_mem.KVCachePool(16, 4, device=None)
    sched = atb_mem.ContinuousBatchScheduler(kv, max_num_seqs=2)
    for args, reason in [((5, 300, 100), "may hold 400 tokens"),
                         ((6, 4, 4), "runs 3 samples side by side")]:
        with pytest.raises(atb_mem.RequestRefusedError) as refused:
            sched.add_request(*args, num_samples=1 if args[0] == 5 else 3)
        assert refused.value.seq_id == args[0]
        assert refused.value.reason.startswith(reason)
        assert str(refused.value) == f"request {args[0]} {refused.value.reason}"
        assert isinstance(refused.value, ValueError)
    assert sched.stats()["waiting"] == 0 and len(kv) == 0

"""Regression tests for the paths a loaded server takes every minute: aborts mid-prefill,
preemption by swap next to a copy-on-write, failed byte moves, writes with copies pending.

Each test drives the cache the way a model runner does — K/V of token ``t`` at position ``p``
is ``kv_value(t, p)`` — and then reads the bytes back, so a block served before it was
computed, or moved in the wrong order, or lost to a failed copy, shows up as wrong bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

import atb_mem
from atb_mem.kv.tensors import MOVE_COPY, MOVE_TO_DEVICE, MOVE_TO_HOST, KVTensors

BLOCK = 4


def kv_value(token: int, position: int) -> np.ndarray:
    return np.array([token, position], dtype=np.float32)


def make_kv(num_blocks: int = 32, num_host_blocks: int | None = 8) -> atb_mem.KVCachePool:
    return atb_mem.KVCachePool(num_blocks, BLOCK, num_layers=1, num_kv_heads=1, head_dim=2,
                               dtype="float32", num_host_blocks=num_host_blocks)


def write_tokens(kv: atb_mem.KVCachePool, slots: Any, tokens: Any, positions: Any) -> None:
    key = np.stack([kv_value(t, p) for t, p in zip(tokens, positions, strict=True)])[:, None]
    kv.write_kv(0, np.asarray(slots), key, -key)


def run_plan(kv: atb_mem.KVCachePool, plan: atb_mem.StepPlan) -> None:
    """What a model runner does with a plan: write every scheduled token's K/V."""
    if plan.num_batched_tokens:
        write_tokens(kv, plan.slot_mapping, plan.input_ids, plan.positions)


def read_back(kv: atb_mem.KVCachePool, seq_id: int, upto: int | None = None) -> list[tuple]:
    """(token, position) pairs stored for the sequence's first ``upto`` positions."""
    blocks = kv.block_table(seq_id)
    tier = kv.host_kv_cache[0, 0] if kv.is_swapped(seq_id) else kv.key_cache(0)
    upto = kv.num_computed(seq_id) if upto is None else upto
    return [tuple(tier[blocks[p // BLOCK], p % BLOCK, 0].tolist()) for p in range(upto)]


def expected(tokens: list[int], upto: int) -> list[tuple]:
    return [(float(t), float(p)) for p, t in enumerate(tokens[:upto])]


def state(kv: atb_mem.KVCachePool) -> tuple:
    """Everything observable about the bookkeeping."""
    seqs = tuple((i, kv.seq_len(i), kv.is_swapped(i), kv.num_computed(i),
                  kv.block_table(i).tolist()) for i in kv.seq_ids())
    stats = kv.stats()
    return seqs, kv.pending_moves().tolist(), stats["blocks_free"], stats["host_blocks_used"]


@contextmanager
def failing_moves(kind: int) -> Iterator[None]:
    """Every run of moves of ``kind`` raises, as a device OOM or driver error would."""
    original = KVTensors._copy_run

    def copy_run(self: KVTensors, run_kind: int, src: np.ndarray, dst: np.ndarray) -> None:
        if run_kind == kind:
            raise RuntimeError("injected copy failure")
        original(self, run_kind, src, dst)

    KVTensors._copy_run = copy_run  # type: ignore[method-assign]
    try:
        yield
    finally:
        KVTensors._copy_run = original  # type: ignore[method-assign]


# ---- 1. only computed blocks are prefix hits ---------------------------------------------------


def test_abort_after_first_chunk_caches_only_the_chunk() -> None:
    kv = make_kv()
    sched = atb_mem.ContinuousBatchScheduler(kv, max_num_batched_tokens=8)
    prompt = list(range(100, 120))  # 5 full blocks
    sched.add_request(1, prompt, 4)
    plan = sched.step(now=0)
    assert plan.prefill_tokens.tolist() == [8]
    run_plan(kv, plan)
    sched.abort(1)  # aborted after its first chunk: blocks 2.. were never written
    sched.add_request(2, prompt, 4)
    plan = sched.step(now=0)
    assert plan.query_lens.tolist() == [8]  # 8 tokens hit, the next 8 are computed now
    assert plan.positions.tolist() == list(range(8, 16))
    run_plan(kv, plan)
    assert read_back(kv, 2) == expected(prompt, 16)
    # Positive control: a prompt fully prefilled is a full hit for the next one.
    run_plan(kv, plan := sched.step(now=0))
    sched.on_tokens(plan.sample_seq_ids, [7])
    sched.add_request(3, prompt, 4)
    plan = sched.step(now=0)
    row = plan.seq_ids.tolist().index(3)
    assert plan.query_lens[row] == 4  # 16 of 20 tokens from the cache; the last block computed


def test_mid_prefill_only_the_chunks_that_ran_are_reusable() -> None:
    kv = make_kv(num_blocks=11, num_host_blocks=None)  # 10 usable blocks
    sched = atb_mem.ContinuousBatchScheduler(kv, max_num_batched_tokens=6, watermark=0.0)
    first = list(range(300, 316))  # 4 blocks
    sched.add_request(1, first, 2)
    run_plan(kv, plan := sched.step(now=0))
    assert plan.query_lens.tolist() == [6]
    # Everything not computed is uncached: a twin of the prompt hits one block only.
    assert kv.can_allocate(first)
    assert kv.alloc_sequence(99, first) == 4
    kv.free_sequence(99)


# ---- 2. output tokens join the prefix cache ------------------------------------------------


def test_output_blocks_serve_the_next_turn() -> None:
    kv = make_kv()
    sched = atb_mem.ContinuousBatchScheduler(kv)
    prompt = list(range(500, 508))  # 2 blocks
    sched.add_request(1, prompt, 9)
    outputs: list[int] = []
    while 1 in sched:
        run_plan(kv, plan := sched.step(now=0))
        sampled = [900 + len(outputs)] * len(plan.sample_seq_ids)
        outputs += sampled
        sched.on_tokens(plan.sample_seq_ids, sampled)
    assert len(outputs) == 9
    # prompt + 8 decode inputs = 16 computed tokens = 4 full blocks (the last sampled token
    # was never an input). The follow-up turn reuses all of them, not just the prompt's 2.
    follow_up = [*prompt, *outputs, 42, 43]
    sched.add_request(2, follow_up, 1)
    plan = sched.step(now=0)
    assert plan.query_lens.tolist() == [len(follow_up) - 16]
    run_plan(kv, plan)
    assert read_back(kv, 2) == expected(follow_up, len(follow_up))


# ---- 3. moves run in the order they were decided -------------------------------------------


def swap_next_to_copy_on_write() -> tuple[atb_mem.KVCachePool, Any, dict[int, list[int]]]:
    """A and B fill the device; A is forked outside the scheduler so its next decode must copy
    its shared last block. No block is free, so B is swapped out, and A's copy lands in the
    block B just left: B's bytes must reach the host before the copy overwrites them."""
    kv = make_kv(num_blocks=5, num_host_blocks=4)  # 4 usable device blocks
    sched = atb_mem.ContinuousBatchScheduler(kv, preemption="swap", watermark=0.0)
    tokens = {1: list(range(10, 16)), 2: list(range(20, 25))}  # 2 blocks each
    sched.add_request(1, tokens[1], 8)
    sched.add_request(2, tokens[2], 8)
    run_plan(kv, plan := sched.step(now=0))
    sched.on_tokens(plan.sample_seq_ids, [11, 21])
    tokens[1].append(11)
    tokens[2].append(21)
    kv.fork(1, 3)  # shares A's partly filled last block
    assert kv.num_free_blocks == 0
    return kv, sched, tokens


def test_swap_out_runs_before_a_copy_into_the_freed_block() -> None:
    kv, sched, tokens = swap_next_to_copy_on_write()
    b_blocks = kv.block_table(2).tolist()
    plan = sched.step(now=0)
    assert plan.preempted_seq_ids.tolist() == [2] and kv.is_swapped(2)
    kinds = plan.moves[:, 0].tolist()
    assert kinds == [MOVE_TO_HOST, MOVE_TO_HOST, MOVE_COPY]
    assert plan.moves[2, 2] in b_blocks  # the copy's destination is a block B left
    assert read_back(kv, 2) == expected(tokens[2], 5)  # B's bytes reached the host intact
    run_plan(kv, plan)
    assert read_back(kv, 1) == expected(tokens[1], 7)
    assert read_back(kv, 3, 6) == expected(tokens[1], 6)  # the fork still has its bytes


# ---- 4 and 7. a failed move loses nothing silently; a failed step changes nothing ----------


def test_failed_swap_out_rolls_back() -> None:
    kv = make_kv()
    kv.alloc_sequence(1, 6)
    write_tokens(kv, kv.slot_mapping([1], [0], [6]), range(6), range(6))
    kv.mark_computed(1)
    before = state(kv)
    with failing_moves(MOVE_TO_HOST), pytest.raises(atb_mem.BlockMoveError) as raised:
        kv.swap_out([1])
    assert raised.value.aborted_seq_ids == []
    assert isinstance(raised.value.__cause__, RuntimeError)
    assert state(kv) == before and not kv.is_swapped(1)
    assert read_back(kv, 1) == expected(list(range(6)), 6)
    kv.swap_out([1])  # works once the device does
    assert read_back(kv, 1) == expected(list(range(6)), 6)
    with failing_moves(MOVE_TO_DEVICE), pytest.raises(atb_mem.BlockMoveError):
        kv.swap_in([1])
    assert kv.is_swapped(1) and read_back(kv, 1) == expected(list(range(6)), 6)
    kv.swap_in([1])
    assert read_back(kv, 1) == expected(list(range(6)), 6)
    kv._check_invariants()


def test_failed_step_changes_nothing() -> None:
    kv, sched, tokens = swap_next_to_copy_on_write()
    before, counts = state(kv), sched.stats()
    with failing_moves(MOVE_TO_HOST), pytest.raises(atb_mem.BlockMoveError) as raised:
        sched.step(now=0)
    # Only the host blocks were written, and they were free before the step: nothing lost.
    assert raised.value.aborted_seq_ids == []
    assert state(kv) == before and sched.stats() == counts
    sched._check_invariants()
    run_plan(kv, plan := sched.step(now=0))  # the same step, now that moves work
    assert plan.preempted_seq_ids.tolist() == [2]
    assert read_back(kv, 2) == expected(tokens[2], 5)
    assert read_back(kv, 1) == expected(tokens[1], 7)


def test_failed_step_ends_exactly_the_requests_whose_bytes_were_lost() -> None:
    kv, sched, tokens = swap_next_to_copy_on_write()
    # The swap-out lands, then the copy into B's old block fails part-way: B's device bytes
    # are gone, and the step is rolled back to before the swap. B alone must end.
    with failing_moves(MOVE_COPY), pytest.raises(atb_mem.BlockMoveError) as raised:
        sched.step(now=0)
    assert raised.value.aborted_seq_ids == [2]
    assert 2 not in sched and 2 not in kv
    sched._check_invariants()
    run_plan(kv, plan := sched.step(now=0))
    assert plan.finished_seq_ids.tolist() == [2]
    assert read_back(kv, 1) == expected(tokens[1], 7)


# ---- 6. writes with copies pending ---------------------------------------------------------


def test_write_kv_applies_pending_copies_first() -> None:
    kv = make_kv()
    kv.alloc_sequence(1, 6)
    write_tokens(kv, kv.slot_mapping([1], [0], [6]), range(6), range(6))
    kv.fork(1, 2)
    (slot,) = kv.append_tokens([2]).tolist()  # copy-on-write of the shared last block
    assert len(kv.pending_moves()) == 1
    write_tokens(kv, [slot], [77], [6])
    assert len(kv.pending_moves()) == 0
    assert read_back(kv, 2, 7) == expected([*range(6), 77], 7)
    assert read_back(kv, 1, 6) == expected(list(range(6)), 6)  # the parent is untouched


def test_a_copy_of_a_copy_runs_in_order() -> None:
    """Two pending copies where the second reads the first's destination: one batched copy
    would read the source before it was written."""
    kv = make_kv()
    kv.alloc_sequence(1, 2)
    write_tokens(kv, kv.slot_mapping([1], [0], [2]), [5, 6], range(2))
    kv.fork(1, 2)
    kv.append_tokens([2])  # copy: 1's block -> 2's new block
    kv.fork(2, 3)
    kv.append_tokens([3])  # copy: 2's new block -> 3's new block, pending behind the first
    moves = kv.pending_moves()
    assert moves[1, 1] == moves[0, 2]
    kv.apply_pending_copies()
    assert read_back(kv, 3, 2) == expected([5, 6], 2)


# ---- the step plan a model runner uses as is -----------------------------------------------


def test_step_plan_carries_the_runner_inputs() -> None:
    kv = make_kv()
    sched = atb_mem.ContinuousBatchScheduler(kv, max_num_batched_tokens=9)
    sched.add_request(1, [1, 2, 3], 2)
    sched.add_request(2, 5, 2)  # a count: ids unknown
    sched.add_request(3, list(range(40, 50)), 2)
    plan = sched.step(now=0)
    assert plan.seq_ids.tolist() == [1, 2, 3]
    assert plan.query_lens.tolist() == [3, 5, 1]  # request 3 gets the budget's last token
    assert plan.query_start_loc.tolist() == [0, 3, 8, 9]
    assert plan.input_ids.tolist() == [1, 2, 3, -1, -1, -1, -1, -1, 40]
    assert plan.positions.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0]
    assert plan.sample_seq_ids.tolist() == [1, 2]
    assert plan.logits_indices.tolist() == [2, 7]
    assert plan.seq_lens.tolist() == [3, 5, 1]
    assert all(a.dtype == np.int32 for a in (plan.input_ids, plan.positions, plan.slot_mapping,
                                             plan.query_start_loc, plan.logits_indices))
    run_plan(kv, plan)
    sched.on_tokens([1, 2], [61, 62])
    sched.abort(2)
    plan = sched.step(now=0)
    assert plan.finished_seq_ids.tolist() == [2]
    assert plan.seq_ids.tolist() == [3, 1]  # the unfinished prefill, then the decode
    assert plan.input_ids[-1] == 61 and plan.positions[-1] == 3


def test_a_batched_copy_never_reads_a_block_its_own_run_writes() -> None:
    from atb_mem.kv.tensors import _run_end

    moves = np.array([[MOVE_COPY, 1, 2], [MOVE_COPY, 2, 3], [MOVE_COPY, 4, 5],
                      [MOVE_TO_HOST, 5, 1], [MOVE_TO_HOST, 6, 1]], dtype=np.int32)
    assert _run_end(moves, 0) == 1  # 2 -> 3 reads what 1 -> 2 writes
    assert _run_end(moves, 1) == 3  # a run ends where the kind changes
    assert _run_end(moves, 3) == 4  # the same destination twice: in order, not batched


def test_an_executor_calling_back_into_its_pool_fails_instead_of_deadlocking() -> None:
    kv = make_kv()
    kv.alloc_sequence(1, 6)
    before = state(kv)
    with pytest.raises(atb_mem.BlockMoveError) as raised:
        kv.swap_out([1], execute=lambda moves: kv.stats())
    assert "re-entrant" in str(raised.value.__cause__)
    assert state(kv) == before  # rolled back, and the lock is free again
    kv.swap_out([1])
    assert kv.is_swapped(1)


def test_same_step_hits_follow_vllms_rule() -> None:
    """Two requests with the same new prompt admitted in one step: the second hits the blocks
    the first computes in that very step. Safe only because the batched forward writes every
    row's K/V (layer by layer) before any attention reads it — which run_plan models by
    writing the whole plan before anything is read back."""
    kv = make_kv()
    sched = atb_mem.ContinuousBatchScheduler(kv)
    prompt = list(range(700, 710))  # 2 full blocks and 2 tokens
    sched.add_request(1, prompt, 2)
    sched.add_request(2, prompt, 2)
    plan = sched.step(now=0)
    assert plan.seq_ids.tolist() == [1, 2] and plan.query_lens.tolist() == [10, 2]
    assert (kv.block_table(2)[:2] == kv.block_table(1)[:2]).all()
    run_plan(kv, plan)
    assert read_back(kv, 2) == expected(prompt, 10)


# ---- the new calls refuse bad input and change nothing ---------------------------------------


@pytest.mark.parametrize("moves", [
    np.zeros((2,), np.int32),                                  # not [k, 3]
    np.zeros((1, 3), np.float32),                              # not integers
    np.array([[MOVE_COPY, 1, 2], [7, 1, 2]], np.int32),        # unknown kind
    np.array([[MOVE_COPY, 1, 2], [MOVE_COPY, 1, 32]], np.int32),  # past the device tier
    np.array([[MOVE_TO_HOST, 1, 9]], np.int32),                # past the host tier
    np.array([[MOVE_TO_DEVICE, -1, 2]], np.int32),             # negative
])
def test_execute_checks_every_move_before_copying_any(moves: np.ndarray) -> None:
    kv = make_kv()  # 32 device blocks, 8 + 1 host blocks
    kv.alloc_sequence(1, 8)
    write_tokens(kv, kv.slot_mapping([1], [0], [8]), range(8), range(8))
    device, host = kv.kv_cache.copy(), kv.host_kv_cache.copy()
    assert kv.tensors is not None
    with pytest.raises(ValueError, match=r"moves|block"):
        kv.tensors.execute(moves)
    assert np.array_equal(kv.kv_cache, device) and np.array_equal(kv.host_kv_cache, host)


def test_mark_computed_and_num_computed_refuse_bad_input() -> None:
    kv = make_kv()
    kv.alloc_sequence(1, list(range(9)))
    before = state(kv)
    for bad, error in [(-1, ValueError), ("3", TypeError), (1.5, TypeError), (10, ValueError)]:
        with pytest.raises(error):
            kv.mark_computed(1, bad)
        assert state(kv) == before
    with pytest.raises(atb_mem.UnknownSequenceError):
        kv.num_computed(2)
    kv.swap_out([1])
    with pytest.raises(ValueError, match="swapped out"):
        kv.mark_computed(1)


def test_a_broken_executor_rolls_back() -> None:
    kv = make_kv()
    kv.alloc_sequence(1, 2)
    kv.fork(1, 2)
    kv.append_tokens([2])
    before = state(kv)
    with pytest.raises(atb_mem.BlockMoveError) as raised:
        kv.execute_pending_moves(42)  # not callable
    assert isinstance(raised.value.__cause__, TypeError)
    assert raised.value.aborted_seq_ids == [] and state(kv) == before

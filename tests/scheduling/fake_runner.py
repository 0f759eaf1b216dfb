"""The model runner's part in the scheduler's tests, with no model: each planned token's K/V
written through ``write_kv`` as a code of the token and its position, and the check that a
sequence's bytes are those of its tokens; plus a byte executor whose moves fail on demand."""

from __future__ import annotations

from typing import Any

import numpy as np

import atb_mem
from atb_mem.kv.tensors import MOVE_TO_HOST, KVTensors, _run_end

GARBAGE = -7777.0  # what a failed move scribbles over its destination


def kv_rows(codes: Any, positions: Any) -> tuple[np.ndarray, np.ndarray]:
    """``[n, 1, 2]`` key and value rows of tokens with these codes at these positions."""
    codes = np.asarray(codes, dtype=np.float32)
    positions = np.asarray(positions, dtype=np.float32)
    key = np.stack([codes, positions], axis=1)[:, None, :]
    value = np.stack([positions, 2 * codes + 1], axis=1)[:, None, :]
    return key, value


def plan_codes(plan: atb_mem.StepPlan) -> np.ndarray:
    """The code of each planned token (``input_ids``, or the row's request for a count)."""
    row_ids = np.repeat(plan.seq_ids.astype(np.int64), plan.query_lens)
    ids = plan.input_ids.astype(np.int64)
    return np.where(ids >= 0, ids, -1 - row_ids)


def execute_plan(kv: atb_mem.KVCachePool, plan: atb_mem.StepPlan) -> None:
    """The runner's forward pass: every planned token's K/V into its slot, via ``write_kv``."""
    if plan.num_batched_tokens:
        key, value = kv_rows(plan_codes(plan), plan.positions)
        kv.write_kv(0, plan.slot_mapping, key, value)


def check_bytes(kv: atb_mem.KVCachePool, seq_id: int, codes: list[int]) -> int:
    """Raises AssertionError unless every computed position of ``seq_id`` holds the K/V of
    ``codes`` (on the tier the sequence lives on). Returns how many positions it checked."""
    computed = kv.num_computed(seq_id)
    assert computed <= len(codes), f"sequence {seq_id}: {computed} computed of {len(codes)}"
    bs = kv.block_size
    blocks = kv.block_table(seq_id).astype(np.int64)
    assert len(blocks) * bs >= computed
    swapped = kv.is_swapped(seq_id)
    if swapped:
        keys, values = kv.host_kv_cache[0, 0], kv.host_kv_cache[0, 1]
    else:
        keys, values = kv.key_cache(0), kv.value_cache(0)
    positions = np.arange(computed)
    got_key = keys[blocks[positions // bs], positions % bs, 0]
    got_value = values[blocks[positions // bs], positions % bs, 0]
    want_key, want_value = kv_rows(codes[:computed], positions)
    bad = np.nonzero((got_key != want_key[:, 0]).any(axis=1)
                     | (got_value != want_value[:, 0]).any(axis=1))[0]
    if len(bad):
        p = int(bad[0])
        tier = "host" if swapped else "device"
        raise AssertionError(
            f"sequence {seq_id} ({tier}): position {p} of {computed} computed, block "
            f"{int(blocks[p // bs])} offset {p % bs}, holds key {got_key[p].tolist()} value "
            f"{got_value[p].tolist()}; expected key {want_key[p, 0].tolist()} value "
            f"{want_value[p, 0].tolist()} ({len(bad)} positions wrong)")
    return computed


def make_kv(num_blocks: int, block_size: int, num_host_blocks: int | None) -> atb_mem.KVCachePool:
    return atb_mem.KVCachePool(num_blocks, block_size, num_layers=1, num_kv_heads=1, head_dim=2,
                               dtype="float32", num_host_blocks=num_host_blocks)


class FlakyTensors(KVTensors):
    """The cache's byte executor, with a failure to inject: the ``fail_at``-th run of moves
    of the next ``execute`` (negative: counted from the last) raises, after scribbling over
    its first destination block when ``scribble``, as a copy that died part-way would."""

    __slots__ = ("fail_at", "last_moves", "runs", "scribble")

    def __init__(self, tensors: KVTensors) -> None:
        super().__init__(tensors.backend, tensors.kv, tensors.host_kv)
        self.fail_at: int | None = None
        self.scribble = False
        self.runs = 0
        self.last_moves = np.zeros((0, 3), dtype=np.int32)

    def execute(self, moves: np.ndarray) -> None:
        self.last_moves = np.array(moves, copy=True)
        self.runs = 0
        if self.fail_at is not None and self.fail_at < 0:  # counted from the last run
            ends = [0]
            while ends[-1] < len(moves):
                ends.append(_run_end(self.last_moves, ends[-1]))
            self.fail_at += len(ends) - 1
        super().execute(moves)

    def _copy_run(self, kind: int, src: np.ndarray, dst: np.ndarray) -> None:
        run, self.runs = self.runs, self.runs + 1
        if run == self.fail_at:
            self.fail_at = None
            if self.scribble:
                tier = self.host_kv if kind == MOVE_TO_HOST else self.kv
                tier[:, :, int(dst[0])] = GARBAGE
            raise RuntimeError("injected move failure")
        super()._copy_run(kind, src, dst)


def flaky(kv: atb_mem.KVCachePool) -> FlakyTensors:
    tensors = kv.tensors
    assert tensors is not None
    flaky_tensors = FlakyTensors(tensors)
    kv._tensors = flaky_tensors  # the executor step() passes is kv.tensors.execute
    assert kv.executor == flaky_tensors.execute
    return flaky_tensors

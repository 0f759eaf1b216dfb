"""Recurrent (``"linear_attention"``) layers' states in pool blocks: taken at admission,
copied on fork, moved by swaps, given back at the end; no prefix hit with states. A call
that fails changes nothing. (Planning and model configs: ``test_state_sizes.py``.)"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import pytest

from atb_mem import KVCachePool, OutOfMemoryError, UnknownSequenceError
from atb_mem._core import kv_cache_groups
from atb_mem._types import MISS_REASONS, StateGroup
from tests.kv.hybrid_states import (
    BLOCK_SIZE,
    COPY,
    DIMS,
    FULL,
    LAYERS,
    LINEAR,
    SLOT_BYTES,
    STATE_BLOCKS,
    STATE_BYTES,
    TO_DEVICE,
    TO_HOST,
    hybrid,
)
from tests.support.unchanged import Snapshot, assert_unchanged, kv_snapshot


def observe(pool: KVCachePool) -> Snapshot:
    """kv_snapshot, plus what only a cache with states shows."""
    snap = kv_snapshot(pool)
    device = [i for i in pool.seq_ids() if not pool.is_swapped(i)]
    snap["states"] = pool.state_table(device).tolist()
    snap["swapped"] = [i for i in pool.seq_ids() if pool.is_swapped(i)]
    snap["moves"] = pool.pending_moves().tolist()
    snap["free_host"] = pool.num_free_host_blocks
    return snap


def row(pool: KVCachePool, seq_id: int) -> list[int]:
    return [int(block) for block in pool.state_table([seq_id])[0]]


# ---- construction ----------------------------------------------------------------------------


def test_states_are_grouped_sized_and_placed() -> None:
    assert SLOT_BYTES == 256 and STATE_BLOCKS == 6  # the figures the tests below rely on
    pool = hybrid()
    assert pool.layers_per_block == 1  # one full layer: groups of one layer
    assert pool.bytes_per_block == SLOT_BYTES
    assert pool.state_groups == [StateGroup((layer,), STATE_BYTES, 2, 2 * layer)
                                 for layer in range(3)]
    assert pool.num_state_blocks == STATE_BLOCKS
    assert [pool.state_of_layer(layer) for layer in range(3)] == [(0, 0), (1, 0), (2, 0)]
    assert pool.group_of_layer(3) == (0, 0)
    assert [g.kind for g in pool.groups] == [FULL]
    # A state of exactly one slot takes one block; one byte more, two.
    assert hybrid(state_bytes=SLOT_BYTES).num_state_blocks == 3
    assert hybrid(state_bytes=SLOT_BYTES + 1).num_state_blocks == 6
    # kv_cache_groups reports the same grouping without a pool.
    groups, per_block, states = kv_cache_groups(4, LAYERS, state_bytes=STATE_BYTES)
    assert (groups, per_block) == ([(FULL, [3], None)], 1)
    assert states == [([layer], STATE_BYTES) for layer in range(3)]
    smallest = hybrid(num_blocks=STATE_BLOCKS + 2)  # 7 usable: the states and one block
    smallest.alloc_sequence(1, BLOCK_SIZE)
    assert smallest.num_free_blocks == 0


def test_layers_share_a_state_group_when_groups_are_larger() -> None:
    """Two recurrent layers to one full layer's two: groups of two, slots 0 and 1."""
    pool = hybrid(num_layers=4, layer_types=[LINEAR, FULL, LINEAR, FULL])
    assert pool.layers_per_block == 2
    assert pool.bytes_per_block == 2 * SLOT_BYTES
    assert pool.state_groups == [StateGroup((0, 2), STATE_BYTES, 2, 0)]
    assert [pool.state_of_layer(layer) for layer in (0, 2)] == [(0, 0), (0, 1)]


def test_state_of_an_attention_or_unknown_layer_is_refused() -> None:
    pool = hybrid()
    pool.alloc_sequence(1, 5)
    for layer, match in ((3, "attention layer"), (4, "not a layer of this model"),
                         (-1, "at least 0")):
        assert_unchanged(lambda: observe(pool), ValueError,
                         partial(pool.state_of_layer, layer), match=match)
    assert_unchanged(lambda: observe(pool), TypeError, partial(pool.state_of_layer, True))


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"layer_types": None}, ValueError, "name them in layer_types"),
    ({"layer_types": [FULL] * 4}, ValueError, "names none"),
    ({"state_bytes": None}, ValueError, "state_bytes .* is required"),
    ({"state_bytes": 0}, ValueError, "at least 1"),
    ({"state_bytes": -5}, ValueError, "at least 1"),
    ({"state_bytes": 1.5}, TypeError, "must be an int"),
    ({"layer_types": [LINEAR] * 4}, ValueError, "every layer is recurrent"),
    # 6 usable blocks: exactly one sequence's states, and no K/V block besides.
    ({"num_blocks": STATE_BLOCKS + 1}, ValueError, "recurrent states take 6 blocks"),
])
def test_bad_state_arguments_are_refused(kwargs: dict[str, Any], error: type[Exception],
                                         match: str) -> None:
    with pytest.raises(error, match=match):
        hybrid(**kwargs)


# ---- a sequence's life -----------------------------------------------------------------------


def test_a_sequence_holds_its_states_from_admission_to_its_end() -> None:
    pool = hybrid()
    free = pool.num_free_blocks
    pool.alloc_sequence(1, list(range(9)))  # 3 K/V blocks
    assert pool.num_free_blocks == free - 3 - STATE_BLOCKS
    pool.alloc_sequence(2, 1)
    assert pool.num_free_blocks == free - 4 - 2 * STATE_BLOCKS
    table = pool.state_table([1, 2])
    assert table.dtype == np.int32 and table.shape == (2, STATE_BLOCKS)
    states = table.ravel().tolist()
    kv = pool.block_table(1).tolist() + pool.block_table(2).tolist()
    assert len(set(states)) == 2 * STATE_BLOCKS  # no block in two states
    assert 0 not in states and not set(states) & set(kv)
    assert np.array_equal(pool.state_table(np.array([2, 1], dtype=np.uint64)), table[::-1])
    # States are fixed: appending tokens takes K/V blocks only.
    before = row(pool, 2)
    pool.append_tokens([2], 2 * BLOCK_SIZE)
    assert row(pool, 2) == before
    assert pool.num_free_blocks == free - 6 - 2 * STATE_BLOCKS
    pool.free_sequence(1)
    pool.free_sequence(2)
    assert pool.num_free_blocks == free
    assert pool.stats()["blocks_used"] == 0
    pool._check_invariants()


def test_admission_counts_the_states_in_its_budget() -> None:
    pool = hybrid(num_blocks=17)  # 16 usable
    assert pool.can_allocate(10 * BLOCK_SIZE)
    # What no pool of this size could hold says so, states counted.
    assert_unchanged(lambda: observe(pool), ValueError,
                     lambda: pool.can_allocate(10 * BLOCK_SIZE + 1), match="6 of them")
    pool.alloc_sequence(1, BLOCK_SIZE)
    assert pool.num_free_blocks == 16 - 1 - STATE_BLOCKS  # 9
    assert pool.can_allocate(3 * BLOCK_SIZE) and not pool.can_allocate(3 * BLOCK_SIZE + 1)
    assert_unchanged(lambda: observe(pool), OutOfMemoryError,
                     lambda: pool.alloc_sequence(2, 3 * BLOCK_SIZE + 1))
    pool.alloc_sequence(2, 3 * BLOCK_SIZE)
    assert pool.num_free_blocks == 0


def test_a_fork_copies_the_parents_state_into_blocks_of_its_own() -> None:
    pool = hybrid()
    pool.alloc_sequence(1, list(range(6)))
    pool.mark_computed(1)
    assert pool.pending_moves().shape == (0, 3)
    free = pool.num_free_blocks
    pool.fork(1, 2)
    assert pool.block_table(2).tolist() == pool.block_table(1).tolist()  # K/V shared
    parent, child = row(pool, 1), row(pool, 2)
    assert pool.num_free_blocks == free - STATE_BLOCKS
    assert not set(parent) & set(child) and len(set(child)) == STATE_BLOCKS
    assert not set(child) & set(pool.block_table(1).tolist())
    assert pool.pending_moves().tolist() == [[COPY, p, c] for p, c in zip(parent, child,
                                                                          strict=True)]
    assert pool.stats()["pending_copies"] == STATE_BLOCKS
    assert pool.take_pending_copies().tolist() == [[p, c] for p, c in zip(parent, child,
                                                                         strict=True)]
    pool.free_sequence(1)
    assert row(pool, 2) == child  # the child's state outlives its parent
    pool.free_sequence(2)
    assert pool.num_free_blocks == free + 2 + STATE_BLOCKS
    pool._check_invariants()


def test_fork_and_swap_carry_the_state_bytes() -> None:
    pool = hybrid(device="host", num_host_blocks=32)
    pool.alloc_sequence(1, 5)
    kv = pool.kv_cache
    for column, block in enumerate(row(pool, 1)):
        kv[:, :, block] = column + 1
    pool.fork(1, 2)
    assert pool.apply_pending_copies() == STATE_BLOCKS
    child = row(pool, 2)
    for column, block in enumerate(child):
        assert np.all(kv[:, :, block] == column + 1)
    kv[:, :, child[0]] = -1  # the child's state is its own
    assert np.all(kv[:, :, row(pool, 1)[0]] == 1)
    pool.swap_out([2])
    pool.alloc_sequence(3, 6)  # takes (some of) the blocks the child's state left
    kv[:, :, row(pool, 3)] = -7
    pool.swap_in([2])
    assert [float(kv[:, :, block].mean()) for block in row(pool, 2)] == [-1, 2, 3, 4, 5, 6]


def test_a_fork_without_blocks_for_the_state_changes_nothing() -> None:
    # 14 usable: the parent takes 3 + 6, leaving 5 of a state's 6.
    pool = hybrid(num_blocks=15)
    pool.alloc_sequence(1, 3 * BLOCK_SIZE)
    assert pool.num_free_blocks == STATE_BLOCKS - 1
    error = assert_unchanged(lambda: observe(pool), OutOfMemoryError, lambda: pool.fork(1, 2))
    assert "6" in str(error) and "5" in str(error), error
    pool._check_invariants()
    fits = hybrid(num_blocks=16)  # one block more: it fits exactly
    fits.alloc_sequence(1, 3 * BLOCK_SIZE)
    fits.fork(1, 2)
    assert fits.num_free_blocks == 0


def test_a_swap_moves_the_state_with_the_sequence() -> None:
    pool = hybrid(num_host_blocks=32)
    pool.alloc_sequence(1, 6)  # 2 K/V blocks
    pool.alloc_sequence(2, 1)
    state, kv = row(pool, 1), pool.block_table(1).tolist()
    free = pool.num_free_blocks
    out = pool.swap_out([1])
    assert sorted(out[:, 0].tolist()) == sorted(state + kv)
    hosts = dict(out.tolist())  # device block -> host block
    assert pool.pending_moves().tolist() == [[TO_HOST, d, h] for d, h in out.tolist()]
    assert pool.num_free_blocks == free + 2 + STATE_BLOCKS
    assert pool.num_free_host_blocks == 32 - 2 - STATE_BLOCKS
    assert pool.is_swapped(1) and set(pool.block_table(1).tolist()) <= set(hosts.values())
    # On the host: no kernel reads it, so it has no state-table row.
    assert_unchanged(lambda: observe(pool), ValueError, lambda: pool.state_table([1]),
                     match="swapped out")
    assert_unchanged(lambda: observe(pool), ValueError, lambda: pool.state_table([2, 1]),
                     match="swapped out")
    pool.take_pending_copies()
    back = pool.swap_in([1])
    assert pool.pending_moves().tolist() == [[TO_DEVICE, h, d] for h, d in back.tolist()]
    devices = dict(back.tolist())  # host block -> device block
    assert row(pool, 1) == [devices[hosts[block]] for block in state]  # column by column
    assert pool.block_table(1).tolist() == [devices[hosts[block]] for block in kv]
    assert pool.num_free_blocks == free and pool.num_free_host_blocks == 32
    assert not set(row(pool, 1)) & set(row(pool, 2))
    pool._check_invariants()
    # Freed while swapped out, its host blocks go back too.
    pool.take_pending_copies()
    pool.swap_out([1])
    pool.free_sequence(1)
    assert pool.num_free_host_blocks == 32
    assert pool.num_free_blocks == free + 2 + STATE_BLOCKS
    pool._check_invariants()


def test_state_table_refuses_what_it_cannot_read() -> None:
    pool = hybrid()
    pool.alloc_sequence(1, 5)
    empty = pool.state_table([])
    assert empty.shape == (0, STATE_BLOCKS) and empty.dtype == np.int32
    assert pool.state_table(np.array([], dtype=np.int64)).shape == (0, STATE_BLOCKS)
    for ids in ([99], [1, 99]):
        assert_unchanged(lambda: observe(pool), UnknownSequenceError,
                         partial(pool.state_table, ids), match="99")
    bad_ids: list[Any] = [[-1], ["a"], [1.5], np.array([1.0]), 5, [2**64]]
    for bad in bad_ids:
        assert_unchanged(lambda: observe(pool), TypeError, partial(pool.state_table, bad))
    # Without recurrent layers every row is empty.
    plain = KVCachePool(16, BLOCK_SIZE, **DIMS, device=None)
    plain.alloc_sequence(1, 5)
    assert plain.num_state_blocks == 0 and plain.state_groups == []
    assert plain.state_table([1]).shape == (1, 0)
    with pytest.raises(ValueError, match="attention layer"):
        plain.state_of_layer(0)


# ---- prefix caching --------------------------------------------------------------------------


def test_a_hit_resumes_from_the_last_checkpoint_of_the_states() -> None:
    """The K/V of 12 tokens is cached, the states only at 8: the hit is 8 tokens, and its
    states are copies of the checkpoint's blocks into the new sequence's own."""
    prompt, longer = list(range(13)), list(range(19))
    # By default a checkpoint per as many K/V blocks as it takes (one group here).
    assert hybrid().state_checkpoint_interval == STATE_BLOCKS
    pool = hybrid(state_checkpoint_interval=1)
    assert (pool.state_checkpoint_interval, pool.checkpoint_stride) == (1, BLOCK_SIZE)
    pool.alloc_sequence(1, prompt)
    assert not pool.checkpoint_state(1)  # nothing computed yet
    assert pool.mark_computed(1, 8) == 2
    assert pool.checkpoint_state(1)
    saves = pool.pending_moves()
    checkpoint = saves[:, 2].tolist()
    assert saves[:, 0].tolist() == [COPY] * STATE_BLOCKS
    assert saves[:, 1].tolist() == row(pool, 1)
    pool.take_pending_copies()
    assert pool.mark_computed(1, 13) == 1  # the K/V blocks join the cache as ever
    pool.free_sequence(1)
    why = pool.explain_prefix(longer)
    assert (why.hit_tokens, why.reason, why.limited_by) == (8, "state_checkpoint", None)
    assert [(g.cached_tokens, g.reason) for g in why.groups] == [(12, "not_cached")]
    assert pool.alloc_sequence(2, longer) == 8
    resumes = pool.pending_moves()
    assert resumes[:, 1].tolist() == checkpoint and resumes[:, 2].tolist() == row(pool, 2)
    stats = pool.stats()
    assert stats["prefix_cache_misses_state_checkpoint"] == 1
    assert (stats["prefix_cache_hit_tokens"], stats["state_checkpoints_saved"]) == (8, 1)
    assert "state_checkpoint" in MISS_REASONS
    # No checkpoint within the K/V's reach: no hit, and the reason says why.
    other = hybrid()
    other.alloc_sequence(1, prompt)
    other.mark_computed(1)
    other.free_sequence(1)
    why = other.explain_prefix(prompt)
    assert (why.hit_tokens, why.reason) == (0, "state_checkpoint")
    assert other.alloc_sequence(2, prompt) == 0
    off = hybrid(enable_prefix_caching=False)
    assert off.explain_prefix(prompt).reason == "prefix_caching_off"  # off says so first
    assert off.checkpoint_stride == 0


def test_checkpoint_arguments_are_checked_and_a_failed_call_changes_nothing() -> None:
    with pytest.raises(ValueError, match="state_checkpoint_interval"):
        hybrid(state_checkpoint_interval=0)
    with pytest.raises(ValueError, match="state_checkpoint_interval"):
        hybrid(state_checkpoint_interval=41)
    pool = hybrid(state_checkpoint_interval=2)
    assert pool.checkpoint_stride == 2 * BLOCK_SIZE
    pool.alloc_sequence(1, list(range(13)))
    pool.mark_computed(1, 4)
    assert not pool.checkpoint_state(1)  # not on the stride
    for bad, error in [(99, UnknownSequenceError), (-1, TypeError), ("1", TypeError)]:
        assert_unchanged(partial(observe, pool), error, partial(pool.checkpoint_state, bad))


# ---- sizing ----------------------------------------------------------------------------------

"""Every bad input gets a clear error and leaves the pool exactly as it was."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import atb_mem
from tests.support.unchanged import assert_unchanged, kv_snapshot


@pytest.fixture
def busy_pool() -> atb_mem.KVCachePool:
    """A pool with live, shared, cached and partly filled blocks, and a pending copy."""
    kv = atb_mem.KVCachePool(num_blocks=17, block_size=4)
    kv.alloc_sequence(1, list(range(10)))
    kv.alloc_sequence(2, 5)
    kv.fork(2, 3)
    kv.alloc_sequence(4, list(range(100, 109)))
    kv.mark_computed(4)
    kv.free_sequence(4)  # two cached blocks
    kv.alloc_sequence(5, 3)
    kv.fork(5, 6)
    kv.append_tokens([6])  # a pending copy-on-write pair
    return kv


def expect_unchanged(
    kv: atb_mem.KVCachePool, call: Callable[[], Any], error: type[BaseException], match: str
) -> None:
    assert_unchanged(lambda: kv_snapshot(kv), error, call, match=match)
    kv._check_invariants()


CASES: list[tuple[str, Callable[[atb_mem.KVCachePool], Any], type[BaseException], str]] = [
    # unknown or duplicate ids
    ("free unknown", lambda kv: kv.free_sequence(99), atb_mem.UnknownSequenceError, "99"),
    ("seq_len unknown", lambda kv: kv.seq_len(99), KeyError, "unknown sequence id 99"),
    ("alloc duplicate", lambda kv: kv.alloc_sequence(1, 3), atb_mem.DuplicateSequenceError,
     "already exists"),
    ("fork onto existing", lambda kv: kv.fork(1, 2), atb_mem.DuplicateSequenceError, "2"),
    ("fork onto itself", lambda kv: kv.fork(1, 1), atb_mem.DuplicateSequenceError, "1"),
    ("fork unknown parent", lambda kv: kv.fork(99, 100), atb_mem.UnknownSequenceError, "99"),
    ("append unknown", lambda kv: kv.append_tokens([1, 99]), atb_mem.UnknownSequenceError,
     "99"),
    ("tables unknown", lambda kv: kv.block_tables([1, 99]), atb_mem.UnknownSequenceError, "99"),
    ("lens unknown", lambda kv: kv.context_lens([99]), atb_mem.UnknownSequenceError, "99"),
    ("csr unknown", lambda kv: kv.page_table_csr([99]), atb_mem.UnknownSequenceError, "99"),
    # seq ids that are not ints in [0, 2**63)
    ("negative id", lambda kv: kv.alloc_sequence(-1, 3), TypeError, r"\[0, 2\*\*63\)"),
    ("huge id", lambda kv: kv.alloc_sequence(2**63, 3), TypeError, "seq_id"),
    ("float id", lambda kv: kv.alloc_sequence(1.0, 3), TypeError, "seq_id"),
    ("str id", lambda kv: kv.free_sequence("1"), TypeError, "seq_id"),
    ("bool id", lambda kv: kv.alloc_sequence(True, 3), TypeError, "seq_id"),
    ("None id", lambda kv: kv.seq_len(None), TypeError, "seq_id"),
    ("float ids array", lambda kv: kv.append_tokens(np.array([1.0])), TypeError, "integers"),
    ("negative ids array", lambda kv: kv.append_tokens(np.array([-1])), TypeError, "seq_ids"),
    ("2-D ids array", lambda kv: kv.append_tokens(np.array([[1]])), ValueError, "1-D"),
    ("ids not a list", lambda kv: kv.append_tokens(1), TypeError, "seq_ids"),
    # token counts
    ("zero tokens", lambda kv: kv.alloc_sequence(9, 0), ValueError, "at least 1"),
    ("negative tokens", lambda kv: kv.alloc_sequence(9, -4), ValueError, "at least 1"),
    ("too many tokens", lambda kv: kv.alloc_sequence(9, 16 * 4 + 1), ValueError,
     "can never fit"),
    ("empty token list", lambda kv: kv.alloc_sequence(9, []), ValueError, "at least 1"),
    ("float tokens", lambda kv: kv.alloc_sequence(9, 3.0), TypeError, "tokens"),
    ("str tokens", lambda kv: kv.alloc_sequence(9, "abc"), TypeError, "tokens"),
    ("zero n", lambda kv: kv.append_tokens([1], n=0), ValueError,
     r"at least 1, got 0\nwhile processing 'n'"),  # the argument's name is PyO3's note
    ("float n", lambda kv: kv.append_tokens([1], n=1.5), TypeError,
     r"must be an int, got 1.5\nwhile processing 'n'"),
    ("append past the pool", lambda kv: kv.append_tokens([1], n=16 * 4), ValueError,
     "at most"),
    # token ids that are not integers or do not fit
    ("float token ids", lambda kv: kv.alloc_sequence(9, [1, 2.5]), TypeError, "ints"),
    ("negative token id", lambda kv: kv.alloc_sequence(9, [1, -2]), ValueError, r"2\*\*32"),
    ("huge token id", lambda kv: kv.alloc_sequence(9, [2**32]), ValueError, r"2\*\*32"),
    ("token id beyond int64", lambda kv: kv.alloc_sequence(9, [2**70]), ValueError, "2"),
    ("float token array", lambda kv: kv.alloc_sequence(9, np.ones(3)), TypeError, "integers"),
    ("negative int32 tokens", lambda kv: kv.alloc_sequence(9, np.array([-1], np.int32)),
     ValueError, r"2\*\*32"),
    ("big uint64 tokens", lambda kv: kv.alloc_sequence(9, np.array([2**40], np.uint64)),
     ValueError, r"2\*\*32"),
    ("2-D token array", lambda kv: kv.alloc_sequence(9, np.ones((2, 2), np.int32)), ValueError,
     "1-D"),
    ("bool token array", lambda kv: kv.alloc_sequence(9, np.ones(3, bool)), TypeError,
     "integers"),
    ("token_ids wrong count", lambda kv: kv.append_tokens([1, 2], token_ids=[1]), ValueError,
     "token_ids"),
    ("token_ids wrong shape", lambda kv: kv.append_tokens([1, 2], n=2,
                                                          token_ids=np.ones((2, 3), np.int32)),
     ValueError, "shape"),
    ("salt wrong type", lambda kv: kv.alloc_sequence(9, [1], cache_salt=3), TypeError,
     "cache_salt"),
    # batches
    ("sequence twice in a batch", lambda kv: kv.append_tokens([1, 2, 1]), ValueError, "twice"),
    ("out of blocks mid-batch", lambda kv: kv.append_tokens([1, 2, 3, 5, 6], n=9),
     atb_mem.OutOfMemoryError, "out of KV-cache blocks"),
    ("out of blocks on alloc", lambda kv: kv.alloc_sequence(9, 13 * 4),
     atb_mem.OutOfMemoryError, "needs"),
    ("slot range past the end", lambda kv: kv.slot_mapping([1], [0], [11]), ValueError,
     "not within"),
    ("slot range reversed", lambda kv: kv.slot_mapping([1], [3], [2]), ValueError,
     "not within"),
    ("slot range negative", lambda kv: kv.slot_mapping([1], [-1], [2]), ValueError,
     "not within"),
    ("slot lengths differ", lambda kv: kv.slot_mapping([1, 2], [0], [1, 1]), ValueError,
     "same length"),
    ("slot starts floats", lambda kv: kv.slot_mapping([1], [0.0], [1]), TypeError, "starts"),
    ("batch table zero rows", lambda kv: kv.batch_table(0, 4), ValueError, "max_seqs"),
]


@pytest.mark.parametrize(("call", "error", "match"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_input_is_rejected_and_changes_nothing(
    busy_pool: atb_mem.KVCachePool, call: Callable[[atb_mem.KVCachePool], Any],
    error: type[BaseException], match: str,
) -> None:
    expect_unchanged(busy_pool, lambda: call(busy_pool), error, match)


def test_errors_form_one_hierarchy() -> None:
    for name, builtin in [("OutOfMemoryError", MemoryError), ("UnknownSequenceError", KeyError),
                          ("DuplicateSequenceError", ValueError),
                          ("InvalidHandleError", ValueError), ("QueueFullError", RuntimeError),
                          ("RequestTimeoutError", TimeoutError),
                          ("RequestRefusedError", ValueError)]:
        error = getattr(atb_mem, name)
        assert issubclass(error, atb_mem.AtbMemError) and issubclass(error, builtin)
        assert error.__module__ == "atb_mem"
    assert str(atb_mem.UnknownSequenceError("x")) == "x"  # not KeyError's quoted repr


def test_out_of_blocks_counts_evictable_blocks_and_hits(busy_pool: atb_mem.KVCachePool) -> None:
    free = busy_pool.num_free_blocks
    assert busy_pool.can_allocate(free * 4)
    assert not busy_pool.can_allocate(free * 4 + 1)
    # Free blocks are taken before cached ones: this leaves exactly the two cached blocks.
    busy_pool.alloc_sequence(7, (free - 2) * 4)
    assert busy_pool.num_free_blocks == 2 and busy_pool.stats()["blocks_cached"] == 2
    # The prompt's two cached blocks are hits, but taking them out of the free queue leaves
    # nothing for its third block.
    prompt = list(range(100, 109))
    assert not busy_pool.can_allocate(prompt)
    expect_unchanged(busy_pool, lambda: busy_pool.alloc_sequence(8, prompt),
                     atb_mem.OutOfMemoryError, "needs 3 more block")
    busy_pool.free_sequence(7)
    busy_pool.alloc_sequence(7, (free - 3) * 4)
    assert busy_pool.can_allocate(prompt)
    assert busy_pool.alloc_sequence(8, prompt) == 8
    assert busy_pool.num_free_blocks == 0


def test_batch_table_errors_change_nothing(busy_pool: atb_mem.KVCachePool) -> None:
    batch = busy_pool.batch_table(2, 3)
    batch.add(1)

    def observe() -> dict[str, Any]:
        return kv_snapshot(busy_pool, batch)

    for call, error, match in [
        (lambda: batch.add(1), ValueError, "already in the batch table"),
        (lambda: batch.add(99), atb_mem.UnknownSequenceError, "99"),
        (lambda: batch.remove(2), ValueError, "not in the batch table"),
        (lambda: batch.append_tokens(token_ids=[1, 2]), ValueError, "rows"),
        (lambda: batch.append_tokens(token_ids=[-1]), ValueError, r"2\*\*32"),
        (lambda: batch.add("x"), TypeError, "seq_id"),
    ]:
        assert_unchanged(observe, error, call, match=match)
    batch.add(2)
    with pytest.raises(ValueError, match="batch table is full"):
        batch.add(3)
    # Row 0 holds 10 tokens in 3 blocks; two more steps need a 4th block: the table is too narrow.
    batch.append_tokens()
    batch.append_tokens()
    assert_unchanged(observe, ValueError, batch.append_tokens, match="holds 3 per row")
    # A freed sequence still in the table fails the whole step, changing nothing.
    batch.remove(1)
    batch.add(3)
    busy_pool.free_sequence(3)
    assert_unchanged(observe, atb_mem.UnknownSequenceError, batch.append_tokens, match="3")


def test_bad_constructor_arguments() -> None:
    for kwargs, error, match in [
        ({"num_blocks": 1, "block_size": 16}, ValueError, "num_blocks"),
        ({"num_blocks": 16, "block_size": 0}, ValueError, "block_size"),
        ({"num_blocks": 2**24, "block_size": 256}, ValueError, "2\\*\\*31"),
        ({"num_blocks": 2**28, "block_size": 1}, ValueError, "more than one pool manages"),
        ({"num_blocks": 16.0, "block_size": 16}, TypeError, "num_blocks"),
        ({"num_blocks": 16, "block_size": 16, "dtype": "float8"}, ValueError, "dtype"),
        ({"num_blocks": 16, "block_size": 16, "head_dim": 0}, ValueError, "head_dim"),
        ({"num_blocks": 16, "block_size": 16, "num_layers": -1}, ValueError, "num_layers"),
    ]:
        with pytest.raises(error, match=match):
            atb_mem.KVCachePool(**kwargs)


def test_non_ascii_and_huge_arguments_raise_cleanly() -> None:
    kv = atb_mem.KVCachePool(16, 4)
    with pytest.raises(TypeError, match="seq_id"):
        kv.seq_len("é" * 40)
    with pytest.raises(ValueError, match="out of range"):
        kv.check_slots(np.array([2**64 - 1], np.uint64))
    with pytest.raises(ValueError, match="more than one pool manages"):
        atb_mem.KVCachePool(2**31, 1, device=None)
    with pytest.raises(ValueError, match="max_allocations"):
        atb_mem.MemPool(1 << 20, max_allocations=2**31 - 1)
    with pytest.raises(ValueError, match="too large"):
        kv.batch_table(2**16, 2**16)

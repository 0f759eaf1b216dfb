"""A call that raises leaves the pool exactly as it was: snapshots of everything a caller can
observe about a pool, and the check that a failing call changes none of it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import atb_mem

Snapshot = dict[str, Any]
# What a failed call may legitimately change, given (before, after, the exception): it undoes
# that change in ``after`` once it has checked it.
Allowance = Callable[[Snapshot, Snapshot, BaseException], None]


def kv_snapshot(pool: atb_mem.KVCachePool, table: atb_mem.BatchTable | None = None) -> Snapshot:
    """Everything observable about a KV cache (and a batch table of it)."""
    ids = pool.seq_ids()
    snap: Snapshot = {
        "stats": pool.stats(),
        "num_free_blocks": pool.num_free_blocks,
        "len": len(pool),
        "seq_ids": ids,
        "seqs": {i: (pool.seq_len(i), pool.block_table(i).tolist()) for i in ids},
    }
    if table is not None:
        snap["table"] = (
            table.seq_ids,
            table.block_tables.tolist(),
            table.context_lens.tolist(),
            table.slot_mapping.tolist(),
        )
    return snap


def mem_pool_snapshot(pool: atb_mem.MemPool) -> Snapshot:
    """Everything observable about a MemPool's bookkeeping (its bytes are the caller's)."""
    return {
        "stats": pool.stats(),
        "snapshot": pool.snapshot(),
        "free_ranges": pool.free_ranges(),
        "len": len(pool),
    }


def failed_malloc_counted(before: Snapshot, after: Snapshot, error: BaseException) -> None:
    """A MemPool counts every malloc that ran out of memory (``num_ooms``), by design: the one
    change a failed call may make."""
    if isinstance(error, atb_mem.OutOfMemoryError):
        assert after["stats"]["num_ooms"] == before["stats"]["num_ooms"] + 1
        after["stats"]["num_ooms"] -= 1


def assert_unchanged(observe: Callable[[], Snapshot], error: type[BaseException],
                     call: Callable[[], object], *, match: str | None = None,
                     before: Snapshot | None = None,
                     allow: Allowance | None = None) -> BaseException:
    """``call()`` raises ``error`` (with a message matching ``match``), and ``observe()``
    after it equals ``before`` (by default, ``observe()`` before it). Returns the exception."""
    before = observe() if before is None else before
    with pytest.raises(error, match=match) as raised:
        call()
    after = observe()
    if allow is not None:
        allow(before, after, raised.value)
    assert after == before
    return raised.value

"""The model the KV-cache state machine checks ``KVCachePool`` and ``BatchTable`` against.

The model simulates the KV memory itself: a dict slot -> value. Allocation writes each new
sequence's values into its slots (positions served from the prefix cache must already hold the
right values: that is what checks prefix caching serves correct content), appends first execute
the pending copy-on-write copies and then write the new values, forks write nothing. After every
step, reading every live sequence back through ``slot_mapping`` must give exactly its values.

Values name their origin: ``("t", salt, token_id)`` for tokens given by id (so a prefix hit
across cache salts reads back a value of the wrong salt) and ``("u", k)``, unique, for tokens
given by count.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import invariant

import atb_mem
from tests.support.state_machine import PoolMachine
from tests.support.unchanged import Snapshot, kv_snapshot

Value = tuple[Any, ...]
Salt = str | bytes | None

VOCAB = st.integers(0, 2)
SALTS: list[Salt] = [None, None, b"tenant-a", "tenant-a", "tenant-b"]  # "x" and b"x" are one salt
PROMPTS: list[tuple[int, ...]] = [(0,) * 24, (0, 1, 2) * 8, (1, 1, 2, 0) * 6, (2, 0) * 12]
MAX_LIVE = 10
MISSING = ("missing",)


def norm_salt(salt: Salt) -> bytes | None:
    return salt.encode() if isinstance(salt, str) else salt


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheModel(PoolMachine):
    """The model's state, its helpers, and the invariants checked after every step; the rules
    that drive it are in ``KVCacheMachine``."""

    def __init__(self) -> None:
        super().__init__()
        self.pool: atb_mem.KVCachePool | None = None
        self.table: atb_mem.BatchTable | None = None
        self.mem: dict[int, Value] = {}
        self.values: dict[int, list[Value]] = {}  # live sequence -> the value of each token
        self.salts: dict[int, bytes | None] = {}
        self.freed_ids: list[int] = []
        self.prompts: list[tuple[tuple[int, ...], Salt]] = []  # recent token-id requests
        self.rows: list[int] = []  # batch-table rows (ids; a freed id leaves a dangling row)
        self.unique = itertools.count()
        self.next_id = itertools.count()
        self.queries = self.hits = 0

    # ----------------------------------------------------------------- helpers

    @property
    def bs(self) -> int:
        assert self.pool is not None
        return self.pool.block_size

    @property
    def max_tokens(self) -> int:
        assert self.pool is not None
        return (self.pool.num_blocks - 1) * self.pool.block_size

    def fresh_value(self) -> Value:
        return ("u", next(self.unique))

    def new_id(self, data: st.DataObject) -> int:
        kind = data.draw(st.sampled_from(["small", "huge", "reuse"]), label="id kind")
        if kind == "reuse" and self.freed_ids:
            seq_id = data.draw(st.sampled_from(self.freed_ids), label="reused id")
            if seq_id not in self.values:
                return seq_id
        k = next(self.next_id)
        return k if kind == "small" else 2**63 - 1 - k

    def unknown_id(self, data: st.DataObject) -> int:
        candidates = [i for i in self.freed_ids if i not in self.values]
        candidates += [i for i in (10**12, 2**62 + 7) if i not in self.values]
        seq_id = data.draw(st.sampled_from(candidates), label="unknown id")
        assert seq_id not in self.values
        return seq_id

    def live(self, data: st.DataObject, label: str = "seq") -> int:
        return data.draw(st.sampled_from(sorted(self.values)), label=label)

    def refcounts(self) -> Counter[int]:
        assert self.pool is not None
        counts: Counter[int] = Counter()
        for seq_id in self.values:
            counts.update(self.pool.block_table(seq_id).tolist())
        return counts

    def apply_copies(self) -> np.ndarray:
        """Executes the pending copy-on-write copies on the model memory."""
        assert self.pool is not None
        copies = self.pool.take_pending_copies()
        assert copies.dtype == np.int32 and copies.ndim == 2 and copies.shape[1] == 2
        for src, dst in copies.tolist():
            assert src != dst and atb_mem.NULL_BLOCK not in (src, dst)
            for offset in range(self.bs):
                value = self.mem.get(src * self.bs + offset)
                if value is None:
                    self.mem.pop(dst * self.bs + offset, None)
                else:
                    self.mem[dst * self.bs + offset] = value
        assert self.pool.take_pending_copies().shape == (0, 2)
        if len(copies):
            event("copy-on-write")
        return copies

    def append_need(self, seq_ids: list[int], n: int) -> int:
        """New blocks a batch append takes.

        A shared, partly filled last block named k times in a batch by holders of its
        ``refs`` references is copied min(k, refs - 1) times: once the other holders copied
        it, the last one writes in place.
        """
        assert self.pool is not None
        refs = self.refcounts()
        need = 0
        cow: Counter[int] = Counter()
        for seq_id in seq_ids:
            length = len(self.values[seq_id])
            blocks = self.pool.block_table(seq_id).tolist()
            need += cdiv(length + n, self.bs) - len(blocks)
            if length % self.bs and refs[blocks[-1]] > 1:
                cow[blocks[-1]] += 1
        if cow:
            event("batch names a shared partly filled block")
        return need + sum(min(k, refs[block] - 1) for block, k in cow.items())

    def observe(self) -> Snapshot:
        assert self.pool is not None
        return kv_snapshot(self.pool, self.table)

    def check_table_row(self, row: int, seq_id: int) -> None:
        assert self.pool is not None and self.table is not None
        blocks = self.pool.block_table(seq_id).tolist()
        width = self.table.max_blocks_per_seq
        assert self.table.block_tables[row].tolist() == blocks + [atb_mem.NULL_BLOCK] * (
            width - len(blocks)
        )
        assert self.table.context_lens[row] == self.pool.seq_len(seq_id)
        assert self.table.block_tables[row].tolist()[: len(blocks)] == (
            self.pool.block_tables([seq_id])[0].tolist()
        )
        assert self.table.context_lens[row] == self.pool.context_lens([seq_id])[0]

    def write_alloc(self, seq_id: int, values: list[Value], cached: int) -> None:
        """Checks the positions served from the cache, then 'prefills' the rest."""
        assert self.pool is not None
        slots = self.pool.slot_mapping([seq_id], [0], [len(values)]).tolist()
        for position, slot in enumerate(slots):
            if position < cached:
                got, want = self.mem.get(slot, MISSING), values[position]
                cross_salt = got[0] == "t" and got[2] == want[2] and got[1] != want[1]
                assert got == want, (
                    f"prefix hit served wrong content at position {position} (slot {slot}): "
                    f"holds {got}, expected {want}"
                    + (" - a hit across cache salts" if cross_salt else "")
                )
            else:
                self.mem[slot] = values[position]
        self.values[seq_id] = list(values)

    def table_remove_row(self, seq_id: int) -> None:
        assert self.table is not None
        self.table.remove(seq_id)
        row = self.rows.index(seq_id)
        last = self.rows.pop()
        if row < len(self.rows):
            self.rows[row] = last
        assert self.table.seq_ids == self.rows

    # ----------------------------------------------------------- invariants

    @invariant()
    def consistent(self) -> None:
        pool = self.pool
        if pool is None:
            return
        bs = pool.block_size
        ids = sorted(self.values)
        lens = [len(self.values[i]) for i in ids]
        assert pool.seq_ids() == ids
        assert len(pool) == len(ids)
        for seq_id, length in zip(ids, lens, strict=True):
            assert seq_id in pool and pool.seq_len(seq_id) == length

        # Reading every live sequence back from the simulated memory.
        slots = pool.slot_mapping(ids, [0] * len(ids), lens)
        assert slots.dtype == np.int32 and len(slots) == sum(lens)
        slots_of = np.split(slots, np.cumsum(lens)[:-1]) if ids else []
        tables = [pool.block_table(i).tolist() for i in ids]
        for seq_id, seq_slots, blocks in zip(ids, slots_of, tables, strict=True):
            expected = [blocks[p // bs] * bs + p % bs for p in range(len(self.values[seq_id]))]
            assert seq_slots.tolist() == expected
            got = [self.mem.get(s, MISSING) for s in expected]
            assert got == self.values[seq_id], f"sequence {seq_id} reads back wrong values"

        # block_tables / context_lens / page_table_csr agree.
        bt = pool.block_tables(ids)
        cl = pool.context_lens(ids)
        indptr, indices, last_page_len = pool.page_table_csr(ids)
        for array in (bt, cl, indptr, indices, last_page_len):
            assert array.dtype == np.int32
        width = max((len(b) for b in tables), default=0)
        assert bt.shape == (len(ids), width)
        assert cl.tolist() == lens
        assert indptr.tolist() == [0, *np.cumsum([len(b) for b in tables]).tolist()]
        assert indices.tolist() == [b for blocks in tables for b in blocks]
        for row, (blocks, length) in enumerate(zip(tables, lens, strict=True)):
            assert len(blocks) == cdiv(length, bs)
            assert atb_mem.NULL_BLOCK not in blocks
            assert bt[row].tolist() == blocks + [atb_mem.NULL_BLOCK] * (width - len(blocks))
            assert 1 <= last_page_len[row] <= bs
            assert last_page_len[row] == length - (len(blocks) - 1) * bs

        # A block held by several sequences sits at the same position in each, and a shared
        # partly filled block only between sequences of the same length (forks).
        where: dict[int, set[tuple[int, int]]] = {}
        for blocks, length in zip(tables, lens, strict=True):
            for j, block in enumerate(blocks):
                full = (j + 1) * bs <= length
                where.setdefault(block, set()).add((j, length if not full else -1))
        for block, places in where.items():
            assert len(places) == 1, f"block {block} shared inconsistently: {places}"

        # stats
        stats = pool.stats()
        used = len(where)
        assert stats["blocks_used"] == used
        assert stats["blocks_used"] + stats["blocks_free"] + stats["blocks_cached"] == (
            pool.num_blocks - 1
        )
        assert pool.num_free_blocks == stats["blocks_free"] + stats["blocks_cached"]
        assert stats["num_sequences"] == len(ids)
        assert stats["num_tokens"] == sum(lens)
        assert stats["pending_copies"] == 0
        assert stats["allocated_slots"] == used * bs
        partial = {(b[-1], n % bs) for b, n in zip(tables, lens, strict=True) if n % bs}
        unused = sum(bs - fill for _, fill in partial)
        assert stats["used_slots"] == used * bs - unused
        assert 0 <= stats["fragmentation"] < 1
        assert stats["fragmentation"] == pytest.approx(unused / (used * bs) if used else 0.0)
        if not pool.enable_prefix_caching:
            assert stats["blocks_cached"] == 0
        assert stats["prefix_cache_queries"] == self.queries
        assert stats["prefix_cache_hits"] == self.hits
        assert stats["prefix_cache_query_tokens"] == self.queries * bs
        assert stats["prefix_cache_hit_tokens"] == self.hits * bs
        if stats["evictions"]:
            event("evictions happened")

    @invariant()
    def table_consistent(self) -> None:
        table = self.table
        if table is None:
            return
        assert table.seq_ids == self.rows and len(table) == len(self.rows)
        rows = len(self.rows)
        assert not table.block_tables[rows:].any()
        assert not table.context_lens[rows:].any()
        assert (table.slot_mapping[rows:] == atb_mem.PAD_SLOT).all()
        assert (table.context_lens[:rows] > 0).all()

"""KVCachePool and BatchTable driven by hypothesis against a pure-Python model.

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
from hypothesis import HealthCheck, event, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import atb_mem

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


def snapshot(pool: atb_mem.KVCachePool, table: atb_mem.BatchTable | None = None) -> dict[str, Any]:
    """Everything observable about the pool (and table), for 'a failed call changed nothing'."""
    ids = pool.seq_ids()
    snap: dict[str, Any] = {
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


class KVCacheMachine(RuleBasedStateMachine):
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

    def expect_unchanged(
        self, before: dict[str, Any], error: type[BaseException], call: Any
    ) -> None:
        assert self.pool is not None
        with pytest.raises(error) as raised:
            call()
        event(f"raised {type(raised.value).__name__}")
        assert snapshot(self.pool, self.table) == before

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

    # ------------------------------------------------------------------ setup

    @initialize(
        num_blocks=st.integers(16, 32),
        block_size=st.integers(2, 4),
        prefix_caching=st.sampled_from([True, True, True, False]),
        max_seqs=st.integers(2, 6),
        narrow=st.booleans(),
    )
    def setup(
        self, num_blocks: int, block_size: int, prefix_caching: bool, max_seqs: int, narrow: bool
    ) -> None:
        self.pool = atb_mem.KVCachePool(
            num_blocks, block_size, enable_prefix_caching=prefix_caching
        )
        self.table = self.pool.batch_table(max_seqs, 5 if narrow else num_blocks - 1)
        for view in (self.table.block_tables, self.table.context_lens, self.table.slot_mapping):
            assert view.dtype == np.int32 and not view.flags.writeable

    # --------------------------------------------------------------- alloc

    @rule(data=st.data())
    def alloc_count(self, data: st.DataObject) -> None:
        if len(self.values) >= MAX_LIVE:
            return
        assert self.pool is not None
        seq_id = self.new_id(data)
        count = data.draw(
            st.integers(1, 3 * self.bs)
            if data.draw(st.integers(0, 3), label="big?")
            else st.integers(1, self.max_tokens),
            label="count",
        )
        before = snapshot(self.pool, self.table)
        if cdiv(count, self.bs) > self.pool.num_free_blocks:
            assert not self.pool.can_allocate(count)
            self.expect_unchanged(
                before, atb_mem.OutOfMemoryError, lambda: self.pool.alloc_sequence(seq_id, count)
            )
            return
        assert self.pool.can_allocate(count)
        assert self.pool.alloc_sequence(seq_id, count) == 0
        assert self.pool.num_free_blocks == before["num_free_blocks"] - cdiv(count, self.bs)
        self.write_alloc(seq_id, [self.fresh_value() for _ in range(count)], 0)

    def draw_token_ids(self, data: st.DataObject) -> tuple[list[int], Salt]:
        bases = [(p, None) for p in PROMPTS] + self.prompts
        base, base_salt = data.draw(st.sampled_from(bases), label="base prompt")
        cut = data.draw(st.integers(0, len(base)), label="cut")
        tail = data.draw(st.lists(VOCAB, max_size=2 * self.bs), label="tail")
        tokens = list(base[:cut]) + tail
        if not tokens:
            tokens = [data.draw(VOCAB)]
        tokens = tokens[: self.max_tokens]
        salt = data.draw(st.sampled_from([base_salt, *SALTS]), label="salt")
        return tokens, salt

    @rule(data=st.data())
    def alloc_ids(self, data: st.DataObject) -> None:
        """Allocates by token ids; maybe the same ids again, under another salt or the same."""
        if len(self.values) >= MAX_LIVE:
            return
        tokens, salt = self.draw_token_ids(data)
        self.alloc_token_ids(data, tokens, salt)
        if data.draw(st.integers(0, 3), label="again") > 0:
            again_salt = data.draw(st.sampled_from([salt, salt, *SALTS]), label="salt again")
            self.alloc_token_ids(data, tokens, again_salt)

    def alloc_token_ids(self, data: st.DataObject, tokens: list[int], salt: Salt) -> None:
        assert self.pool is not None
        seq_id = self.new_id(data)
        form = data.draw(st.sampled_from(["list", "int32", "int64", "uint32"]), label="form")
        arg: Any = tokens if form == "list" else np.array(tokens, dtype=form)
        n, bs = len(tokens), self.bs
        queries = (n - 1) // bs
        free = self.pool.num_free_blocks
        before = snapshot(self.pool, self.table)
        can = self.pool.can_allocate(arg, cache_salt=salt)
        assert snapshot(self.pool, self.table) == before  # can_allocate is a pure query
        if cdiv(n, bs) - queries > free:
            assert not can
        if cdiv(n, bs) <= free:
            assert can
        if not can:
            self.expect_unchanged(
                before,
                atb_mem.OutOfMemoryError,
                lambda: self.pool.alloc_sequence(seq_id, arg, cache_salt=salt),
            )
            return
        cached = self.pool.alloc_sequence(seq_id, arg, cache_salt=salt)
        assert cached % bs == 0 and 0 <= cached <= queries * bs
        if not self.pool.enable_prefix_caching:
            assert cached == 0
        else:
            self.queries += queries
            self.hits += cached // bs
        hits = cached // bs
        after = self.pool.num_free_blocks
        assert free - cdiv(n, bs) <= after <= free - (cdiv(n, bs) - hits)
        note(f"alloc {seq_id} ids={tokens} salt={salt!r}: {cached} cached")
        if cached:
            event("prefix hit" + (" (salted)" if salt is not None else ""))
        self.write_alloc(seq_id, [("t", norm_salt(salt), t) for t in tokens], cached)
        self.salts[seq_id] = norm_salt(salt)
        self.prompts = [*self.prompts[-7:], (tuple(tokens), salt)]

    @rule(data=st.data())
    def alloc_like_live(self, data: st.DataObject) -> None:
        """Re-requests a live id-allocated sequence's tokens: its full blocks are in use."""
        if len(self.values) >= MAX_LIVE:
            return
        assert self.pool is not None
        hashable = [i for i in self.values if all(v[0] == "t" for v in self.values[i])]
        if not hashable:
            return
        source = data.draw(st.sampled_from(sorted(hashable)), label="source")
        salt_bytes = self.salts[source]
        tokens = [v[2] for v in self.values[source]]
        tokens = tokens[: data.draw(st.integers(1, len(tokens)), label="cut")]
        seq_id = self.new_id(data)
        before = snapshot(self.pool, self.table)
        if not self.pool.can_allocate(tokens, cache_salt=salt_bytes):
            self.expect_unchanged(
                before,
                atb_mem.OutOfMemoryError,
                lambda: self.pool.alloc_sequence(seq_id, tokens, cache_salt=salt_bytes),
            )
            return
        cached = self.pool.alloc_sequence(seq_id, tokens, cache_salt=salt_bytes)
        if cached:
            event("prefix hit on live blocks")
        if self.pool.enable_prefix_caching:
            self.queries += (len(tokens) - 1) // self.bs
            self.hits += cached // self.bs
        self.write_alloc(seq_id, [("t", salt_bytes, t) for t in tokens], cached)
        self.salts[seq_id] = salt_bytes

    def _alloc_errors(self, data: st.DataObject) -> None:
        assert self.pool is not None
        before = snapshot(self.pool, self.table)
        pool = self.pool
        kind = data.draw(
            st.sampled_from(["duplicate", "zero", "empty", "too_many", "too_many_ids", "bad_id"]),
            label="alloc error",
        )
        if kind == "duplicate":
            if not self.values:
                return
            seq_id = self.live(data)
            self.expect_unchanged(
                before, atb_mem.DuplicateSequenceError, lambda: pool.alloc_sequence(seq_id, 1)
            )
            self.expect_unchanged(before, ValueError, lambda: pool.alloc_sequence(seq_id, [0, 1]))
            self.expect_unchanged(before, ValueError, lambda: pool.fork(seq_id, seq_id))
        elif kind == "zero":
            self.expect_unchanged(before, ValueError, lambda: pool.alloc_sequence(10**15, 0))
        elif kind == "empty":
            self.expect_unchanged(before, ValueError, lambda: pool.alloc_sequence(10**15, []))
        elif kind == "too_many":
            count = self.max_tokens + data.draw(st.integers(1, 3))
            self.expect_unchanged(before, ValueError, lambda: pool.alloc_sequence(10**15, count))
        elif kind == "too_many_ids":
            ids = [0] * (self.max_tokens + 1)
            self.expect_unchanged(before, ValueError, lambda: pool.alloc_sequence(10**15, ids))
        else:
            bad = data.draw(st.sampled_from([-1, 2**63, 2**64, True, 1.0, "3", None]))
            self.expect_unchanged(before, TypeError, lambda: pool.alloc_sequence(bad, 1))

    def _alloc_oom(self) -> None:
        """A request for one block more than is free fails and changes nothing."""
        assert self.pool is not None
        count = (self.pool.num_free_blocks + 1) * self.bs
        if count > self.max_tokens:
            return
        before = snapshot(self.pool, self.table)
        assert not self.pool.can_allocate(count)
        self.expect_unchanged(
            before, atb_mem.OutOfMemoryError, lambda: self.pool.alloc_sequence(10**15, count)
        )
        if not self.pool.enable_prefix_caching:  # no hit can lower the need
            self.expect_unchanged(
                before, MemoryError, lambda: self.pool.alloc_sequence(10**15, [0] * count)
            )

    # -------------------------------------------------------------- append

    @rule(data=st.data())
    def append(self, data: st.DataObject) -> None:
        if not self.values:
            return
        assert self.pool is not None
        ids = data.draw(
            st.lists(st.sampled_from(sorted(self.values)), min_size=1, unique=True), label="batch"
        )
        n = data.draw(st.integers(1, 3), label="n")
        with_ids = data.draw(st.booleans(), label="with token ids")
        token_ids = data.draw(
            st.lists(VOCAB, min_size=len(ids) * n, max_size=len(ids) * n), label="token ids"
        )
        shape = data.draw(st.sampled_from(["flat", "2d", "list"]), label="token id form")
        arg: Any = None
        if with_ids:
            arg = (
                token_ids
                if shape == "list"
                else np.array(token_ids, dtype=np.int32).reshape(
                    (len(ids), n) if shape == "2d" else (-1,)
                )
            )
        self.do_append(data, ids, n, token_ids if with_ids else None, arg)

    def do_append(
        self, data: st.DataObject, ids: list[int], n: int, token_ids: list[int] | None, arg: Any
    ) -> None:
        """pool.append_tokens(ids, n, arg), where arg is token_ids in some form or None."""
        assert self.pool is not None
        seq_arg: Any = ids if data.draw(st.booleans()) else np.array(ids, dtype=np.int64)
        before = snapshot(self.pool, self.table)
        free = self.pool.num_free_blocks
        too_long = any(len(self.values[i]) + n > self.max_tokens for i in ids)
        need = self.append_need(ids, n)
        call = lambda: self.pool.append_tokens(seq_arg, n, token_ids=arg)  # noqa: E731
        if too_long:
            self.expect_unchanged(before, ValueError, call)
            return
        if need > free:
            self.expect_unchanged(before, atb_mem.OutOfMemoryError, call)
            return
        if need == free:
            event("append takes every free block")
        slots = call()
        assert slots.dtype == np.int32 and slots.shape == (len(ids) * n,)
        copies = self.apply_copies()
        assert len(copies) <= len(ids)
        assert free - self.pool.num_free_blocks == need
        for k, seq_id in enumerate(ids):
            for t in range(n):
                value = (
                    ("t", self.salts.get(seq_id), token_ids[k * n + t])
                    if token_ids is not None
                    else self.fresh_value()
                )
                self.mem[int(slots[k * n + t])] = value
                self.values[seq_id].append(value)
        assert len(set(slots.tolist())) == len(slots)

    def _append_errors(self, data: st.DataObject) -> None:
        assert self.pool is not None
        pool = self.pool
        before = snapshot(pool, self.table)
        ids = data.draw(st.lists(st.sampled_from(sorted(self.values)), min_size=1, unique=True))
        kind = data.draw(st.sampled_from(["twice", "unknown", "ids_len", "n0", "too_long"]))
        if kind == "twice":
            twice = [*ids, data.draw(st.sampled_from(ids))]
            twice = data.draw(st.permutations(twice))
            self.expect_unchanged(before, ValueError, lambda: pool.append_tokens(twice))
        elif kind == "unknown":
            bad = [*ids, self.unknown_id(data)]
            bad = data.draw(st.permutations(bad))
            self.expect_unchanged(
                before, atb_mem.UnknownSequenceError, lambda: pool.append_tokens(bad)
            )
            self.expect_unchanged(before, KeyError, lambda: pool.append_tokens(bad, 2))
        elif kind == "ids_len":
            wrong = [0] * (len(ids) * 2 + data.draw(st.sampled_from([-1, 1])))
            self.expect_unchanged(before, ValueError, lambda: pool.append_tokens(ids, 2, wrong))
        elif kind == "n0":
            self.expect_unchanged(before, ValueError, lambda: pool.append_tokens(ids, 0))
        else:
            longest = max(len(self.values[i]) for i in ids)
            n = self.max_tokens - longest + 1
            self.expect_unchanged(before, ValueError, lambda: pool.append_tokens(ids, n))

    # ---------------------------------------------------------- fork / free

    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        if not self.values or len(self.values) >= MAX_LIVE:
            return
        assert self.pool is not None
        parent = self.live(data, "parent")
        for _ in range(data.draw(st.integers(1, 2), label="children")):
            child = self.new_id(data)
            free = self.pool.num_free_blocks
            self.pool.fork(parent, child)
            assert self.pool.num_free_blocks == free
            assert self.pool.block_table(child).tolist() == self.pool.block_table(parent).tolist()
            self.values[child] = list(self.values[parent])
            if parent in self.salts:
                self.salts[child] = self.salts[parent]
        # Parallel sampling: one of the family appends at once (copy-on-write if shared).
        family = [parent, child]
        if data.draw(st.booleans(), label="append after fork"):
            ids = data.draw(st.lists(st.sampled_from(family), min_size=1, unique=True))
            n = data.draw(st.integers(1, 2), label="n")
            ids_given = data.draw(st.booleans(), label="with token ids")
            token_ids = [data.draw(VOCAB) for _ in range(len(ids) * n)] if ids_given else None
            self.do_append(data, ids, n, token_ids, token_ids)

    def _fork_errors(self, data: st.DataObject) -> None:
        assert self.pool is not None
        pool = self.pool
        before = snapshot(pool, self.table)
        live = self.live(data)
        other = self.live(data, "other")
        unknown = self.unknown_id(data)
        self.expect_unchanged(
            before, atb_mem.UnknownSequenceError, lambda: pool.fork(unknown, 10**15)
        )
        self.expect_unchanged(
            before, atb_mem.DuplicateSequenceError, lambda: pool.fork(live, other)
        )
        self.expect_unchanged(before, TypeError, lambda: pool.fork(live, -5))

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        if not self.values:
            return
        assert self.pool is not None and self.table is not None
        seq_id = self.live(data)
        if seq_id in self.rows and data.draw(st.booleans(), label="remove row first"):
            self.table_remove_row(seq_id)
        before = self.pool.num_free_blocks
        shared = self.refcounts()
        blocks = self.pool.block_table(seq_id).tolist()
        self.pool.free_sequence(seq_id)
        assert self.pool.num_free_blocks == before + sum(1 for b in set(blocks) if shared[b] == 1)
        del self.values[seq_id]
        self.salts.pop(seq_id, None)
        self.freed_ids.append(seq_id)
        assert seq_id not in self.pool

    def _free_unknown(self, data: st.DataObject) -> None:
        assert self.pool is not None
        pool = self.pool
        unknown = self.unknown_id(data)
        before = snapshot(pool, self.table)
        self.expect_unchanged(
            before, atb_mem.UnknownSequenceError, lambda: pool.free_sequence(unknown)
        )
        self.expect_unchanged(before, KeyError, lambda: pool.seq_len(unknown))
        self.expect_unchanged(before, KeyError, lambda: pool.block_tables([unknown]))
        self.expect_unchanged(before, KeyError, lambda: pool.context_lens([unknown]))

    def _reset_prefix_cache(self) -> None:
        assert self.pool is not None
        cached = self.pool.stats()["blocks_cached"]
        free = self.pool.num_free_blocks
        assert self.pool.reset_prefix_cache() == cached
        assert self.pool.stats()["blocks_cached"] == 0
        assert self.pool.num_free_blocks == free

    # ---------------------------------------------------------- batch table

    def table_remove_row(self, seq_id: int) -> None:
        assert self.table is not None
        self.table.remove(seq_id)
        row = self.rows.index(seq_id)
        last = self.rows.pop()
        if row < len(self.rows):
            self.rows[row] = last
        assert self.table.seq_ids == self.rows

    @rule(data=st.data())
    def table_add(self, data: st.DataObject) -> None:
        if not self.values:
            return
        for _ in range(data.draw(st.integers(1, 3), label="rows to add")):
            self.table_add_one(data)

    def table_add_one(self, data: st.DataObject) -> None:
        assert self.pool is not None and self.table is not None
        table = self.table
        seq_id = self.live(data)
        before = snapshot(self.pool, table)
        if seq_id in self.rows:
            self.expect_unchanged(before, ValueError, lambda: table.add(seq_id))
        elif len(self.rows) == table.max_seqs:
            self.expect_unchanged(before, ValueError, lambda: table.add(seq_id))
        elif len(self.pool.block_table(seq_id)) > table.max_blocks_per_seq:
            self.expect_unchanged(before, ValueError, lambda: table.add(seq_id))
        else:
            table.add(seq_id)
            self.rows.append(seq_id)
            assert seq_id in table
            self.check_table_row(len(self.rows) - 1, seq_id)
            assert table.slot_mapping[len(self.rows) - 1] == atb_mem.PAD_SLOT

    def _table_errors(self, data: st.DataObject) -> None:
        assert self.pool is not None and self.table is not None
        table = self.table
        before = snapshot(self.pool, table)
        unknown = self.unknown_id(data)
        if unknown not in self.rows:
            self.expect_unchanged(before, ValueError, lambda: table.remove(unknown))
            if len(self.rows) < table.max_seqs:
                self.expect_unchanged(
                    before, atb_mem.UnknownSequenceError, lambda: table.add(unknown)
                )
        wrong = [0] * (len(self.rows) + 1)
        self.expect_unchanged(before, ValueError, lambda: table.append_tokens(wrong))

    @rule(data=st.data())
    def table_remove(self, data: st.DataObject) -> None:
        if not self.rows:
            return
        self.table_remove_row(data.draw(st.sampled_from(self.rows)))

    def _table_clear(self) -> None:
        assert self.table is not None
        self.table.clear()
        self.rows = []

    @precondition(lambda self: self.table is not None)
    @rule(data=st.data())
    def table_append(self, data: st.DataObject) -> None:
        assert self.pool is not None and self.table is not None
        table = self.table
        with_ids = data.draw(st.booleans(), label="with token ids")
        token_ids = data.draw(
            st.lists(VOCAB, min_size=len(self.rows), max_size=len(self.rows)), label="token ids"
        )
        arg: Any = (
            (token_ids if data.draw(st.booleans()) else np.array(token_ids, dtype=np.int64))
            if with_ids
            else None
        )
        before = snapshot(self.pool, table)
        call = lambda: table.append_tokens(arg)  # noqa: E731
        for seq_id in self.rows:
            if seq_id not in self.values:
                self.expect_unchanged(before, atb_mem.UnknownSequenceError, call)
                return
            length = len(self.values[seq_id])
            if cdiv(length + 1, self.bs) > table.max_blocks_per_seq or length >= self.max_tokens:
                self.expect_unchanged(before, ValueError, call)
                return
        free = self.pool.num_free_blocks
        need = self.append_need(self.rows, 1)
        if need > free:
            self.expect_unchanged(before, atb_mem.OutOfMemoryError, call)
            return
        call()
        event(f"table append ok ({min(len(self.rows), 2)}+ rows)")
        self.apply_copies()
        assert free - self.pool.num_free_blocks == need
        slots = table.slot_mapping
        for row, seq_id in enumerate(self.rows):
            value = (
                ("t", self.salts.get(seq_id), token_ids[row]) if with_ids else self.fresh_value()
            )
            self.mem[int(slots[row])] = value
            self.values[seq_id].append(value)
            self.check_table_row(row, seq_id)
            length = len(self.values[seq_id])
            last = self.pool.slot_mapping([seq_id], [length - 1], [length])
            assert slots[row] == last[0]

    @precondition(lambda self: self.pool is not None)
    @rule(data=st.data())
    def errors_and_rare_ops(self, data: st.DataObject) -> None:
        """Failing calls (each must change nothing), reset_prefix_cache and table.clear."""
        kinds = ["alloc", "oom", "free_unknown", "table", "reset", "clear"]
        if self.values:
            kinds += ["append", "fork"]
        kind = data.draw(st.sampled_from(kinds), label="error kind")
        if kind == "alloc":
            self._alloc_errors(data)
        elif kind == "oom":
            self._alloc_oom()
        elif kind == "free_unknown":
            self._free_unknown(data)
        elif kind == "table":
            self._table_errors(data)
        elif kind == "reset":
            self._reset_prefix_cache()
        elif kind == "clear":
            self._table_clear()
        elif kind == "append":
            self._append_errors(data)
        else:
            self._fork_errors(data)

    # ----------------------------------------------------------- invariants

    @invariant()
    def consistent(self) -> None:
        pool = self.pool
        if pool is None:
            return
        pool._check_invariants()
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


KVCacheMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_kv_cache_state_machine = KVCacheMachine.TestCase


@pytest.mark.parametrize("via", ["pool", "batch_table"])
def test_batch_append_copies_a_shared_block_once(via: str) -> None:
    """Two forks sharing a partly filled block, appended in one batch, need one new block.

    The first copies the shared block; the second is then its only holder and writes in
    place. So the batch fits in the one free block, as it does when appended one at a time.
    """
    pool = atb_mem.KVCachePool(4, 4)
    pool.alloc_sequence(1, 2)
    pool.fork(1, 2)
    pool.alloc_sequence(3, 4)
    assert pool.num_free_blocks == 1
    if via == "pool":
        slots = pool.append_tokens([1, 2])
        assert len(set(slots.tolist())) == 2
    else:
        table = pool.batch_table(4, 3)
        table.add(1)
        table.add(2)
        table.append_tokens()
        assert table.context_lens[:2].tolist() == [3, 3]
    assert pool.take_pending_copies().shape == (1, 2)
    assert pool.num_free_blocks == 0
    assert [pool.seq_len(1), pool.seq_len(2)] == [3, 3]
    pool._check_invariants()

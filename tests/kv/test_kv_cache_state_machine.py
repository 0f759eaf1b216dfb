"""KVCachePool and BatchTable driven by hypothesis against a pure-Python model of the KV memory
(``kv_cache_model``, which says what it checks after every step). The rules here change the
pool; ``kv_cache_failing_calls`` adds the calls that must fail and change nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import event, note
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

import atb_mem
from tests.kv.kv_cache_failing_calls import KVCacheFailingCalls
from tests.kv.kv_cache_model import MAX_LIVE, PROMPTS, SALTS, VOCAB, Salt, cdiv, norm_salt
from tests.support.state_machine import machine_settings


class KVCacheMachine(KVCacheFailingCalls):
    """The rules that change the pool: allocations, appends, forks, frees, batch-table rows."""

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
        before = self.observe()
        if cdiv(count, self.bs) > self.pool.num_free_blocks:
            assert not self.pool.can_allocate(count)
            self.expect_unchanged(
                atb_mem.OutOfMemoryError, lambda: self.pool.alloc_sequence(seq_id, count),
                before=before,
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
        before = self.observe()
        can = self.pool.can_allocate(arg, cache_salt=salt)
        assert self.observe() == before  # can_allocate is a pure query
        if cdiv(n, bs) - queries > free:
            assert not can
        if cdiv(n, bs) <= free:
            assert can
        if not can:
            self.expect_unchanged(
                atb_mem.OutOfMemoryError,
                lambda: self.pool.alloc_sequence(seq_id, arg, cache_salt=salt),
                before=before,
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
        before = self.observe()
        if not self.pool.can_allocate(tokens, cache_salt=salt_bytes):
            self.expect_unchanged(
                atb_mem.OutOfMemoryError,
                lambda: self.pool.alloc_sequence(seq_id, tokens, cache_salt=salt_bytes),
                before=before,
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
        before = self.observe()
        free = self.pool.num_free_blocks
        too_long = any(len(self.values[i]) + n > self.max_tokens for i in ids)
        need = self.append_need(ids, n)
        call = lambda: self.pool.append_tokens(seq_arg, n, token_ids=arg)  # noqa: E731
        if too_long:
            self.expect_unchanged(ValueError, call, before=before)
            return
        if need > free:
            self.expect_unchanged(atb_mem.OutOfMemoryError, call, before=before)
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

    # ---------------------------------------------------------- batch table

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
        before = self.observe()
        if seq_id in self.rows:
            self.expect_unchanged(ValueError, lambda: table.add(seq_id), before=before)
        elif len(self.rows) == table.max_seqs:
            self.expect_unchanged(ValueError, lambda: table.add(seq_id), before=before)
        elif len(self.pool.block_table(seq_id)) > table.max_blocks_per_seq:
            self.expect_unchanged(ValueError, lambda: table.add(seq_id), before=before)
        else:
            table.add(seq_id)
            self.rows.append(seq_id)
            assert seq_id in table
            self.check_table_row(len(self.rows) - 1, seq_id)
            assert table.slot_mapping[len(self.rows) - 1] == atb_mem.PAD_SLOT

    @rule(data=st.data())
    def table_remove(self, data: st.DataObject) -> None:
        if not self.rows:
            return
        self.table_remove_row(data.draw(st.sampled_from(self.rows)))

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
        before = self.observe()
        call = lambda: table.append_tokens(arg)  # noqa: E731
        for seq_id in self.rows:
            if seq_id not in self.values:
                self.expect_unchanged(atb_mem.UnknownSequenceError, call, before=before)
                return
            length = len(self.values[seq_id])
            if cdiv(length + 1, self.bs) > table.max_blocks_per_seq or length >= self.max_tokens:
                self.expect_unchanged(ValueError, call, before=before)
                return
        free = self.pool.num_free_blocks
        need = self.append_need(self.rows, 1)
        if need > free:
            self.expect_unchanged(atb_mem.OutOfMemoryError, call, before=before)
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


KVCacheMachine.TestCase.settings = machine_settings(max_examples=150)
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

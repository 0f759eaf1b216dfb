"""The failing calls of the KV-cache state machine: each must raise and change nothing."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

import atb_mem
from tests.kv.kv_cache_model import KVCacheModel


class KVCacheFailingCalls(KVCacheModel):
    """One rule that makes a failing call of some kind (or a rare operation:
    ``reset_prefix_cache``, ``BatchTable.clear``); the other rules are in ``KVCacheMachine``."""

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

    def _alloc_errors(self, data: st.DataObject) -> None:
        assert self.pool is not None
        before = self.observe()
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
                atb_mem.DuplicateSequenceError, lambda: pool.alloc_sequence(seq_id, 1),
                before=before,
            )
            self.expect_unchanged(
                ValueError, lambda: pool.alloc_sequence(seq_id, [0, 1]), before=before
            )
            self.expect_unchanged(ValueError, lambda: pool.fork(seq_id, seq_id), before=before)
        elif kind == "zero":
            self.expect_unchanged(ValueError, lambda: pool.alloc_sequence(10**15, 0), before=before)
        elif kind == "empty":
            self.expect_unchanged(
                ValueError, lambda: pool.alloc_sequence(10**15, []), before=before
            )
        elif kind == "too_many":
            count = self.max_tokens + data.draw(st.integers(1, 3))
            self.expect_unchanged(
                ValueError, lambda: pool.alloc_sequence(10**15, count), before=before
            )
        elif kind == "too_many_ids":
            ids = [0] * (self.max_tokens + 1)
            self.expect_unchanged(
                ValueError, lambda: pool.alloc_sequence(10**15, ids), before=before
            )
        else:
            bad = data.draw(st.sampled_from([-1, 2**63, 2**64, True, 1.0, "3", None]))
            self.expect_unchanged(TypeError, lambda: pool.alloc_sequence(bad, 1), before=before)

    def _alloc_oom(self) -> None:
        """A request for one block more than is free fails and changes nothing."""
        assert self.pool is not None
        count = (self.pool.num_free_blocks + 1) * self.bs
        if count > self.max_tokens:
            return
        before = self.observe()
        assert not self.pool.can_allocate(count)
        self.expect_unchanged(
            atb_mem.OutOfMemoryError, lambda: self.pool.alloc_sequence(10**15, count), before=before
        )
        if not self.pool.enable_prefix_caching:  # no hit can lower the need
            self.expect_unchanged(
                MemoryError, lambda: self.pool.alloc_sequence(10**15, [0] * count), before=before
            )

    def _append_errors(self, data: st.DataObject) -> None:
        assert self.pool is not None
        pool = self.pool
        before = self.observe()
        ids = data.draw(st.lists(st.sampled_from(sorted(self.values)), min_size=1, unique=True))
        kind = data.draw(st.sampled_from(["twice", "unknown", "ids_len", "n0", "too_long"]))
        if kind == "twice":
            twice = [*ids, data.draw(st.sampled_from(ids))]
            twice = data.draw(st.permutations(twice))
            self.expect_unchanged(ValueError, lambda: pool.append_tokens(twice), before=before)
        elif kind == "unknown":
            bad = [*ids, self.unknown_id(data)]
            bad = data.draw(st.permutations(bad))
            self.expect_unchanged(
                atb_mem.UnknownSequenceError, lambda: pool.append_tokens(bad), before=before
            )
            self.expect_unchanged(KeyError, lambda: pool.append_tokens(bad, 2), before=before)
        elif kind == "ids_len":
            wrong = [0] * (len(ids) * 2 + data.draw(st.sampled_from([-1, 1])))
            self.expect_unchanged(
                ValueError, lambda: pool.append_tokens(ids, 2, wrong), before=before
            )
        elif kind == "n0":
            self.expect_unchanged(ValueError, lambda: pool.append_tokens(ids, 0), before=before)
        else:
            longest = max(len(self.values[i]) for i in ids)
            n = self.max_tokens - longest + 1
            self.expect_unchanged(ValueError, lambda: pool.append_tokens(ids, n), before=before)

    def _fork_errors(self, data: st.DataObject) -> None:
        assert self.pool is not None
        pool = self.pool
        before = self.observe()
        live = self.live(data)
        other = self.live(data, "other")
        unknown = self.unknown_id(data)
        self.expect_unchanged(
            atb_mem.UnknownSequenceError, lambda: pool.fork(unknown, 10**15), before=before
        )
        self.expect_unchanged(
            atb_mem.DuplicateSequenceError, lambda: pool.fork(live, other), before=before
        )
        self.expect_unchanged(TypeError, lambda: pool.fork(live, -5), before=before)

    def _free_unknown(self, data: st.DataObject) -> None:
        assert self.pool is not None
        pool = self.pool
        unknown = self.unknown_id(data)
        before = self.observe()
        self.expect_unchanged(
            atb_mem.UnknownSequenceError, lambda: pool.free_sequence(unknown), before=before
        )
        self.expect_unchanged(KeyError, lambda: pool.seq_len(unknown), before=before)
        self.expect_unchanged(KeyError, lambda: pool.block_tables([unknown]), before=before)
        self.expect_unchanged(KeyError, lambda: pool.context_lens([unknown]), before=before)

    def _table_errors(self, data: st.DataObject) -> None:
        assert self.pool is not None and self.table is not None
        table = self.table
        before = self.observe()
        unknown = self.unknown_id(data)
        if unknown not in self.rows:
            self.expect_unchanged(ValueError, lambda: table.remove(unknown), before=before)
            if len(self.rows) < table.max_seqs:
                self.expect_unchanged(
                    atb_mem.UnknownSequenceError, lambda: table.add(unknown), before=before
                )
        wrong = [0] * (len(self.rows) + 1)
        self.expect_unchanged(ValueError, lambda: table.append_tokens(wrong), before=before)

    def _reset_prefix_cache(self) -> None:
        assert self.pool is not None
        cached = self.pool.stats()["blocks_cached"]
        free = self.pool.num_free_blocks
        assert self.pool.reset_prefix_cache() == cached
        assert self.pool.stats()["blocks_cached"] == 0
        assert self.pool.num_free_blocks == free

    def _table_clear(self) -> None:
        assert self.table is not None
        self.table.clear()
        self.rows = []

"""Eight Python threads hammer one KVCachePool at once.

Each thread owns a range of sequence ids and, between the same barrier and deadline, allocates
(by count, and by token ids that start with a prompt every thread shares, so prefix hits cross
threads), appends (batches of more than 4096 tokens too, which run without the GIL), forks,
frees, reads block tables and stats, and drives a BatchTable of its own. Only its own calls
change its own sequences, so every thread checks their state exactly after each call, even
while the others run; OutOfMemoryError is expected and must change nothing. Thread 0 also
checks the pool's invariants as it goes.

At the end: no thread raised anything else, the invariants hold, a block held by two live
sequences is one they may legitimately share (fork relatives, or the same leading tokens
through the prefix cache), and freeing everything gives every block back.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

import atb_mem

NUM_THREADS = 8
NUM_BLOCKS = 3072
BLOCK_SIZE = 16
STEPS = 1500
RUN_SECONDS = 6.0
JOIN_SECONDS = 30.0
MAX_SEQS_PER_THREAD = 6
MAX_BLOCKS_PER_THREAD = 800  # a thread frees its longest sequence above this
BIG = 4097  # tokens in one call above which the GIL is released
SHARED_PROMPT = list(range(1000, 1000 + 20 * BLOCK_SIZE))
UNKNOWN = -1  # a token given by count: its id is unknown


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class Seq:
    family: int  # fork relatives share it
    tokens: list[int] = field(default_factory=list)  # UNKNOWN where given by count


class Worker:
    def __init__(self, pool: atb_mem.KVCachePool, tid: int, barrier: threading.Barrier) -> None:
        self.pool = pool
        self.tid = tid
        self.barrier = barrier
        self.rng = random.Random(20260 + tid)
        self.ids = itertools.count(tid * 10**12 + 1)
        self.live: dict[int, Seq] = {}
        self.table = pool.batch_table(8, 2048) if tid % 2 == 0 else None
        self.rows: list[int] = []
        self.counts: defaultdict[str, int] = defaultdict(int)
        self.error: str | None = None

    # ------------------------------------------------------------- helpers

    def new_seq_id(self) -> int:
        return next(self.ids)

    def check_seq(self, seq_id: int) -> None:
        seq = self.live[seq_id]
        assert self.pool.seq_len(seq_id) == len(seq.tokens)
        blocks = self.pool.block_table(seq_id)
        assert len(blocks) == cdiv(len(seq.tokens), BLOCK_SIZE)
        assert atb_mem.NULL_BLOCK not in blocks.tolist()

    def own_state(self) -> dict[int, tuple[int, list[int]]]:
        return {i: (self.pool.seq_len(i), self.pool.block_table(i).tolist()) for i in self.live}

    def alloc(self, tokens: int | list[int] | np.ndarray) -> None:
        seq_id = self.new_seq_id()
        n = tokens if isinstance(tokens, int) else len(tokens)
        try:
            cached = self.pool.alloc_sequence(seq_id, tokens)
        except atb_mem.OutOfMemoryError:
            self.counts["oom alloc"] += 1
            assert seq_id not in self.pool  # all or nothing
            return
        assert cached % BLOCK_SIZE == 0 and 0 <= cached <= (n - 1) // BLOCK_SIZE * BLOCK_SIZE
        if isinstance(tokens, int):
            assert cached == 0
            known = [UNKNOWN] * n
        else:
            known = [int(t) for t in tokens]
            self.counts["hit tokens"] += cached
        self.live[seq_id] = Seq(family=seq_id, tokens=known)
        self.pool.mark_computed(seq_id)  # the prefill ran: its full blocks may be reused
        self.check_seq(seq_id)
        self.counts["alloc"] += 1

    def append(self, seq_ids: list[int], n: int, with_ids: bool) -> None:
        before = self.own_state()
        token_ids = (
            np.array([self.rng.randrange(2**31) for _ in range(len(seq_ids) * n)], np.int32)
            if with_ids
            else None
        )
        try:
            slots = self.pool.append_tokens(seq_ids, n, token_ids)
        except atb_mem.OutOfMemoryError:
            self.counts["oom append"] += 1
            assert self.own_state() == before  # all or nothing
            return
        assert slots.dtype == np.int32 and slots.shape == (len(seq_ids) * n,)
        assert len(np.unique(slots)) == len(slots)
        starts = [len(self.live[i].tokens) for i in seq_ids]
        for k, seq_id in enumerate(seq_ids):
            new = token_ids[k * n : (k + 1) * n].tolist() if token_ids is not None else None
            self.live[seq_id].tokens += new if new is not None else [UNKNOWN] * n
            self.check_seq(seq_id)
        ends = [s + n for s in starts]
        assert self.pool.slot_mapping(seq_ids, starts, ends).tolist() == slots.tolist()
        self.counts["append tokens"] += len(slots)

    def free(self, seq_id: int) -> None:
        if seq_id in self.rows:
            assert self.table is not None
            self.table.remove(seq_id)
            self.rows.remove(seq_id)
            assert sorted(self.table.seq_ids) == sorted(self.rows)
        self.pool.free_sequence(seq_id)
        del self.live[seq_id]
        assert seq_id not in self.pool

    def check_tables(self) -> None:
        ids = list(self.live)
        if not ids:
            return
        tables = self.pool.block_tables(ids)
        lens = self.pool.context_lens(ids)
        indptr, indices, last = self.pool.page_table_csr(ids)
        for row, seq_id in enumerate(ids):
            blocks = self.pool.block_table(seq_id).tolist()
            assert tables[row, : len(blocks)].tolist() == blocks
            assert not tables[row, len(blocks) :].any()
            assert lens[row] == len(self.live[seq_id].tokens)
            assert indices[indptr[row] : indptr[row + 1]].tolist() == blocks
            assert last[row] == (lens[row] - 1) % BLOCK_SIZE + 1

    def check_stats(self) -> None:
        stats = self.pool.stats()  # one snapshot, taken under the pool's lock
        assert stats["blocks_used"] + stats["blocks_free"] + stats["blocks_cached"] == (
            NUM_BLOCKS - 1
        )
        assert 0 <= stats["fragmentation"] < 1
        assert stats["num_tokens"] >= stats["num_sequences"] >= 0

    def table_step(self) -> None:
        assert self.table is not None
        table = self.table
        addable = [i for i in self.live if i not in self.rows]
        if addable and len(self.rows) < table.max_seqs and self.rng.random() < 0.5:
            seq_id = self.rng.choice(addable)
            if len(self.pool.block_table(seq_id)) <= table.max_blocks_per_seq - 1:
                table.add(seq_id)
                self.rows.append(seq_id)
        if not self.rows:
            return
        before = self.own_state()
        with_ids = self.rng.random() < 0.5
        token_ids = [self.rng.randrange(2**31) for _ in self.rows] if with_ids else None
        rows = table.seq_ids
        try:
            table.append_tokens(token_ids)
        except atb_mem.OutOfMemoryError:
            self.counts["oom table append"] += 1
            assert self.own_state() == before
            return
        for row, seq_id in enumerate(rows):
            seq = self.live[seq_id]
            seq.tokens.append(token_ids[row] if token_ids is not None else UNKNOWN)
            self.check_seq(seq_id)
            blocks = self.pool.block_table(seq_id).tolist()
            assert table.block_tables[row, : len(blocks)].tolist() == blocks
            assert table.context_lens[row] == len(seq.tokens)
            position = len(seq.tokens) - 1
            assert table.slot_mapping[row] == (
                blocks[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE
            )
        self.counts["table appends"] += 1

    # ---------------------------------------------------------------- loop

    def step(self, step: int) -> None:
        rng = self.rng
        op = rng.choices(
            ["alloc_count", "alloc_ids", "alloc_big", "alloc_all", "append", "append_big",
             "fork", "free", "query", "table"],
            weights=[10, 14, 2, 1, 16, 3, 6, 8, 6, 6],
        )[0]  # fmt: skip
        if op.startswith("alloc") and len(self.live) >= MAX_SEQS_PER_THREAD:
            op = "free"
        if op in ("append", "append_big", "fork", "free") and not self.live:
            op = "alloc_ids"
        if op == "table" and self.table is None:
            op = "query"
        self.counts[op] += 1

        if op == "alloc_count":
            self.alloc(rng.randint(1, 200))
        elif op == "alloc_ids":
            cut = rng.randint(0, len(SHARED_PROMPT))
            tail = [self.tid * 10**6 + rng.randrange(10**6) for _ in range(rng.randint(1, 40))]
            tokens = SHARED_PROMPT[:cut] + tail
            self.alloc(np.array(tokens, np.int64) if rng.random() < 0.5 else tokens)
        elif op == "alloc_big":  # > 4096 ids: released GIL
            tail = np.arange(BIG, dtype=np.int32) + self.tid * 10**8 + step * 10**4
            self.alloc(np.concatenate([np.array(SHARED_PROMPT, np.int32), tail]))
        elif op == "alloc_all":  # every usable slot: fails unless no block is in use
            self.alloc((NUM_BLOCKS - 1) * BLOCK_SIZE)  # if it fits, freed just below
        elif op in ("append", "append_big"):
            ids = list(self.live)
            rng.shuffle(ids)
            ids = ids[: rng.randint(1, len(ids))]
            n = rng.randint(1, 4) if op == "append" else BIG // len(ids) + 1
            self.append(ids, n, with_ids=rng.random() < 0.5)
        elif op == "fork":
            parent = rng.choice(list(self.live))
            child = self.new_seq_id()
            self.pool.fork(parent, child)
            seq = self.live[parent]
            self.live[child] = Seq(family=seq.family, tokens=list(seq.tokens))
            assert self.pool.block_table(child).tolist() == self.pool.block_table(parent).tolist()
        elif op == "free":
            self.free(rng.choice(list(self.live)))
        elif op == "query":
            self.check_tables()
            self.check_stats()
            copies = self.pool.take_pending_copies()
            assert copies.dtype == np.int32 and copies.ndim == 2 and copies.shape[1] == 2
        else:
            self.table_step()

        # Keep each thread's share of the pool bounded.
        while sum(len(s.tokens) for s in self.live.values()) > MAX_BLOCKS_PER_THREAD * BLOCK_SIZE:
            self.free(max(self.live, key=lambda i: len(self.live[i].tokens)))
        if self.tid == 0 and step % 4 == 0:
            self.pool._check_invariants()
            self.counts["invariant checks"] += 1

    def run(self) -> None:
        try:
            self.barrier.wait(timeout=JOIN_SECONDS)  # all start together
            deadline = time.monotonic() + RUN_SECONDS
            for step in range(STEPS):
                if time.monotonic() > deadline:
                    break
                self.step(step)
        except BaseException:
            self.error = traceback.format_exc()
            self.barrier.abort()


def check_sharing(pool: atb_mem.KVCachePool, workers: list[Worker]) -> int:
    """Every block held by several live sequences is one they may share. Returns how many."""
    seqs = {seq_id: seq for w in workers for seq_id, seq in w.live.items()}
    holders: defaultdict[int, list[tuple[int, int]]] = defaultdict(list)
    for seq_id in seqs:
        for index, block in enumerate(pool.block_table(seq_id).tolist()):
            holders[block].append((seq_id, index))
    shared = 0
    for block, held in holders.items():
        if len(held) == 1:
            continue
        shared += 1
        indices = {index for _, index in held}
        assert len(indices) == 1, f"block {block} sits at different positions: {held}"
        index = indices.pop()
        end = (index + 1) * BLOCK_SIZE
        full = all(len(seqs[s].tokens) >= end for s, _ in held)
        families = {seqs[s].family for s, _ in held}
        if not full:  # a partly filled block: only forks of one length share it
            assert len(families) == 1, f"partial block {block} shared across families: {held}"
            assert len({len(seqs[s].tokens) for s, _ in held}) == 1
            continue
        first = held[0][0]
        for other, _ in held[1:]:
            if seqs[other].family == seqs[first].family:
                continue
            a, b = seqs[first].tokens[:end], seqs[other].tokens[:end]
            assert UNKNOWN not in a and a == b, (
                f"block {block} (index {index}) shared by unrelated sequences {first} and "
                f"{other} whose tokens differ"
            )
    return shared


def test_eight_threads_hammer_one_pool() -> None:
    pool = atb_mem.KVCachePool(NUM_BLOCKS, BLOCK_SIZE)
    barrier = threading.Barrier(NUM_THREADS)
    workers = [Worker(pool, tid, barrier) for tid in range(NUM_THREADS)]
    threads = [
        threading.Thread(target=w.run, name=f"kv-worker-{w.tid}", daemon=True) for w in workers
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + JOIN_SECONDS
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a worker hung (deadlock?)"
    errors = [w.error for w in workers if w.error]
    assert not errors, "\n".join(errors)

    totals: defaultdict[str, int] = defaultdict(int)
    for w in workers:
        for key, value in w.counts.items():
            totals[key] += value
    # The run did what it is meant to: every kind of call, the GIL-free paths, prefix hits
    # across threads.
    for op in ("alloc", "append", "append_big", "alloc_big", "fork", "free", "table"):
        assert totals[op] > 0, (op, dict(totals))
    assert totals["hit tokens"] > 0 and totals["invariant checks"] > 0, dict(totals)

    pool._check_invariants()
    live = sorted(i for w in workers for i in w.live)
    assert pool.seq_ids() == live
    assert len(pool) == len(live)
    for w in workers:
        for seq_id in w.live:
            w.check_seq(seq_id)
    check_sharing(pool, workers)
    stats = pool.stats()
    assert stats["num_sequences"] == len(live)
    assert stats["num_tokens"] == sum(len(w.live[i].tokens) for w in workers for i in w.live)

    for w in workers:
        for seq_id in list(w.live):
            w.free(seq_id)
    pool._check_invariants()
    pool.take_pending_copies()
    stats = pool.stats()
    assert len(pool) == 0 and pool.seq_ids() == []
    assert pool.num_free_blocks == NUM_BLOCKS - 1
    assert stats["blocks_used"] == 0 and stats["num_tokens"] == 0
    assert stats["blocks_free"] + stats["blocks_cached"] == NUM_BLOCKS - 1


def test_sharing_check_catches_unrelated_sharing() -> None:
    """The final sharing check is not vacuous: it accepts forks and prefix hits only."""
    pool = atb_mem.KVCachePool(64, BLOCK_SIZE)
    worker = Worker(pool, 0, threading.Barrier(1))
    prompt = [*SHARED_PROMPT[: 2 * BLOCK_SIZE], 7]
    worker.alloc(prompt)
    worker.alloc(prompt)  # served 2 blocks from the prefix cache
    worker.alloc(5)
    _, second, counted = list(worker.live)
    worker.pool.fork(counted, 999)
    worker.live[999] = Seq(family=counted, tokens=list(worker.live[counted].tokens))
    assert check_sharing(pool, [worker]) == 3
    # Pretend the prefix hit was unrelated: the check must object.
    worker.live[second].tokens[0] += 1
    try:
        check_sharing(pool, [worker])
    except AssertionError:
        pass
    else:
        raise AssertionError("check_sharing accepted blocks shared by unrelated sequences")

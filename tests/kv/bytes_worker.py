"""One thread of the KV-bytes thread test. It owns its own sequences (disjoint ids), and only
its own calls create, fork, append to, swap or free them; it writes every token right after
allocating or appending it (``write_kv`` first executes the pending copy-on-write moves), so
nobody moves its blocks while it reads them back, and it checks them against the byte oracle —
from the device cache, or from the host tier while swapped — after each of its calls, while
the others keep running. OutOfMemoryError is expected now and then and must change nothing."""

from __future__ import annotations

import itertools
import random
import threading
import time
import traceback
from collections import Counter

import numpy as np
import pytest

import atb_mem
from tests.kv.byte_oracle import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    NUM_HOST_BLOCKS,
    Seq,
    cdiv,
    check_bytes,
    write_tokens,
)

STEPS = 600
RUN_SECONDS = 12.0
JOIN_SECONDS = 60.0
MAX_SEQS_PER_THREAD = 8
MAX_DEVICE_BLOCKS_PER_THREAD = 300  # 8 × 300 > 1023: threads compete for blocks
MAX_HOST_BLOCKS_PER_THREAD = 80
BIG = 4097  # tokens in one call above which the core releases the GIL
SEQ_ID_STRIDE = 1_000_000  # thread t owns ids t * stride + 1, ...; all exact in float32


class Worker:
    def __init__(self, kv: atb_mem.KVCachePool, tid: int, barrier: threading.Barrier) -> None:
        self.kv = kv
        self.tid = tid
        self.barrier = barrier
        self.rng = random.Random(77_000 + tid)
        self.ids = itertools.count(tid * SEQ_ID_STRIDE + 1)
        self.live: dict[int, Seq] = {}
        self.counts: Counter[str] = Counter()
        self.error: str | None = None

    # ------------------------------------------------------------- helpers

    def check(self, seq_id: int) -> None:
        seq = self.live[seq_id]
        check_bytes(self.kv, seq_id, seq.origins, seq.swapped)
        self.counts["checked"] += 1

    def check_all(self) -> None:
        for seq_id in self.live:
            self.check(seq_id)

    def own_state(self) -> dict[int, tuple[int, bool, list[int]]]:
        kv = self.kv
        return {i: (kv.seq_len(i), kv.is_swapped(i), kv.block_table(i).tolist())
                for i in self.live}

    def unchanged_after_failure(self, before: dict[int, tuple[int, bool, list[int]]]) -> None:
        """A call that raised changed nothing of this thread's: tables and bytes."""
        assert self.own_state() == before
        self.check_all()

    def on_device(self) -> list[int]:
        return [i for i, s in self.live.items() if not s.swapped]

    def swapped(self) -> list[int]:
        return [i for i, s in self.live.items() if s.swapped]

    def blocks_of(self, ids: list[int]) -> int:
        return sum(cdiv(len(self.live[i].origins), BLOCK_SIZE) for i in ids)

    def pick(self, ids: list[int], most: int) -> list[int]:
        ids = list(ids)
        self.rng.shuffle(ids)
        return ids[: self.rng.randint(1, min(most, len(ids)))]

    # ------------------------------------------------------------- operations

    def alloc(self, n: int) -> None:
        seq_id = next(self.ids)
        before = self.own_state()
        try:
            cached = self.kv.alloc_sequence(seq_id, n)  # a count: no prefix sharing
        except atb_mem.OutOfMemoryError:
            self.counts["oom alloc"] += 1
            assert seq_id not in self.kv
            self.unchanged_after_failure(before)
            return
        assert cached == 0
        self.counts["alloc"] += 1
        slots = self.kv.slot_mapping([seq_id], [0], [n])
        assert slots.shape == (n,)
        origins = np.full(n, seq_id, np.int64)
        write_tokens(self.kv, slots, origins, np.arange(n))
        self.counts["write_kv"] += 1
        self.live[seq_id] = Seq(origins)
        self.check(seq_id)

    def append(self, seq_ids: list[int], n: int) -> None:
        before = self.own_state()
        try:
            slots = self.kv.append_tokens(seq_ids, n)
        except atb_mem.OutOfMemoryError:
            self.counts["oom append"] += 1
            self.unchanged_after_failure(before)
            return
        self.counts["append"] += 1
        assert slots.shape == (len(seq_ids) * n,)
        starts = [len(self.live[i].origins) for i in seq_ids]
        ends = [s + n for s in starts]
        assert self.kv.slot_mapping(seq_ids, starts, ends).tolist() == slots.tolist()
        origins = np.repeat(np.array(seq_ids, np.int64), n)
        positions = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends, strict=True)])
        choice = self.rng.random()
        if choice < 0.3:
            # Execute the recorded copy-on-write moves now: once this returns they have
            # landed, whichever thread executed them, so the inherited tokens must be there.
            self.kv.apply_pending_copies()
            self.counts["apply"] += 1
            for seq_id, end in zip(seq_ids, ends, strict=True):
                seq = self.live[seq_id]
                check_bytes(self.kv, seq_id, seq.origins, seq.swapped, seq_len=end)
        elif choice < 0.6:
            time.sleep(0)  # "the forward pass": let the other threads run in between
        # Executes the moves still pending, then scatters: one transaction, so no other
        # thread's copy can land on the new tokens afterwards.
        write_tokens(self.kv, slots, origins, positions)
        self.counts["write_kv"] += 1
        for seq_id in seq_ids:
            seq = self.live[seq_id]
            seq.origins = np.concatenate([seq.origins, np.full(n, seq_id, np.int64)])
            self.check(seq_id)

    def fork(self, parent: int) -> None:
        child = next(self.ids)
        self.kv.fork(parent, child)
        self.counts["fork"] += 1
        self.live[child] = Seq(self.live[parent].origins.copy())
        assert self.kv.block_table(child).tolist() == self.kv.block_table(parent).tolist()
        self.check(child)
        # Diverge at once now and then, so that shared partly filled blocks get copied.
        if self.rng.random() < 0.7:
            self.append([child] if self.rng.random() < 0.5 else [child, parent],
                        self.rng.randint(1, 3))

    def swap_out(self, seq_ids: list[int]) -> None:
        before = self.own_state()
        try:
            pairs = self.kv.swap_out(seq_ids)
        except atb_mem.OutOfMemoryError:
            self.counts["oom swap_out"] += 1
            self.unchanged_after_failure(before)
            return
        self.counts["swap_out"] += 1
        assert pairs.ndim == 2 and pairs.shape[1] == 2
        for seq_id in seq_ids:
            self.live[seq_id].swapped = True
            self.check(seq_id)

    def swap_in(self, seq_ids: list[int]) -> None:
        before = self.own_state()
        try:
            pairs = self.kv.swap_in(seq_ids)
        except atb_mem.OutOfMemoryError:
            self.counts["oom swap_in"] += 1
            self.unchanged_after_failure(before)
            return
        self.counts["swap_in"] += 1
        assert pairs.ndim == 2 and pairs.shape[1] == 2
        for seq_id in seq_ids:
            self.live[seq_id].swapped = False
            self.check(seq_id)

    def free(self, seq_id: int) -> None:
        self.kv.free_sequence(seq_id)
        self.counts["free"] += 1
        del self.live[seq_id]
        assert seq_id not in self.kv

    def wrong_state(self) -> None:
        """Calls that are wrong for a sequence's state raise ValueError and change nothing."""
        before = self.own_state()
        device, swapped = self.on_device(), self.swapped()
        kv = self.kv
        calls = []
        if device:
            on = self.rng.choice(device)
            calls.append(lambda: kv.swap_in([on]))
        if swapped:
            off = self.rng.choice(swapped)
            calls += [lambda: kv.swap_out([off]),
                      lambda: kv.append_tokens([off], 1),
                      lambda: kv.slot_mapping([off], [0], [1]),
                      lambda: kv.fork(off, next(self.ids))]
        if not calls:
            return
        with pytest.raises(ValueError):
            self.rng.choice(calls)()
        self.counts["wrong state"] += 1
        self.unchanged_after_failure(before)

    # ---------------------------------------------------------------- loop

    def step(self, step: int) -> None:
        rng = self.rng
        op = rng.choices(
            ["alloc", "alloc_big", "append", "append_big", "fork", "swap_out", "swap_in",
             "apply", "free", "check", "wrong_state"],
            weights=[10, 1, 14, 1, 8, 10, 10, 6, 5, 3, 2],
        )[0]  # fmt: skip
        device, swapped = self.on_device(), self.swapped()
        if op.startswith("alloc") and len(self.live) >= MAX_SEQS_PER_THREAD:
            op = "free"
        if op in ("append", "append_big", "fork", "swap_out") and not device:
            op = "swap_in" if swapped else "alloc"
        if op == "swap_in" and not swapped:
            op = "swap_out" if device else "alloc"
        if op == "free" and not self.live:
            op = "alloc"
        self.counts["op " + op] += 1

        if op == "alloc":
            self.alloc(rng.randint(1, 120))
        elif op == "alloc_big":  # append and write > 4096 tokens at once: GIL released
            self.alloc(rng.randint(BIG, BIG + 200))
        elif op == "append":
            self.append(self.pick(device, 3), rng.randint(1, 20))
        elif op == "append_big":
            ids = self.pick(device, 2)
            self.append(ids, BIG // len(ids) + 1)
        elif op == "fork":
            self.fork(rng.choice(device))
        elif op == "swap_out":
            self.swap_out(self.pick(device, 2))
        elif op == "swap_in":
            self.swap_in(self.pick(swapped, 2))
        elif op == "apply":
            # Executes whatever another thread has pending (it is about to write it anyway):
            # the copies must land exactly once and before that thread's write.
            self.kv.apply_pending_copies()
            self.counts["apply"] += 1
        elif op == "free":
            self.free(rng.choice(list(self.live)))
        elif op == "check":
            self.check_all()
            stats = self.kv.stats()
            assert stats["blocks_used"] + stats["blocks_free"] + stats["blocks_cached"] == (
                NUM_BLOCKS - 1
            )
            assert 0 <= stats["host_blocks_used"] <= NUM_HOST_BLOCKS
        else:
            self.wrong_state()

        # Keep each thread's share bounded: free the longest sequence of a full tier.
        while self.blocks_of(self.on_device()) > MAX_DEVICE_BLOCKS_PER_THREAD:
            self.free(max(self.on_device(), key=lambda i: len(self.live[i].origins)))
        while self.blocks_of(self.swapped()) > MAX_HOST_BLOCKS_PER_THREAD:
            self.free(max(self.swapped(), key=lambda i: len(self.live[i].origins)))
        if step % 10 == 0:
            self.check_all()
        if self.tid == 0 and step % 5 == 0:
            self.kv._check_invariants()
            self.counts["invariant checks"] += 1

    def run(self) -> None:
        try:
            self.barrier.wait(timeout=JOIN_SECONDS)  # all start together
            deadline = time.monotonic() + RUN_SECONDS
            for step in range(STEPS):
                if time.monotonic() > deadline:
                    break
                self.step(step)
                self.counts["steps"] += 1
        except BaseException:
            self.error = f"thread {self.tid}:\n{traceback.format_exc()}"
            self.barrier.abort()

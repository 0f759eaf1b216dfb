"""Eight Python threads hammer one `MemPool` at once.

Each thread, between the same barrier and deadline, mallocs (log-scale sizes, from one byte to
a sizeable share of the pool), writes a byte pattern unique to each of its allocations through
a view (large writes run in numpy without the GIL, so they overlap the other threads' pool
calls), frees by handle and by pointer, re-checks its patterns, reads stats and snapshots,
checks that a freed handle stays stale, and now and then trims the pool (which every malloc
must then transparently take back). OutOfMemoryError is expected and must change nothing the
thread can see. If two threads were ever handed overlapping bytes, one of them would find its
pattern overwritten.

At the end: no thread raised anything else, the live allocations the threads hold are exactly
the pool's snapshot and are disjoint, and once everything is freed the pool is one free range
of the whole capacity again.
"""

from __future__ import annotations

import itertools
import random
import sys
import threading
import time
import traceback

import numpy as np

import atb_mem
from atb_mem import InvalidHandleError, MemPool, OutOfMemoryError

NUM_THREADS = 8
CAPACITY = 8 << 20
ALIGNMENT = 256
STEPS = 4000
RUN_SECONDS = 5.0
JOIN_SECONDS = 30.0
MAX_LIVE_PER_THREAD = 24
MAX_SIZE_BITS = 20  # up to 1 MiB per request, so the pool fills up and OOMs happen


class Worker:
    def __init__(self, pool: MemPool, tid: int, barrier: threading.Barrier) -> None:
        self.pool = pool
        self.tid = tid
        self.barrier = barrier
        self.rng = random.Random(7919 + tid)
        self.live: dict[atb_mem.Allocation, tuple[np.ndarray, int]] = {}
        self.serial = 0
        self.counts = {"malloc": 0, "oom": 0, "free": 0, "check": 0, "stats": 0, "trim": 0}
        self.error: str | None = None

    def fill(self, allocation: atb_mem.Allocation) -> None:
        self.serial += 1
        value = (self.tid * 31 + self.serial) % 255 + 1  # never 0: zeroed memory would show
        view = self.pool.view(allocation, np.uint8)
        view[:] = value
        # The first 8 bytes name the owner exactly.
        view[:8] = np.frombuffer((self.tid << 32 | self.serial).to_bytes(8, "little"), np.uint8)[
            : min(8, view.size)
        ]
        self.live[allocation] = (view, self.serial)

    def verify(self, allocation: atb_mem.Allocation) -> None:
        view, serial = self.live[allocation]
        value = (self.tid * 31 + serial) % 255 + 1
        head = np.frombuffer((self.tid << 32 | serial).to_bytes(8, "little"), np.uint8)
        if view.size > 8 and not (view[8:] == value).all():
            bad = int(np.flatnonzero(view[8:] != value)[0]) + 8
            raise AssertionError(
                f"thread {self.tid}: {allocation!r} overwritten at byte {bad} "
                f"({view[bad]} != {value})"
            )
        if view[:8].tobytes() != head[: min(8, view.size)].tobytes():
            owner = int.from_bytes(view[:8].tobytes().ljust(8, b"\0"), "little")
            raise AssertionError(
                f"thread {self.tid}: {allocation!r} head overwritten (by thread {owner >> 32}?)"
            )

    def size(self) -> int:
        bits = self.rng.randint(0, MAX_SIZE_BITS)
        return self.rng.randint(1, 1 << bits)

    def free_one(self) -> None:
        allocation = self.rng.choice(list(self.live))
        self.verify(allocation)
        del self.live[allocation]
        if self.rng.random() < 0.5:
            self.pool.free(allocation)
        else:
            self.pool.free(allocation.ptr)
        self.counts["free"] += 1
        # A freed handle is stale at once, whatever the other threads do.
        assert not self.pool.owns(allocation)
        try:
            self.pool.free(allocation)
        except InvalidHandleError:
            pass
        else:
            raise AssertionError(f"thread {self.tid}: double free of {allocation!r} succeeded")

    def step(self) -> None:
        op = self.rng.random()
        if op < 0.45:
            if len(self.live) >= MAX_LIVE_PER_THREAD:
                self.free_one()
                return
            size = self.size()
            try:
                allocation = self.pool.malloc(size)
            except OutOfMemoryError as error:
                assert f"requested {size} bytes" in str(error)
                self.counts["oom"] += 1
                for allocation in self.live:  # an OOM touches nobody's bytes
                    self.verify(allocation)
                if self.live:
                    self.free_one()
                return
            assert allocation.size == self.pool.rounded_size(size) >= size
            assert allocation.offset % ALIGNMENT == 0
            assert allocation.ptr == self.pool.base_ptr + allocation.offset
            assert allocation.offset + allocation.size <= CAPACITY
            assert allocation not in self.live
            self.fill(allocation)
            self.counts["malloc"] += 1
        elif op < 0.8:
            if self.live:
                self.free_one()
        elif op < 0.9:
            for allocation in self.live:
                self.verify(allocation)
            self.counts["check"] += 1
        elif op < 0.98:
            stats = self.pool.stats()
            assert (
                stats["allocated_bytes.current"] + stats["free_bytes"]
                == stats["reserved_bytes.current"]
                <= CAPACITY
            )
            assert stats["largest_free"] <= stats["free_bytes"]
            assert 0.0 <= stats["fragmentation"] <= 1.0
            assert 0.0 <= stats["sawicki_fragmentation"] <= 1.0
            assert stats["active_allocations.current"] >= len(self.live)
            mine = {(a.offset, a.size) for a in self.live}
            snapshot = {(s["offset"], s["size"]) for s in self.pool.snapshot()}
            assert mine <= snapshot
            for allocation in self.live:
                assert self.pool.owns(allocation)
            if self.tid == 0:
                self.pool._check_invariants()
            self.counts["stats"] += 1
        else:
            self.pool.trim_to(self.rng.choice([0, CAPACITY // 4, CAPACITY // 2]))
            self.counts["trim"] += 1

    def run(self) -> None:
        try:
            self.barrier.wait()
            deadline = time.monotonic() + RUN_SECONDS
            for _ in range(STEPS):
                if time.monotonic() > deadline:
                    break
                self.step()
            for allocation in self.live:
                self.verify(allocation)
        except BaseException:
            self.error = traceback.format_exc()


def test_threads_share_one_pool() -> None:
    pool = MemPool(CAPACITY, alignment=ALIGNMENT)
    barrier = threading.Barrier(NUM_THREADS)
    workers = [Worker(pool, tid, barrier) for tid in range(NUM_THREADS)]
    threads = [threading.Thread(target=w.run, name=f"mem-pool-{w.tid}") for w in workers]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: interleave the pool calls finely
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + JOIN_SECONDS
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
    finally:
        sys.setswitchinterval(interval)
    assert not any(thread.is_alive() for thread in threads), "a worker hung"
    errors = [w.error for w in workers if w.error]
    assert not errors, "\n".join(errors)

    # Every thread did real work, and the pool was under pressure.
    for w in workers:
        assert w.counts["malloc"] > 20 and w.counts["free"] > 20, (w.tid, w.counts)
    assert sum(w.counts["oom"] for w in workers) > 0

    # What the threads hold is exactly what the pool says is live, and it is disjoint.
    pool._check_invariants()
    held = sorted((a.offset, a.size) for w in workers for a in w.live)
    assert held == [(s["offset"], s["size"]) for s in pool.snapshot()]
    for (offset, size), (next_offset, _) in itertools.pairwise(held):
        assert offset + size <= next_offset
    for w in workers:
        for allocation in w.live:
            w.verify(allocation)

    # Free everything: one free range of the whole capacity again.
    for w in workers:
        for allocation in list(w.live):
            pool.free(allocation)
    pool._check_invariants()
    stats = pool.stats()
    assert len(pool) == 0
    assert stats["allocated_bytes.current"] == stats["requested_bytes.current"] == 0
    assert stats["num_allocs"] == stats["num_frees"] == sum(w.counts["malloc"] for w in workers)
    assert stats["num_ooms"] == sum(w.counts["oom"] for w in workers)
    assert pool.free_ranges() in ([(0, stats["reserved_bytes.current"])], [])
    whole = pool.malloc(CAPACITY)  # takes back whatever a trim gave away
    assert whole.offset == 0
    pool.free(whole)
    assert pool.free_ranges() == [(0, CAPACITY)]
    stats = pool.stats()
    assert stats["free_bytes"] == stats["largest_free"] == stats["reserved_bytes.current"]
    assert stats["free_bytes"] == CAPACITY
    assert stats["fragmentation"] == stats["sawicki_fragmentation"] == 0.0
    pool._check_invariants()
    pool.close()

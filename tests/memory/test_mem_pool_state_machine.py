"""`MemPool` driven by hypothesis against a pure-Python model of its live ranges.

The model is a dict handle -> (offset, size, requested) plus the end of the reserved range
(below the capacity after ``trim_to``). Every live allocation holds a unique byte pattern,
written through a view; after every step every pattern must still be intact, which catches
overlapping allocations and writes that land outside their allocation.

After every step: the pool's invariants hold, live allocations are aligned and disjoint, the
snapshot and free ranges are exactly the model's, the stats agree (allocated + free ==
reserved, largest_free == the largest gap, both fragmentation formulas), and a failed call
changed nothing. A malloc must fail exactly when no gap in the whole capacity fits
``rounded_size(size)`` (or when ``max_allocations`` are live): the pool takes back space it
gave away with ``trim_to`` before it gives up.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import event, note
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

import atb_mem
from atb_mem import InvalidHandleError, MemPool, OutOfMemoryError
from tests.support.state_machine import PoolMachine, machine_settings
from tests.support.unchanged import Snapshot, failed_malloc_counted, mem_pool_snapshot

Span = tuple[int, int, int]  # offset, usable size, requested size


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pattern(seed: int, size: int) -> np.ndarray:
    """Bytes unique to ``seed``: its 8 little-endian bytes, then a seed-dependent ramp."""
    out = ((np.arange(size, dtype=np.uint64) * 131 + seed * 2654435761) % 251).astype(np.uint8)
    head = np.frombuffer(seed.to_bytes(8, "little"), np.uint8)[:size]
    out[: len(head)] = head
    return out


class MemPoolMachine(PoolMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool: MemPool | None = None
        self.live: dict[atb_mem.Allocation, Span] = {}
        self.expected: dict[atb_mem.Allocation, np.ndarray] = {}
        self.views: dict[atb_mem.Allocation, np.ndarray] = {}
        self.stale: list[atb_mem.Allocation] = []
        self.seeds = 0
        self.end = 0
        self.usable = 0
        self.alignment = 0
        self.max_allocations = 0
        self.num_allocs = self.num_frees = self.num_ooms = 0
        self.peak = 0

    # -----------------------------------------------------------------------------------------
    # Model helpers

    def gaps(self, end: int) -> list[tuple[int, int]]:
        """Free ranges of the model in [0, end), in address order."""
        out = []
        cursor = 0
        for offset, size, _ in sorted(self.live.values()):
            if offset > cursor:
                out.append((cursor, offset - cursor))
            cursor = offset + size
        if end > cursor:
            out.append((cursor, end - cursor))
        return out

    def max_request(self) -> int:
        """The largest size `malloc` accepts (larger ones are a ValueError)."""
        assert self.pool is not None
        if self.pool.policy == "ascend":
            return self.usable - 32
        return self.usable

    def observe(self) -> Snapshot:
        assert self.pool is not None
        return mem_pool_snapshot(self.pool)

    def allowed_change(self, before: Snapshot, after: Snapshot, error: BaseException) -> None:
        failed_malloc_counted(before, after, error)

    def write(self, allocation: atb_mem.Allocation) -> None:
        self.seeds += 1
        view = self.views[allocation]
        expected = pattern(self.seeds, view.size)
        view[:] = expected
        self.expected[allocation] = expected

    def forget(self, allocation: atb_mem.Allocation) -> None:
        del self.live[allocation]
        del self.expected[allocation]
        del self.views[allocation]
        self.stale.append(allocation)

    def pick(self, data: st.DataObject) -> atb_mem.Allocation:
        return data.draw(st.sampled_from(sorted(self.live, key=lambda a: a.offset)))

    # -----------------------------------------------------------------------------------------
    # Rules

    @initialize(
        alignment=st.sampled_from([1, 8, 64, 256]),
        policy=st.sampled_from(["default", "ascend"]),
        capacity=st.integers(256, 1 << 16),
        max_allocations=st.sampled_from([4, 16, 65536]),
    )
    def create(self, alignment: int, policy: str, capacity: int, max_allocations: int) -> None:
        self.pool = MemPool(
            capacity, alignment=alignment, policy=policy, max_allocations=max_allocations
        )
        self.alignment = max(alignment, 64) if policy == "ascend" else alignment
        assert self.pool.alignment == self.alignment
        self.usable = capacity // self.alignment * self.alignment
        self.end = self.usable
        self.max_allocations = max_allocations
        note(f"MemPool({capacity}, alignment={alignment}, policy={policy!r}, "
             f"max_allocations={max_allocations})")

    def do_malloc(self, size: int) -> None:
        assert self.pool is not None
        policy = self.pool.policy
        rounded = self.pool.rounded_size(size)
        footprint = cdiv(size, 32) * 32 + 32 if policy == "ascend" else size
        assert rounded == cdiv(footprint, self.alignment) * self.alignment
        fits_reserved = any(gap >= rounded for _, gap in self.gaps(self.end))
        fits_anywhere = any(gap >= rounded for _, gap in self.gaps(self.usable))
        too_many = len(self.live) >= self.max_allocations
        note(f"malloc({size}): rounded {rounded}, gaps {self.gaps(self.usable)}")
        if too_many or not fits_anywhere:
            # Exactness: an OOM exactly when nothing fits (or the handle table is full).
            raised = self.expect_unchanged(OutOfMemoryError, lambda: self.pool.malloc(size),
                                           match=f"requested {size} bytes")
            assert not too_many or "max_allocations" in str(raised)
            self.num_ooms += 1
            event("malloc: OOM (max_allocations)" if too_many else "malloc: OOM")
            return
        allocation = self.pool.malloc(size)
        offset = allocation.offset
        assert allocation.size == rounded
        assert offset % self.alignment == 0
        assert allocation.ptr == self.pool.base_ptr + offset
        # It lies inside one free range of the model: no overlap with anything live.
        limit = self.end if fits_reserved else self.usable
        assert any(
            start <= offset and offset + rounded <= start + gap
            for start, gap in self.gaps(limit)
        ), (offset, rounded, self.gaps(limit))
        if not fits_reserved:
            event("malloc: took trimmed space back")
            self.end = self.usable
        self.live[allocation] = (offset, rounded, size)
        self.views[allocation] = self.pool.view(allocation, np.uint8)
        self.write(allocation)
        self.num_allocs += 1
        self.peak = max(self.peak, sum(s for _, s, _ in self.live.values()))

    @rule(bits=st.integers(0, 17), raw=st.integers(0, 1 << 17))
    def malloc(self, bits: int, raw: int) -> None:
        # Log-scale sizes, from one byte to the whole capacity.
        size = 1 + raw % min(1 << bits, self.max_request())
        self.do_malloc(size)

    @rule(which=st.sampled_from(["largest", "largest+1", "largest-1", "whole", "whole+1"]))
    def malloc_at_the_edge(self, which: str) -> None:
        """Requests right at the size of the largest gap: exactness where it matters."""
        assert self.pool is not None
        gaps = [gap for _, gap in self.gaps(self.usable)]
        largest = max(gaps, default=0)
        padding = 32 if self.pool.policy == "ascend" else 0
        base = {"largest": largest, "largest+1": largest + 1, "largest-1": largest - 1,
                "whole": self.usable, "whole+1": self.usable + 1}[which]
        size = base - padding  # so that "largest" takes exactly the largest gap
        if size < 1:
            return
        if size > self.max_request():
            # A ValueError, not an OutOfMemoryError: no state of the pool could serve it.
            self.expect_unchanged(ValueError, lambda: self.pool.malloc(size),
                                  match="exceeds the pool's capacity")
            return
        self.do_malloc(size)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free_by_handle(self, data: st.DataObject) -> None:
        assert self.pool is not None
        allocation = self.pick(data)
        self.pool.free(allocation)
        self.forget(allocation)
        self.num_frees += 1
        assert not self.pool.owns(allocation)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free_by_ptr(self, data: st.DataObject) -> None:
        assert self.pool is not None
        allocation = self.pick(data)
        self.pool.free(allocation.ptr)
        self.forget(allocation)
        self.num_frees += 1
        assert not self.pool.owns(allocation)

    @precondition(lambda self: self.stale)
    @rule(data=st.data(), by_ptr=st.booleans())
    def free_stale(self, data: st.DataObject, by_ptr: bool) -> None:
        assert self.pool is not None
        allocation = data.draw(st.sampled_from(self.stale))
        live_starts = {offset for offset, _, _ in self.live.values()}
        if by_ptr and allocation.offset in live_starts:
            by_ptr = False  # that pointer belongs to a live allocation now
        assert not self.pool.owns(allocation)
        self.expect_unchanged(InvalidHandleError,
                              lambda: self.pool.free(allocation.ptr if by_ptr else allocation),
                              match="no live allocation" if by_ptr else "already freed")
        self.expect_unchanged(InvalidHandleError, lambda: self.pool.view(allocation, np.uint8))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), offset_units=st.integers(1, 64))
    def free_interior_pointer(self, data: st.DataObject, offset_units: int) -> None:
        assert self.pool is not None
        allocation = self.pick(data)
        if allocation.size < 2:
            return
        inside = min(offset_units, allocation.size - 1)
        self.expect_unchanged(InvalidHandleError, lambda: self.pool.free(allocation.ptr + inside))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def rewrite(self, data: st.DataObject) -> None:
        """A new pattern, through a new view of another dtype (views alias)."""
        assert self.pool is not None
        allocation = self.pick(data)
        self.write(allocation)
        size = allocation.size
        if size % 4 == 0:
            words = self.pool.view(allocation, np.uint32)
            assert words.tobytes() == self.expected[allocation].tobytes()
            words[0] ^= 0xFFFFFFFF
            self.expected[allocation][:4] ^= 0xFF

    @rule(keep=st.integers(0, 1 << 17))
    def trim_to(self, keep: int) -> None:
        assert self.pool is not None
        keep_end = cdiv(keep, self.alignment) * self.alignment
        last_live_end = max((o + s for o, s, _ in self.live.values()), default=0)
        new_end = max(keep_end, last_live_end) if keep_end < self.end else self.end
        released = self.pool.trim_to(keep)
        assert released == self.end - new_end
        if released:
            event("trim_to: released bytes")
        self.end = new_end

    @rule()
    def reset(self) -> None:
        assert self.pool is not None
        self.pool.reset()
        self.num_frees += len(self.live)
        for allocation in list(self.live):
            self.forget(allocation)
        self.end = self.usable
        assert len(self.pool) == 0

    # -----------------------------------------------------------------------------------------
    # Invariants

    @invariant()
    def structure(self) -> None:
        if self.pool is None:
            return
        spans = sorted(self.live.values())
        cursor = 0
        for offset, size, _ in spans:
            assert offset >= cursor, "overlapping allocations"
            assert offset % self.alignment == 0 and size % self.alignment == 0
            cursor = offset + size
        assert cursor <= self.end <= self.usable
        snapshot = self.pool.snapshot()
        base = self.pool.base_ptr
        assert [(s["offset"], s["size"], s["requested"], s["ptr"]) for s in snapshot] == [
            (offset, size, requested, base + offset) for offset, size, requested in spans
        ]
        assert self.pool.free_ranges() == self.gaps(self.end)
        assert len(self.pool) == len(self.live)
        for allocation in self.live:
            assert self.pool.owns(allocation)

    @invariant()
    def stats(self) -> None:
        if self.pool is None:
            return
        stats = self.pool.stats()
        gaps = [gap for _, gap in self.gaps(self.end)]
        allocated = sum(size for _, size, _ in self.live.values())
        assert stats["allocated_bytes.current"] == allocated
        assert stats["requested_bytes.current"] == sum(r for _, _, r in self.live.values())
        assert stats["reserved_bytes.current"] == self.end
        assert stats["reserved_bytes.peak"] == self.usable
        assert stats["free_bytes"] == sum(gaps) == self.end - allocated
        assert stats["allocated_bytes.current"] + stats["free_bytes"] == self.end
        assert stats["largest_free"] == max(gaps, default=0)
        assert stats["free_ranges"] == len(gaps)
        assert stats["active_allocations.current"] == len(self.live)
        assert stats["allocated_bytes.peak"] == self.peak
        assert (stats["num_allocs"], stats["num_frees"], stats["num_ooms"]) == (
            self.num_allocs,
            self.num_frees,
            self.num_ooms,
        )
        total = sum(gaps)
        if total:
            fragmentation = 1 - max(gaps) / total
            sawicki = 1 - math.sqrt(sum(g * g for g in gaps)) / total
        else:
            fragmentation = sawicki = 0.0
        assert math.isclose(stats["fragmentation"], fragmentation, abs_tol=1e-9)
        assert math.isclose(stats["sawicki_fragmentation"], max(sawicki, 0.0), abs_tol=1e-9)

    @invariant()
    def contents(self) -> None:
        """Every live allocation still holds exactly the bytes written into it."""
        for allocation, expected in self.expected.items():
            view = self.views[allocation]
            if not np.array_equal(view, expected):
                bad = int(np.flatnonzero(view != expected)[0])
                raise AssertionError(
                    f"{allocation!r} was overwritten at byte {bad}; "
                    f"live: {sorted(self.live.values())}"
                )

    def teardown(self) -> None:
        if self.pool is not None:
            for allocation in list(self.live):
                self.pool.free(allocation)
                self.forget(allocation)
            assert self.pool.free_ranges() == self.gaps(self.end)
            self.pool._check_invariants()
            self.pool.close()


MemPoolMachine.TestCase.settings = machine_settings(max_examples=100)
TestMemPoolStateMachine = MemPoolMachine.TestCase

"""`MemPool` over its life: trim_to, reset and close; and what it reports: stats, snapshot,
free ranges, memory_summary."""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import numpy as np
import pytest

from atb_mem import InvalidHandleError, MemPool, OutOfMemoryError
from tests.memory.mem_pool_helpers import KiB, MiB, check_tiling
from tests.support.unchanged import assert_unchanged, failed_malloc_counted, mem_pool_snapshot

# ---------------------------------------------------------------------------------------------
# trim_to, reset, close


def test_trim_and_regrow() -> None:
    pool = MemPool(64 * KiB)
    a = pool.malloc(1000)  # [0, 1024)
    stats = pool.stats()
    assert stats["reserved_bytes.current"] == 64 * KiB
    released = pool.trim_to(0)  # keeps up to the last live allocation
    assert released == 64 * KiB - 1024
    stats = pool.stats()
    assert stats["reserved_bytes.current"] == 1024
    assert stats["reserved_bytes.peak"] == 64 * KiB
    assert stats["free_bytes"] == 0 and stats["free_ranges"] == 0
    assert pool.free_ranges() == []
    check_tiling(pool)
    assert pool.trim_to(0) == 0  # nothing left to release
    # A malloc that needs the space takes it back.
    b = pool.malloc(5000)
    assert b.offset == 1024
    stats = pool.stats()
    assert stats["reserved_bytes.current"] == 64 * KiB
    assert pool.free_ranges() == [(1024 + 5056, 64 * KiB - 1024 - 5056)]
    check_tiling(pool)
    # trim_to keeps at least min_bytes_to_keep, rounded up to the alignment.
    released = pool.trim_to(10_000)
    assert released == 64 * KiB - 10_048
    assert pool.stats()["reserved_bytes.current"] == 10_048
    assert pool.free_ranges() == [(6080, 10_048 - 6080)]
    # A malloc that fits in what is kept does not regrow.
    c = pool.malloc(64)
    assert c.offset == 6080
    assert pool.stats()["reserved_bytes.current"] == 10_048
    # Freeing in the middle does not let trim_to release anything below a live allocation.
    pool.free(a)
    assert pool.trim_to(0) == 10_048 - 6144
    assert pool.free_ranges() == [(0, 1024)]
    assert pool.stats()["reserved_bytes.current"] == 6144
    # trim_to above the current end changes nothing (it does not regrow).
    assert pool.trim_to(1 * MiB) == 0
    assert pool.stats()["reserved_bytes.current"] == 6144
    pool._check_invariants()
    pool.free(b)
    pool.free(c)
    assert pool.trim_to(0) == 6144
    assert pool.stats()["reserved_bytes.current"] == 0
    assert pool.free_ranges() == []
    whole = pool.malloc(64 * KiB)
    assert whole.offset == 0
    pool.free(whole)
    assert pool.free_ranges() == [(0, 64 * KiB)]
    pool._check_invariants()


def test_oom_after_regrow_restores_the_trim() -> None:
    pool = MemPool(16 * KiB)
    a = pool.malloc(4 * KiB)
    pool.trim_to(0)
    assert_unchanged(lambda: mem_pool_snapshot(pool), OutOfMemoryError,
                     lambda: pool.malloc(12 * KiB + 1), match="requested 12289 bytes",
                     allow=failed_malloc_counted)
    b = pool.malloc(12 * KiB)  # exactly the rest of the capacity
    assert b.offset == 4 * KiB
    pool.free(a)
    pool.free(b)
    pool._check_invariants()


def test_reset_makes_handles_stale() -> None:
    pool = MemPool(64 * KiB)
    old = [pool.malloc(n) for n in (10, 2000, 64, 30_000)]
    pool.free(old[1])
    pool.trim_to(0)
    pool.reset()
    stats = pool.stats()
    assert len(pool) == 0
    assert stats["num_allocs"] == 4 and stats["num_frees"] == 4
    assert stats["allocated_bytes.current"] == stats["requested_bytes.current"] == 0
    assert stats["allocated_bytes.peak"] == 64 + 2048 + 64 + 30_016
    assert stats["reserved_bytes.current"] == 64 * KiB  # reset undoes the trim
    assert pool.free_ranges() == [(0, 64 * KiB)]
    for a in old:
        assert not pool.owns(a)
        with pytest.raises(InvalidHandleError):
            pool.free(a)
        with pytest.raises(InvalidHandleError):
            pool.free(a.ptr)
        with pytest.raises(InvalidHandleError):
            pool.view(a, np.uint8)
    # New allocations land where the old ones were; the old handles stay stale.
    new = pool.malloc(10)
    assert new.offset == old[0].offset
    assert new != old[0]
    with pytest.raises(InvalidHandleError, match="already freed"):
        pool.free(old[0])
    assert pool.owns(new)
    pool.free(new)
    assert pool.stats()["num_frees"] == 5
    pool._check_invariants()


def test_close() -> None:
    pool = MemPool(64 * KiB)
    a = pool.malloc(100)
    region = pool.backing
    base = pool.base_ptr
    pool.close()
    assert pool.closed
    assert "closed" in repr(pool)
    assert pool.base_ptr == base
    calls: list[Callable[[], object]] = [
        lambda: pool.malloc(1),
        lambda: pool.free(a),
        lambda: pool.free(a.ptr),
        lambda: pool.view(a, np.uint8),
        lambda: pool.reset(),
        lambda: pool.trim_to(0),
        lambda: pool.stats(),
        lambda: pool.snapshot(),
        lambda: pool.free_ranges(),
        lambda: pool.rounded_size(1),
        lambda: pool._check_invariants(),
        lambda: len(pool),
        lambda: pool.capacity,
        lambda: pool.alignment,
        lambda: pool.policy,
        lambda: pool.backing,
        lambda: pool.memory_summary(),
    ]
    for call in calls:
        with pytest.raises(InvalidHandleError, match="closed"):
            call()
    pool.close()  # idempotent
    assert pool.closed
    assert region.nbytes == 64 * KiB  # the region object itself is still fine


def test_owns_after_close_raises() -> None:
    """`_core.pyi`: 'After close() every call raises InvalidHandleError' -- owns() included."""
    pool = MemPool(4096)
    a = pool.malloc(1)
    pool.close()
    with pytest.raises(InvalidHandleError, match="closed"):
        pool.owns(a)


def test_context_manager_closes() -> None:
    with MemPool(4096) as pool:
        a = pool.malloc(64)
        view = pool.view(a, np.uint8)
        view[:] = 1
    assert pool.closed
    assert (view == 1).all()


# ---------------------------------------------------------------------------------------------
# stats, snapshot, free_ranges, memory_summary


def independent_fragmentation(free_ranges: list[tuple[int, int]]) -> tuple[float, float]:
    sizes = [size for _, size in free_ranges]
    total = sum(sizes)
    if total == 0:
        return 0.0, 0.0
    return 1 - max(sizes) / total, 1 - math.sqrt(sum(s * s for s in sizes)) / total


def test_stats_snapshot_free_ranges_agree() -> None:
    pool = MemPool(256 * KiB, alignment=128)
    requested = [1, 100, 128, 129, 5000, 777, 64 * KiB, 3, 20_000, 1000]
    allocs = [pool.malloc(n) for n in requested]
    for i in (1, 3, 4, 7, 9):
        pool.free(allocs[i] if i % 2 else allocs[i].ptr)
    live = [allocs[i] for i in (0, 2, 5, 6, 8)]
    live_requested = [requested[i] for i in (0, 2, 5, 6, 8)]
    stats = pool.stats()
    snap = pool.snapshot()
    free = pool.free_ranges()
    assert [s["offset"] for s in snap] == sorted(a.offset for a in live)
    assert {(s["offset"], s["size"], s["ptr"]) for s in snap} == {
        (a.offset, a.size, a.ptr) for a in live
    }
    assert sorted(s["requested"] for s in snap) == sorted(live_requested)
    assert free == sorted(free)
    assert len(free) >= 2  # the layout is fragmented
    check_tiling(pool)
    free_bytes = sum(size for _, size in free)
    assert stats["free_bytes"] == free_bytes
    assert stats["largest_free"] == max(size for _, size in free)
    assert stats["free_ranges"] == len(free)
    assert stats["allocated_bytes.current"] == sum(s["size"] for s in snap)
    assert stats["requested_bytes.current"] == sum(live_requested)
    assert stats["allocated_bytes.current"] + stats["free_bytes"] == stats["reserved_bytes.current"]
    assert stats["reserved_bytes.current"] == 256 * KiB
    assert stats["allocated_bytes.peak"] == sum(pool.rounded_size(n) for n in requested)
    assert stats["active_allocations.current"] == len(live) == len(pool)
    assert (stats["num_allocs"], stats["num_frees"], stats["num_ooms"]) == (10, 5, 0)
    fragmentation, sawicki = independent_fragmentation(free)
    assert stats["fragmentation"] == pytest.approx(fragmentation, abs=1e-12)
    assert stats["sawicki_fragmentation"] == pytest.approx(sawicki, abs=1e-12)
    assert 0 < stats["fragmentation"] < 1
    assert 0 < stats["sawicki_fragmentation"] < 1
    assert (stats["capacity"], stats["alignment"], stats["policy"]) == (256 * KiB, 128, "default")
    pool._check_invariants()


def test_fragmentation_of_equal_ranges() -> None:
    pool = MemPool(8 * 64)
    allocs = [pool.malloc(64) for _ in range(8)]
    for i in (0, 2, 4, 6):
        pool.free(allocs[i])
    stats = pool.stats()
    assert stats["free_ranges"] == 4
    assert stats["fragmentation"] == pytest.approx(0.75)
    assert stats["sawicki_fragmentation"] == pytest.approx(0.5)  # 1 - sqrt(4)/4
    pool.free(allocs[7])
    pool.free(allocs[5])
    pool.free(allocs[3])
    pool.free(allocs[1])
    stats = pool.stats()
    assert stats["fragmentation"] == stats["sawicki_fragmentation"] == 0.0
    pool.malloc(8 * 64)
    stats = pool.stats()
    assert stats["free_bytes"] == 0
    assert stats["fragmentation"] == stats["sawicki_fragmentation"] == 0.0


def test_memory_summary() -> None:
    pool = MemPool(1 * MiB, alignment=256, max_allocations=100)
    big = pool.malloc(300 * KiB)
    pool.malloc(1000)
    pool.free(pool.malloc(10))
    with pytest.raises(OutOfMemoryError):
        pool.malloc(800 * KiB)
    summary = pool.memory_summary()
    assert isinstance(summary, str)
    lines = summary.splitlines()
    assert lines[0] == "MemPool memory summary"
    expected = [
        r"^capacity\s+1\.00 MiB$",
        r"^reserved \(current / peak\)\s+1\.00 MiB / 1\.00 MiB$",
        r"^allocated \(current / peak\)\s+301\.00 KiB / 301\.25 KiB$",
        r"^requested \(current\)\s+300\.98 KiB$",
        r"^free / largest free range\s+723\.00 KiB / 723\.00 KiB$",
        r"^free ranges\s+1$",
        r"^fragmentation \(1 - largest/free\)\s+0\.0000$",
        r"^fragmentation \(Sawicki\)\s+0\.0000$",
        r"^live allocations\s+2 \(max 100\)$",
        r"^mallocs / frees / OOMs\s+3 / 1 / 1$",
        r"^alignment / policy\s+256 / default$",
        r"^largest live allocations:$",
        rf"^  offset\s+{big.offset}\s+size\s+300\.00 KiB$",
    ]
    for pattern in expected:
        assert any(re.match(pattern, line) for line in lines), (pattern, summary)
    assert "requested (current)" in summary
    empty = MemPool(4096).memory_summary()
    assert "largest live allocations" not in empty

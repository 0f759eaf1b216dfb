"""`MemPool`, call by call: rounding and alignment, pointers, views, trim/reset/close, stats,
the `acl` names, `KVCachePool(pool=...)`, and a table of every bad input (each must raise the
right exception with a useful message and leave the pool exactly as it was).
"""

from __future__ import annotations

import gc
import itertools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import atb_mem
from atb_mem import InvalidHandleError, MemPool, OutOfMemoryError, acl

KiB = 1024
MiB = 1024 * KiB


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def full_snapshot(pool: MemPool) -> dict[str, Any]:
    """Everything observable about a pool, for 'a failed call changed nothing' checks."""
    return {
        "stats": pool.stats(),
        "snapshot": pool.snapshot(),
        "free_ranges": pool.free_ranges(),
        "len": len(pool),
    }


def expected_rounding(n: int, alignment: int, policy: str) -> int:
    footprint = cdiv(n, 32) * 32 + 32 if policy == "ascend" else n
    return cdiv(footprint, alignment) * alignment


def check_tiling(pool: MemPool) -> None:
    """Live allocations and free ranges tile [0, reserved) exactly, in address order."""
    pieces = [(a["offset"], a["size"], "used") for a in pool.snapshot()]
    pieces += [(offset, size, "free") for offset, size in pool.free_ranges()]
    pieces.sort()
    cursor = 0
    previous = None
    for offset, size, kind in pieces:
        assert offset == cursor, pieces
        assert size > 0
        assert not (kind == "free" and previous == "free"), "adjacent free ranges not merged"
        cursor, previous = offset + size, kind
    assert cursor == pool.stats()["reserved_bytes.current"]


# ---------------------------------------------------------------------------------------------
# Construction and basic properties


def test_defaults() -> None:
    pool = MemPool(1 * MiB)
    assert isinstance(pool, atb_mem._core.MemPool)
    assert pool.capacity == 1 * MiB
    assert pool.alignment == 64
    assert pool.policy == "default"
    assert isinstance(pool.backing, atb_mem.HostRegion)
    assert pool.backing.nbytes >= pool.capacity
    assert pool.base_ptr == pool.backing.ptr != 0
    assert pool.base_ptr % 4096 == 0
    assert not pool.closed
    assert len(pool) == 0
    assert pool.snapshot() == []
    assert pool.free_ranges() == [(0, 1 * MiB)]
    stats = pool.stats()
    assert stats == {
        "capacity": 1 * MiB,
        "alignment": 64,
        "policy": "default",
        "allocated_bytes.current": 0,
        "allocated_bytes.peak": 0,
        "requested_bytes.current": 0,
        "reserved_bytes.current": 1 * MiB,
        "reserved_bytes.peak": 1 * MiB,
        "active_allocations.current": 0,
        "free_bytes": 1 * MiB,
        "largest_free": 1 * MiB,
        "free_ranges": 1,
        "fragmentation": 0.0,
        "sawicki_fragmentation": 0.0,
        "num_allocs": 0,
        "num_frees": 0,
        "num_ooms": 0,
        "max_allocations": 65536,
    }
    pool._check_invariants()
    assert "MemPool(" in repr(pool)


def test_capacity_not_a_multiple_of_the_alignment_manages_whole_units() -> None:
    pool = MemPool(1000, alignment=64)
    assert pool.capacity == 1000
    usable = (1000 // 64) * 64
    assert pool.free_ranges() == [(0, usable)]
    assert pool.stats()["reserved_bytes.current"] == usable
    a = pool.malloc(usable)
    assert (a.offset, a.size) == (0, usable)
    with pytest.raises(ValueError, match="exceeds the pool's capacity"):
        pool.malloc(usable + 1)
    pool.free(a)
    pool._check_invariants()


def test_largest_capacity_offsets_only() -> None:
    pool = MemPool(2**48, backing=None)
    a = pool.malloc(2**47)
    b = pool.malloc(2**47)
    assert (a.offset, b.offset) == (0, 2**47)
    assert pool.stats()["free_bytes"] == 0
    pool.free(a)
    pool.free(b.ptr)
    assert pool.free_ranges() == [(0, 2**48)]


# ---------------------------------------------------------------------------------------------
# Rounding, alignment, pointers


@pytest.mark.parametrize("alignment", [1, 2, 8, 64, 256, 4096])
def test_every_offset_is_aligned_and_sizes_round_up(alignment: int) -> None:
    pool = MemPool(1 * MiB, alignment=alignment)
    assert pool.alignment == alignment
    sizes = [1, 2, 3, 7, 63, 64, 65, 100, 127, 128, 129, 1000, 4095, 4096, 4097, 12345]
    allocations = []
    for n in sizes:
        expected = expected_rounding(n, alignment, "default")
        assert pool.rounded_size(n) == expected
        a = pool.malloc(n)
        assert a.size == expected >= n
        assert a.offset % alignment == 0
        assert a.ptr == pool.base_ptr + a.offset
        assert a.ptr % alignment == 0
        allocations.append(a)
    # Disjoint, and the snapshot agrees with the handles.
    spans = sorted((a.offset, a.offset + a.size) for a in allocations)
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end <= start
    snap = pool.snapshot()
    assert [(s["offset"], s["size"], s["ptr"]) for s in snap] == sorted(
        (a.offset, a.size, a.ptr) for a in allocations
    )
    assert sorted(s["requested"] for s in snap) == sorted(sizes)
    stats = pool.stats()
    assert stats["allocated_bytes.current"] == sum(a.size for a in allocations)
    assert stats["requested_bytes.current"] == sum(sizes)
    check_tiling(pool)
    pool._check_invariants()


@pytest.mark.parametrize(
    ("alignment", "n", "expected"),
    [
        (64, 1, 64),
        (64, 31, 64),
        (64, 32, 64),
        (64, 33, 128),
        (64, 96, 128),
        (64, 97, 192),
        (64, 100, 192),
        (64, 160, 192),
        (64, 161, 256),
        (64, 1024, 1088),
        (128, 100, 256),
        (128, 96, 128),
        (1, 100, 192),  # the alignment is forced up to 64 under "ascend"
        (32, 1, 64),
    ],
)
def test_ascend_rounding(alignment: int, n: int, expected: int) -> None:
    pool = MemPool(64 * KiB, alignment=alignment, policy="ascend")
    assert pool.policy == "ascend"
    assert pool.alignment == max(alignment, 64)
    assert pool.rounded_size(n) == expected == expected_rounding(n, pool.alignment, "ascend")
    a = pool.malloc(n)
    assert a.size == expected
    assert a.offset % 64 == 0
    b = pool.malloc(n)
    assert b.offset == a.offset + expected or a.offset == b.offset + expected
    assert pool.snapshot()[0]["requested"] == n


def test_ascend_largest_request_is_capacity_minus_padding() -> None:
    pool = MemPool(4096, policy="ascend")
    a = pool.malloc(4096 - 32)
    assert a.size == 4096
    pool.free(a)
    with pytest.raises(ValueError, match="Ascend's 32-byte padding"):
        pool.malloc(4096 - 31)


def test_ptr_arithmetic_and_free_by_pointer() -> None:
    pool = MemPool(64 * KiB, alignment=256)
    a = pool.malloc(300)
    b = pool.malloc(10)
    c = pool.malloc(5000)
    for x in (a, b, c):
        assert x.ptr - pool.base_ptr == x.offset
    assert b.offset == a.offset + 512
    pool.free(b.ptr)  # a plain int
    assert not pool.owns(b)
    pool.free(np.uint64(c.ptr))  # numpy integers are ints too
    pool.free(np.int64(a.ptr))
    assert len(pool) == 0
    assert pool.free_ranges() == [(0, 64 * KiB)]
    assert pool.stats()["num_frees"] == 3


def test_allocation_handles_are_values() -> None:
    pool = MemPool(4096)
    a = pool.malloc(10)
    b = pool.malloc(10)
    assert a == a and a != b
    assert len({a, b, a}) == 2
    assert pool.owns(a) and pool.owns(b)
    assert re.search(r"Allocation\(offset=0, size=64, ptr=0x[0-9a-f]+\)", repr(a))
    pool.free(a)
    assert not pool.owns(a)
    # A new allocation at the same offset is a different handle.
    c = pool.malloc(10)
    assert c.offset == a.offset
    assert c != a
    assert pool.owns(c) and not pool.owns(a)
    with pytest.raises(InvalidHandleError, match="already freed"):
        pool.free(a)
    assert pool.owns(c)


def test_exact_fit_and_oom_message() -> None:
    """Allocation fails only when no free range fits; the message has the numbers."""
    pool = MemPool(64 * 64, alignment=64)  # 64 units
    allocs = [pool.malloc(64) for _ in range(64)]
    # Free ranges of 1, 2 and 3 units, separated by live allocations.
    for i in (1, 3, 4, 6, 7, 8):
        pool.free(allocs[i])
    assert pool.free_ranges() == [(64, 64), (192, 128), (384, 192)]
    stats = pool.stats()
    assert (stats["free_bytes"], stats["largest_free"]) == (384, 192)
    with pytest.raises(OutOfMemoryError) as info:
        pool.malloc(193)
    assert isinstance(info.value, MemoryError)
    assert isinstance(info.value, atb_mem.AtbMemError)
    message = str(info.value)
    assert "requested 193 bytes" in message
    assert "384 bytes free" in message
    assert "largest free range 192 bytes" in message
    assert pool.stats()["num_ooms"] == 1
    exact = pool.malloc(192)  # exactly the largest range: must succeed
    assert (exact.offset, exact.size) == (384, 192)
    two = pool.malloc(128)
    assert two.offset == 192
    one = pool.malloc(1)
    assert one.offset == 64
    assert pool.free_ranges() == []
    with pytest.raises(OutOfMemoryError, match="0 bytes free"):
        pool.malloc(1)
    pool._check_invariants()


def test_free_merges_neighbours() -> None:
    pool = MemPool(4 * 64)
    a, b, c, d = (pool.malloc(64) for _ in range(4))
    pool.free(a)
    pool.free(c)
    assert pool.free_ranges() == [(0, 64), (128, 64)]
    pool.free(b)  # merges with both neighbours
    assert pool.free_ranges() == [(0, 192)]
    pool.free(d)
    assert pool.free_ranges() == [(0, 256)]
    pool._check_invariants()


def test_max_allocations() -> None:
    pool = MemPool(64 * KiB, max_allocations=3)
    assert pool.stats()["max_allocations"] == 3
    live = [pool.malloc(1) for _ in range(3)]
    before = full_snapshot(pool)
    with pytest.raises(OutOfMemoryError, match="max_allocations"):
        pool.malloc(1)
    after = full_snapshot(pool)
    assert after["stats"]["num_ooms"] == before["stats"]["num_ooms"] + 1
    after["stats"]["num_ooms"] -= 1
    assert after == before
    pool.free(live[1])
    assert pool.malloc(1).offset == live[1].offset


# ---------------------------------------------------------------------------------------------
# Views


def test_views_write_through_and_alias() -> None:
    pool = MemPool(64 * KiB)
    a = pool.malloc(256)
    b = pool.malloc(256)
    va = pool.view(a, np.uint8)
    assert isinstance(va, np.ndarray)
    assert va.shape == (256,) and va.dtype == np.uint8
    assert not va.any()  # host regions start zeroed
    assert va.ctypes.data == a.ptr
    va[:] = 0xAB
    again = pool.view(a, np.uint8)
    assert (again == 0xAB).all()  # writes go through to the pool's bytes
    floats = pool.view(a, np.float32, (8, 8))
    assert floats.shape == (8, 8) and floats.dtype == np.float32
    assert floats.ctypes.data == a.ptr
    floats[:] = 1.5
    assert (pool.view(a, np.float32)[:64] == 1.5).all()
    assert np.shares_memory(floats, again)
    assert again[:4].tobytes() == np.float32(1.5).tobytes()
    # The neighbour is untouched.
    assert not pool.view(b, np.uint8).any()
    # Default shape: as many items as fit; an int shape; a partial view; a 0-d view.
    assert pool.view(a, np.float64).shape == (32,)
    assert pool.view(a, "V3").shape == (85,)
    assert pool.view(a, np.int16, 10).shape == (10,)
    assert pool.view(a, np.int32, []).shape == ()
    assert pool.view(a, np.uint8, [np.int64(2), 128]).shape == (2, 128)
    backing = pool.backing
    assert np.shares_memory(va, backing.view(a.offset, a.size, np.uint8))


def test_view_keeps_the_region_alive() -> None:
    pool = MemPool(64 * KiB)
    a = pool.malloc(4096)
    view = pool.view(a, np.int64)
    view[:] = np.arange(512)
    pool.close()
    assert pool.closed
    assert (view == np.arange(512)).all()
    del pool
    gc.collect()
    assert (view == np.arange(512)).all()
    view[:] = -7  # still writable, still valid memory
    assert (view == -7).all()
    assert int(view.sum()) == -7 * 512


def test_view_outlives_the_pool_after_del() -> None:
    def make() -> np.ndarray:
        pool = MemPool(1 * MiB)
        return pool.view(pool.malloc(1 * MiB), np.uint8)

    view = make()
    gc.collect()
    view[:] = 3
    assert int(view.sum(dtype=np.int64)) == 3 * MiB


def test_offsets_only_pool() -> None:
    pool = MemPool(1 * MiB, backing=None)
    assert pool.backing is None
    assert pool.base_ptr == 0
    a = pool.malloc(100)
    b = pool.malloc(100)
    assert (a.ptr, b.ptr) == (a.offset, b.offset) == (0, 128)
    before = full_snapshot(pool)
    with pytest.raises(ValueError, match="offsets-only"):
        pool.view(a, np.uint8)
    assert full_snapshot(pool) == before
    pool.free(b.offset)  # the pointer is the offset
    pool.free(a)
    assert pool.free_ranges() == [(0, 1 * MiB)]


def test_host_region_as_backing() -> None:
    region = atb_mem.HostRegion(16 * KiB)
    pool = MemPool(16 * KiB, backing=region)
    assert pool.backing is region
    assert pool.base_ptr == region.ptr
    a = pool.malloc(100)
    b = pool.malloc(100)
    pool.view(b, np.uint8)[:] = 9
    raw = region.view(0, 16 * KiB, np.uint8)
    assert (raw[b.offset : b.offset + b.size] == 9).all()
    assert not raw[a.offset : a.offset + a.size].any()


class ArrayBacking:
    """A backing object over a numpy array, as a device backing would plug in."""

    def __init__(self, nbytes: int) -> None:
        self.array = np.zeros(nbytes, np.uint8)
        self.calls: list[tuple[int, int]] = []

    def __repr__(self) -> str:
        return f"ArrayBacking({self.nbytes})"

    @property
    def ptr(self) -> int:
        return int(self.array.ctypes.data)

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    def view(self, offset: int, nbytes: int, dtype: Any, shape: Any) -> np.ndarray:
        self.calls.append((offset, nbytes))
        return self.array[offset : offset + nbytes].view(dtype).reshape(shape)


def test_custom_backing_object() -> None:
    backing = ArrayBacking(8 * KiB)
    pool = MemPool(8 * KiB, backing=backing)
    assert pool.backing is backing
    assert pool.base_ptr == backing.ptr
    a = pool.malloc(64)
    b = pool.malloc(200)
    view = pool.view(b, np.float32, (2, 25))
    assert backing.calls == [(b.offset, 200)]
    view[:] = 2.0
    assert (backing.array[b.offset : b.offset + 200].view(np.float32) == 2.0).all()
    assert not backing.array[a.offset : a.offset + a.size].any()
    pool.free(b.ptr)
    with pytest.raises(ValueError, match="less than the capacity"):
        MemPool(8 * KiB + 1, backing=backing)


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
    before = full_snapshot(pool)
    with pytest.raises(OutOfMemoryError, match="requested 12289 bytes"):
        pool.malloc(12 * KiB + 1)
    after = full_snapshot(pool)
    assert after["stats"]["num_ooms"] == before["stats"]["num_ooms"] + 1
    after["stats"]["num_ooms"] -= 1
    assert after == before
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


# ---------------------------------------------------------------------------------------------
# acl


def test_acl_end_to_end() -> None:
    pool = acl.aclrtMemPoolCreate({"maxSize": 1 * MiB})
    assert isinstance(pool, MemPool)
    assert pool.policy == "ascend" and pool.alignment == 64
    assert pool.capacity == 1 * MiB
    get = acl.aclrtMemPoolGetAttr
    assert acl.ACL_RT_MEM_POOL_ATTR_RELEASE_THRESHOLD == 0x4
    assert acl.ACL_RT_MEM_POOL_ATTR_RESERVED_MEM_CURRENT == 0x5
    assert acl.ACL_RT_MEM_POOL_ATTR_RESERVED_MEM_HIGH == 0x6
    assert acl.ACL_RT_MEM_POOL_ATTR_USED_MEM_CURRENT == 0x7
    assert acl.ACL_RT_MEM_POOL_ATTR_USED_MEM_HIGH == 0x8

    p1 = acl.aclrtMemPoolMalloc(pool, 100)
    p2 = acl.aclrtMemPoolMalloc(pool, 256 * KiB)
    assert isinstance(p1, int) and isinstance(p2, int)
    assert p1 == pool.base_ptr
    assert p2 == p1 + 192  # ALIGN_UP(100, 32) + 32 = 160, from a 64-byte boundary
    used = 192 + (256 * KiB + 32 + 32)
    assert get(pool, acl.ACL_RT_MEM_POOL_ATTR_USED_MEM_CURRENT) == used
    assert get(pool, acl.ACL_RT_MEM_POOL_ATTR_USED_MEM_HIGH) == used
    assert get(pool, acl.ACL_RT_MEM_POOL_ATTR_RESERVED_MEM_CURRENT) == 1 * MiB
    acl.aclrtMemPoolFree(pool, p2)
    assert get(pool, acl.ACL_RT_MEM_POOL_ATTR_USED_MEM_CURRENT) == 192
    assert get(pool, acl.ACL_RT_MEM_POOL_ATTR_USED_MEM_HIGH) == used
    with pytest.raises(InvalidHandleError):
        acl.aclrtMemPoolFree(pool, p2)  # double free raises instead of returning a code
    with pytest.raises(OutOfMemoryError):
        acl.aclrtMemPoolMalloc(pool, 1 * MiB - 64)

    assert acl.aclrtMemPoolTrimTo(pool, 4096) is None
    assert get(pool, acl.ACL_RT_MEM_POOL_ATTR_RESERVED_MEM_CURRENT) == 4096
    assert get(pool, acl.ACL_RT_MEM_POOL_ATTR_RESERVED_MEM_HIGH) == 1 * MiB
    p3 = acl.aclrtMemPoolMalloc(pool, 512 * KiB)  # regrows
    assert get(pool, acl.ACL_RT_MEM_POOL_ATTR_RESERVED_MEM_CURRENT) == 1 * MiB
    acl.aclrtMemPoolFree(pool, p3)

    assert get(pool, acl.ACL_RT_MEM_POOL_ATTR_RELEASE_THRESHOLD) == 0
    assert acl.aclrtMemPoolSetAttr(pool, acl.ACL_RT_MEM_POOL_ATTR_RELEASE_THRESHOLD, 1234) is None
    assert get(pool, acl.ACL_RT_MEM_POOL_ATTR_RELEASE_THRESHOLD) == 1234
    assert pool.release_threshold == 1234

    acl.aclrtMemPoolFree(pool, p1)
    assert get(pool, acl.ACL_RT_MEM_POOL_ATTR_USED_MEM_CURRENT) == 0
    acl.aclrtMemPoolDestroy(pool)
    assert pool.closed
    with pytest.raises(InvalidHandleError):
        acl.aclrtMemPoolMalloc(pool, 1)
    with pytest.raises(InvalidHandleError):
        acl.aclrtMemPoolGetAttr(pool, acl.ACL_RT_MEM_POOL_ATTR_USED_MEM_CURRENT)
    acl.aclrtMemPoolDestroy(pool)  # idempotent, like close()


def test_acl_create_forms_and_options() -> None:
    pool = acl.aclrtMemPoolCreate(64 * KiB, alignment=256, max_allocations=8)
    assert (pool.capacity, pool.alignment, pool.policy) == (64 * KiB, 256, "ascend")
    assert pool.stats()["max_allocations"] == 8
    default = acl.aclrtMemPoolCreate({"maxSize": 4096}, policy="default", backing=None)
    assert default.policy == "default" and default.backing is None
    assert acl.aclrtMemPoolMalloc(default, 1) == 0


@pytest.mark.parametrize(
    ("call", "exc", "fragment"),
    [
        (lambda p: acl.aclrtMemPoolCreate({}), ValueError, "maxSize"),
        (lambda p: acl.aclrtMemPoolCreate({"maxSize": 0}), ValueError, "capacity"),
        (lambda p: acl.aclrtMemPoolMalloc(object(), 1), TypeError, "aclrtMemPoolCreate"),
        (lambda p: acl.aclrtMemPoolFree("pool", 1), TypeError, "aclrtMemPoolCreate"),
        (lambda p: acl.aclrtMemPoolDestroy(None), TypeError, "aclrtMemPoolCreate"),
        (lambda p: acl.aclrtMemPoolTrimTo(1, 1), TypeError, "aclrtMemPoolCreate"),
        (lambda p: acl.aclrtMemPoolGetAttr(1, 0x7), TypeError, "aclrtMemPoolCreate"),
        (lambda p: acl.aclrtMemPoolSetAttr(1, 0x4, 1), TypeError, "aclrtMemPoolCreate"),
        (lambda p: acl.aclrtMemPoolMalloc(p, 0), ValueError, "at least 1"),
        (lambda p: acl.aclrtMemPoolFree(p, p.base_ptr + 64), InvalidHandleError, "no live"),
        (lambda p: acl.aclrtMemPoolTrimTo(p, -1), ValueError, "at least 0"),
        (lambda p: acl.aclrtMemPoolGetAttr(p, 0x9), ValueError, "unknown memory-pool attr"),
        (lambda p: acl.aclrtMemPoolSetAttr(p, 0x5, 1), ValueError, "cannot be set"),
        (lambda p: acl.aclrtMemPoolSetAttr(p, 0x4, -1), ValueError, "threshold"),
        (lambda p: acl.aclrtMemPoolSetAttr(p, 0x4, True), ValueError, "threshold"),
        (lambda p: acl.aclrtMemPoolSetAttr(p, 0x4, 1.5), ValueError, "threshold"),
    ],
)
def test_acl_bad_input(call: Callable[[MemPool], object], exc: type, fragment: str) -> None:
    pool = acl.aclrtMemPoolCreate({"maxSize": 64 * KiB})
    acl.aclrtMemPoolMalloc(pool, 100)
    before = full_snapshot(pool)
    threshold = pool.release_threshold
    with pytest.raises(exc, match=re.escape(fragment)):
        call(pool)
    assert full_snapshot(pool) == before
    assert pool.release_threshold == threshold


def test_acl_attributes_after_destroy_raise() -> None:
    """`aclrtMemPoolDestroy`: 'later calls on it raise' -- the release threshold too."""
    pool = acl.aclrtMemPoolCreate({"maxSize": 4096})
    acl.aclrtMemPoolSetAttr(pool, acl.ACL_RT_MEM_POOL_ATTR_RELEASE_THRESHOLD, 5)
    acl.aclrtMemPoolDestroy(pool)
    with pytest.raises(InvalidHandleError):
        acl.aclrtMemPoolGetAttr(pool, acl.ACL_RT_MEM_POOL_ATTR_RELEASE_THRESHOLD)
    with pytest.raises(InvalidHandleError):
        acl.aclrtMemPoolSetAttr(pool, acl.ACL_RT_MEM_POOL_ATTR_RELEASE_THRESHOLD, 7)


# ---------------------------------------------------------------------------------------------
# KVCachePool(pool=...)


def test_kv_cache_pool_takes_its_region_from_a_mem_pool() -> None:
    mem = MemPool(1 * MiB)
    first = mem.malloc(100)
    kv = atb_mem.KVCachePool(64, 16, num_layers=2, num_kv_heads=2, head_dim=8, pool=mem)
    region_bytes = kv.num_blocks * kv.bytes_per_block
    assert region_bytes > 0
    assert kv.mem_pool is mem
    region = kv.region
    assert isinstance(region, atb_mem.Allocation)
    assert region.size == mem.rounded_size(region_bytes)
    assert region.offset == first.size
    assert mem.owns(region)
    assert len(mem) == 2
    assert mem.stats()["requested_bytes.current"] == 100 + region_bytes
    # The KV cache itself works as usual.
    kv.alloc_sequence(1, 40)
    assert kv.seq_len(1) == 40
    kv.close()
    assert kv.region is None
    assert not mem.owns(region)
    assert len(mem) == 1
    kv.close()  # idempotent
    assert len(mem) == 1
    mem.free(first)
    assert mem.free_ranges() == [(0, 1 * MiB)]
    mem._check_invariants()


def test_kv_cache_pool_context_manager_and_gc() -> None:
    mem = MemPool(1 * MiB)
    with atb_mem.KVCachePool(32, 16, pool=mem) as kv:
        assert len(mem) == 1
        assert kv.region is not None and mem.owns(kv.region)
    assert len(mem) == 0
    kv2 = atb_mem.KVCachePool(32, 16, pool=mem)
    assert len(mem) == 1
    del kv2
    gc.collect()
    assert len(mem) == 0
    pool_less = atb_mem.KVCachePool(8, 4, device=None)  # bookkeeping only, no bytes
    assert pool_less.mem_pool is None and pool_less.region is None
    pool_less.close()
    private = atb_mem.KVCachePool(8, 4)  # host bytes from a private pool of exactly that size
    assert private.mem_pool is not None and private.mem_pool.capacity == private.region.size
    # Closing a KV cache whose MemPool is already closed is fine.
    kv3 = atb_mem.KVCachePool(8, 4, pool=mem)
    mem.close()
    kv3.close()
    assert kv3.region is None


def test_kv_cache_pool_that_does_not_fit() -> None:
    mem = MemPool(64 * KiB)
    kv = atb_mem.KVCachePool(16, 16, num_layers=1, num_kv_heads=1, head_dim=64, pool=mem)
    need = kv.num_blocks * kv.bytes_per_block
    kv.close()
    blocker = mem.malloc(64 * KiB - need + 64)  # leaves less than `need` free
    before = full_snapshot(mem)
    with pytest.raises(OutOfMemoryError, match=f"requested {need} bytes"):
        atb_mem.KVCachePool(16, 16, num_layers=1, num_kv_heads=1, head_dim=64, pool=mem)
    gc.collect()
    after = full_snapshot(mem)
    assert after["stats"]["num_ooms"] == before["stats"]["num_ooms"] + 1
    after["stats"]["num_ooms"] -= 1
    assert after == before
    with pytest.raises(TypeError, match="MemPool"):
        atb_mem.KVCachePool(16, 16, pool="not a pool")  # type: ignore[arg-type]
    mem.free(blocker)
    with atb_mem.KVCachePool(16, 16, num_layers=1, num_kv_heads=1, head_dim=64, pool=mem):
        assert len(mem) == 1


# ---------------------------------------------------------------------------------------------
# Bad input: every call raises the right exception, says why, and changes nothing


BAD_CONSTRUCTOR_ARGS: list[tuple[dict[str, Any], type, str]] = [
    ({"capacity": 0}, ValueError, "capacity"),
    ({"capacity": -1}, ValueError, "capacity"),
    ({"capacity": 1.0}, TypeError, "capacity must be an int"),
    ({"capacity": 4096.0}, TypeError, "capacity must be an int"),
    ({"capacity": True}, TypeError, "capacity must be an int"),
    ({"capacity": "4096"}, TypeError, "capacity must be an int"),
    ({"capacity": None}, TypeError, "capacity must be an int"),
    ({"capacity": 2**48 + 1, "backing": None}, ValueError, "2**48"),
    ({"capacity": 2**64, "backing": None}, ValueError, "2**48"),
    ({"capacity": 4096, "alignment": 3}, ValueError, "power of two"),
    ({"capacity": 4096, "alignment": 96}, ValueError, "power of two"),
    ({"capacity": 4096, "alignment": 0}, ValueError, "alignment"),
    ({"capacity": 4096, "alignment": -64}, ValueError, "alignment"),
    ({"capacity": 4096, "alignment": 64.0}, TypeError, "alignment must be an int"),
    ({"capacity": 4096, "alignment": True}, TypeError, "alignment must be an int"),
    ({"capacity": 100, "alignment": 128}, ValueError, "exceeds the capacity"),
    ({"capacity": 32, "policy": "ascend"}, ValueError, "exceeds the capacity"),
    ({"capacity": 4096, "policy": "cuda"}, ValueError, "unknown policy"),
    ({"capacity": 4096, "policy": "Ascend"}, ValueError, "unknown policy"),
    ({"capacity": 4096, "policy": 3}, TypeError, "str"),
    ({"capacity": 4096, "max_allocations": 0}, ValueError, "max_allocations"),
    ({"capacity": 4096, "max_allocations": -1}, ValueError, "max_allocations"),
    ({"capacity": 4096, "max_allocations": 2**31}, ValueError, "max_allocations"),
    ({"capacity": 4096, "max_allocations": 2**40}, ValueError, "max_allocations"),
    ({"capacity": 4096, "max_allocations": 8.0}, TypeError, "max_allocations must be an int"),
    ({"capacity": 4096, "backing": "device"}, ValueError, "unknown backing"),
    ({"capacity": 4096, "backing": 3}, TypeError, "has no ptr"),
    ({"capacity": 4096, "backing": ArrayBacking(4095)}, ValueError, "less than the capacity"),
]


@pytest.mark.parametrize(
    ("kwargs", "exc", "fragment"),
    BAD_CONSTRUCTOR_ARGS,
    ids=[", ".join(f"{k}={v!r}" for k, v in case[0].items()) for case in BAD_CONSTRUCTOR_ARGS],
)
def test_bad_constructor_input(kwargs: dict[str, Any], exc: type, fragment: str) -> None:
    kwargs = dict(kwargs)
    capacity = kwargs.pop("capacity")
    with pytest.raises(exc, match=re.escape(fragment)) as info:
        MemPool(capacity, **kwargs)
    if fragment == "2**48":
        # A clear message: not "capacity must be at least 1" for a capacity that is too large.
        assert "at least" not in str(info.value)


def test_constructor_options_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        MemPool(4096, 64)  # type: ignore[misc]


@dataclass
class Ctx:
    pool: MemPool
    foreign: MemPool
    allocs: list[atb_mem.Allocation]


def make_ctx() -> Ctx:
    pool = MemPool(64 * KiB, alignment=64, max_allocations=8)
    allocs = [pool.malloc(n) for n in (100, 1000, 64, 5000, 300)]
    pool.free(allocs[2])  # a hole: a fragmented pool
    pool.view(allocs[1], np.uint8)[:] = 0x5A
    foreign = MemPool(64 * KiB)
    foreign.malloc(64)
    return Ctx(pool, foreign, [allocs[0], allocs[1], allocs[3], allocs[4]])


def _freed(ctx: Ctx) -> atb_mem.Allocation:
    a = ctx.pool.malloc(64)
    ctx.pool.free(a)
    return a


def _stale_after_reset(ctx: Ctx) -> atb_mem.Allocation:
    stale = ctx.allocs[0]
    ctx.pool.reset()
    ctx.allocs = [ctx.pool.malloc(n) for n in (100, 1000, 64)]
    assert ctx.allocs[0].offset == stale.offset  # the same place, a new handle
    return stale


def _fill_to_max(ctx: Ctx) -> None:
    while len(ctx.pool) < 8:
        ctx.pool.malloc(1)


Setup = Callable[[Ctx], Callable[[], object]]

BAD_CALLS: list[tuple[str, Setup, type, str]] = [
    # malloc
    ("malloc-0", lambda c: lambda: c.pool.malloc(0), ValueError, "at least 1"),
    ("malloc-negative", lambda c: lambda: c.pool.malloc(-64), ValueError, "at least 1"),
    ("malloc-float", lambda c: lambda: c.pool.malloc(64.0), TypeError, "must be an int"),
    ("malloc-bool", lambda c: lambda: c.pool.malloc(True), TypeError, "must be an int"),
    ("malloc-str", lambda c: lambda: c.pool.malloc("64"), TypeError, "must be an int"),
    ("malloc-none", lambda c: lambda: c.pool.malloc(None), TypeError, "must be an int"),
    (
        "malloc-over-capacity",
        lambda c: lambda: c.pool.malloc(64 * KiB + 1),
        ValueError,
        "exceeds the pool's capacity",
    ),
    (
        "malloc-oom",
        lambda c: lambda: c.pool.malloc(60 * KiB),
        OutOfMemoryError,
        "requested 61440 bytes",
    ),
    (
        "malloc-oom-fragmented",  # enough bytes free in total, but no range is large enough
        lambda c: lambda: c.pool.malloc(c.pool.stats()["largest_free"] + 1),
        OutOfMemoryError,
        "largest free range",
    ),
    (
        "malloc-max-allocations",
        lambda c: (_fill_to_max(c), lambda: c.pool.malloc(1))[1],
        OutOfMemoryError,
        "max_allocations",
    ),
    # free
    (
        "free-double",
        lambda c: (lambda a: lambda: c.pool.free(a))(_freed(c)),
        InvalidHandleError,
        "already freed",
    ),
    (
        "free-double-by-ptr",
        lambda c: (lambda a: lambda: c.pool.free(a.ptr))(_freed(c)),
        InvalidHandleError,
        "no live allocation",
    ),
    (
        "free-stale-after-reset",
        lambda c: (lambda a: lambda: c.pool.free(a))(_stale_after_reset(c)),
        InvalidHandleError,
        "already freed",
    ),
    (
        "free-foreign-allocation",
        lambda c: (lambda a: lambda: c.pool.free(a))(c.foreign.malloc(1)),
        InvalidHandleError,
        "another pool",
    ),
    (
        "free-foreign-pointer",
        lambda c: (lambda a: lambda: c.pool.free(a.ptr))(c.foreign.malloc(1)),
        InvalidHandleError,
        "this pool",
    ),
    (
        "free-interior-pointer",
        lambda c: lambda: c.pool.free(c.allocs[1].ptr + 64),
        InvalidHandleError,
        "no live allocation starts",
    ),
    (
        "free-unaligned-pointer",
        lambda c: lambda: c.pool.free(c.allocs[1].ptr + 1),
        InvalidHandleError,
        "no live allocation starts",
    ),
    (
        "free-pointer-in-a-hole",
        lambda c: lambda: c.pool.free(c.pool.base_ptr + c.pool.free_ranges()[0][0]),
        InvalidHandleError,
        "no live allocation starts",
    ),
    (
        "free-pointer-below-base",
        lambda c: lambda: c.pool.free(c.pool.base_ptr - 64),
        InvalidHandleError,
        "not in this pool",
    ),
    (
        "free-pointer-past-end",
        lambda c: lambda: c.pool.free(c.pool.base_ptr + 64 * KiB),
        InvalidHandleError,
        "no live allocation starts",
    ),
    ("free-negative", lambda c: lambda: c.pool.free(-1), InvalidHandleError, "not in this pool"),
    ("free-huge", lambda c: lambda: c.pool.free(2**200), InvalidHandleError, "out of range"),
    ("free-str", lambda c: lambda: c.pool.free("0x10"), TypeError, "Allocation or a pointer"),
    ("free-float", lambda c: lambda: c.pool.free(1.0), TypeError, "Allocation or a pointer"),
    ("free-none", lambda c: lambda: c.pool.free(None), TypeError, "Allocation or a pointer"),
    ("free-bool", lambda c: lambda: c.pool.free(True), TypeError, "Allocation or a pointer"),
    (
        "free-dict",
        lambda c: lambda: c.pool.free(c.pool.snapshot()[0]),
        TypeError,
        "Allocation or a pointer",
    ),
    # view
    (
        "view-stale",
        lambda c: (lambda a: lambda: c.pool.view(a, np.uint8))(_freed(c)),
        InvalidHandleError,
        "already freed",
    ),
    (
        "view-stale-after-reset",
        lambda c: (lambda a: lambda: c.pool.view(a, np.uint8))(_stale_after_reset(c)),
        InvalidHandleError,
        "already freed",
    ),
    (
        "view-foreign",
        lambda c: (lambda a: lambda: c.pool.view(a, np.uint8))(c.foreign.malloc(1)),
        InvalidHandleError,
        "another pool",
    ),
    (
        "view-shape-too-big",
        lambda c: lambda: c.pool.view(c.allocs[1], np.uint8, c.allocs[1].size + 1),
        ValueError,
        "needs 1025 bytes; the allocation holds 1024",
    ),
    (
        "view-shape-too-big-2d",
        lambda c: lambda: c.pool.view(c.allocs[1], np.float64, (16, 9)),
        ValueError,
        "needs 1152 bytes",
    ),
    (
        "view-shape-overflow",
        lambda c: lambda: c.pool.view(c.allocs[1], np.uint8, (2**40, 2**40)),
        ValueError,
        "too large",
    ),
    (
        "view-negative-shape",
        lambda c: lambda: c.pool.view(c.allocs[1], np.uint8, -1),
        ValueError,
        "at least 0",
    ),
    (
        "view-negative-shape-2d",
        lambda c: lambda: c.pool.view(c.allocs[1], np.uint8, (2, -8)),
        ValueError,
        "at least 0",
    ),
    (
        "view-float-shape",
        lambda c: lambda: c.pool.view(c.allocs[1], np.uint8, 1.5),
        TypeError,
        "float",
    ),
    (
        "view-float-shape-entry",
        lambda c: lambda: c.pool.view(c.allocs[1], np.uint8, (2, 1.5)),
        TypeError,
        "must be an int",
    ),
    (
        "view-dtype-object",
        lambda c: lambda: c.pool.view(c.allocs[1], object),
        TypeError,
        "data-type",
    ),
    (
        "view-dtype-object-shape",
        lambda c: lambda: c.pool.view(c.allocs[1], np.dtype("O"), 4),
        TypeError,
        "data-type",
    ),
    (
        "view-dtype-with-objects",
        lambda c: lambda: c.pool.view(c.allocs[1], np.dtype([("x", "i8"), ("o", "O")])),
        TypeError,
        "data-type",
    ),
    (
        "view-dtype-empty",
        lambda c: lambda: c.pool.view(c.allocs[1], "V0"),
        ValueError,
        "needs 0 bytes",
    ),
    (
        "view-dtype-unknown",
        lambda c: lambda: c.pool.view(c.allocs[1], "no such dtype"),
        TypeError,
        "not understood",
    ),
    (
        "view-not-an-allocation",
        lambda c: lambda: c.pool.view(c.allocs[1].offset, np.uint8),
        TypeError,
        "expected an Allocation",
    ),
    # the rest
    ("owns-int", lambda c: lambda: c.pool.owns(0), TypeError, "expected an Allocation"),
    ("trim-negative", lambda c: lambda: c.pool.trim_to(-1), ValueError, "at least 0"),
    ("trim-float", lambda c: lambda: c.pool.trim_to(0.0), TypeError, "must be an int"),
    ("rounded-size-0", lambda c: lambda: c.pool.rounded_size(0), ValueError, "at least 1"),
    ("rounded-size-str", lambda c: lambda: c.pool.rounded_size("1"), TypeError, "must be an int"),
]


@pytest.mark.parametrize(
    ("setup", "exc", "fragment"),
    [case[1:] for case in BAD_CALLS],
    ids=[case[0] for case in BAD_CALLS],
)
def test_bad_call_changes_nothing(setup: Setup, exc: type, fragment: str) -> None:
    ctx = make_ctx()
    call = setup(ctx)
    before = full_snapshot(ctx.pool)
    foreign_before = full_snapshot(ctx.foreign)
    contents = [bytes(ctx.pool.view(a, np.uint8)) for a in ctx.allocs]
    with pytest.raises(exc, match=re.escape(fragment)) as info:
        call()
    after = full_snapshot(ctx.pool)
    if isinstance(info.value, OutOfMemoryError):
        # By design a failed malloc is counted; nothing else may change.
        assert after["stats"]["num_ooms"] == before["stats"]["num_ooms"] + 1
        after["stats"]["num_ooms"] -= 1
    assert after == before
    assert full_snapshot(ctx.foreign) == foreign_before
    assert [bytes(ctx.pool.view(a, np.uint8)) for a in ctx.allocs] == contents
    ctx.pool._check_invariants()
    # The pool still works after the error.
    a = ctx.pool.malloc(1) if len(ctx.pool) < 8 else ctx.allocs[0]
    ctx.pool.free(a)
    ctx.pool._check_invariants()


def test_error_classes() -> None:
    assert issubclass(OutOfMemoryError, MemoryError)
    assert issubclass(OutOfMemoryError, atb_mem.AtbMemError)
    assert issubclass(InvalidHandleError, ValueError)
    assert issubclass(InvalidHandleError, atb_mem.AtbMemError)

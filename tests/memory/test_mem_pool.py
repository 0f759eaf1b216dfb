"""`MemPool`, call by call: construction, rounding and alignment, pointers and handles."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

import atb_mem
from atb_mem import InvalidHandleError, MemPool, OutOfMemoryError
from tests.memory.mem_pool_helpers import KiB, MiB, check_tiling, expected_rounding
from tests.support.unchanged import assert_unchanged, failed_malloc_counted, mem_pool_snapshot

# ---------------------------------------------------------------------------------------------
# Construction and basic properties


def test_defaults() -> None:
    pool = MemPool(1 * MiB)
    assert isinstance(pool.core, atb_mem._core.MemPool)
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
    assert_unchanged(lambda: mem_pool_snapshot(pool), OutOfMemoryError, lambda: pool.malloc(1),
                     match="max_allocations", allow=failed_malloc_counted)
    pool.free(live[1])
    assert pool.malloc(1).offset == live[1].offset

"""A table of every bad input to `MemPool`: each must raise the right exception with a useful
message and leave the pool exactly as it was."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import atb_mem
from atb_mem import InvalidHandleError, MemPool, OutOfMemoryError
from tests.memory.mem_pool_helpers import ArrayBacking, KiB
from tests.support.unchanged import assert_unchanged, failed_malloc_counted, mem_pool_snapshot

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
    ({"capacity": 4096, "alignment": 64.0}, TypeError,
     "must be an int, got 64.0\nwhile processing 'alignment'"),
    ({"capacity": 4096, "alignment": True}, TypeError,
     "must be an int, got True\nwhile processing 'alignment'"),
    ({"capacity": 100, "alignment": 128}, ValueError, "exceeds the capacity"),
    ({"capacity": 32, "policy": "ascend"}, ValueError, "exceeds the capacity"),
    ({"capacity": 4096, "policy": "cuda"}, ValueError, "unknown policy"),
    ({"capacity": 4096, "policy": "Ascend"}, ValueError, "unknown policy"),
    ({"capacity": 4096, "policy": 3}, TypeError, "str"),
    ({"capacity": 4096, "max_allocations": 0}, ValueError, "max_allocations"),
    ({"capacity": 4096, "max_allocations": -1}, ValueError, "max_allocations"),
    ({"capacity": 4096, "max_allocations": 2**31}, ValueError, "max_allocations"),
    ({"capacity": 4096, "max_allocations": 2**40}, ValueError, "max_allocations"),
    ({"capacity": 4096, "max_allocations": 8.0}, TypeError,
     "must be an int, got 8.0\nwhile processing 'max_allocations'"),
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
    foreign_before = mem_pool_snapshot(ctx.foreign)
    contents = [bytes(ctx.pool.view(a, np.uint8)) for a in ctx.allocs]
    assert_unchanged(lambda: mem_pool_snapshot(ctx.pool), exc, call, match=re.escape(fragment),
                     allow=failed_malloc_counted)
    assert mem_pool_snapshot(ctx.foreign) == foreign_before
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

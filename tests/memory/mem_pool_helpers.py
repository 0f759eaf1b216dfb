"""What the MemPool tests share: sizes, the rounding rule they expect, the tiling check, and
a backing object made of a numpy array (as a device backing would plug in)."""

from __future__ import annotations

from typing import Any

import numpy as np

from atb_mem import MemPool

KiB = 1024
MiB = 1024 * KiB


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


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

"""`RegionAllocator`: malloc/free of byte ranges in one region, the Rust core's, forwarded by
`MemPool`.

Each method and property here calls the same-named one of the pool's core (see
``atb_mem._forwarding``); the docstrings are the core's, from ``_core.pyi`` (a test keeps them
equal). What the Python class adds (``release_threshold``, ``memory_summary``, ``with``) is in
``mem_pool.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from atb_mem import _core
from atb_mem._forwarding import forwards_to

if TYPE_CHECKING:
    from atb_mem._core import Allocation
    from atb_mem._types import AlignmentPolicy, LiveAllocation, MemoryBacking, MemPoolStats

__all__ = ["RegionAllocator"]


@forwards_to(_core.MemPool)
class RegionAllocator:
    """The core's allocator, answered by ``core`` (a ``_core.MemPool``)."""

    _core: _core.MemPool

    BOUND_FORWARDS = ("malloc", "free")
    """Bound on each instance to the core's methods (``atb_mem._forwarding.bind_forwards``)."""

    # ---- the region ------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Bytes of the region."""
        return self._core.capacity

    @property
    def alignment(self) -> int:
        """Every allocation starts at a multiple of this many bytes."""
        return self._core.alignment

    @property
    def policy(self) -> AlignmentPolicy:
        """How a request's size is rounded (``"default"`` or CANN's ``"ascend"``)."""
        return self._core.policy

    @property
    def backing(self) -> MemoryBacking | None:
        """The object that owns the bytes (a ``HostRegion`` by default; None offsets-only)."""
        return self._core.backing

    @property
    def base_ptr(self) -> int:
        """The address of the region's first byte (0 offsets-only)."""
        return self._core.base_ptr

    @property
    def closed(self) -> bool:
        """Whether ``close()`` ran."""
        return self._core.closed

    # ---- allocations -----------------------------------------------------------------------

    def rounded_size(self, size: int) -> int:
        """Bytes ``malloc(size)`` takes from the pool."""
        return self._core.rounded_size(size)

    def malloc(self, size: int) -> Allocation:
        """Raises OutOfMemoryError (naming the request, free bytes and largest free range)."""
        return self._core.malloc(size)

    def free(self, allocation_or_ptr: Allocation | int) -> None:
        """A double free, stale or foreign handle raises InvalidHandleError."""
        self._core.free(allocation_or_ptr)

    def owns(self, allocation: Allocation) -> bool:
        """Whether ``allocation`` is live in this pool."""
        return self._core.owns(allocation)

    def view(
        self, allocation: Allocation, dtype: Any, shape: int | Sequence[int] | None = None
    ) -> Any:
        """The allocation's bytes as ``dtype`` (and ``shape``), without a copy."""
        return self._core.view(allocation, dtype, shape)

    def __len__(self) -> int:
        return len(self._core)

    def reset(self) -> None:
        """Frees every allocation; outstanding handles become stale."""
        self._core.reset()

    def trim_to(self, min_bytes_to_keep: int) -> int:
        """Releases the free tail beyond ``min_bytes_to_keep``; returns the bytes released."""
        return self._core.trim_to(min_bytes_to_keep)

    def close(self) -> None:
        """Frees everything and drops the pool's reference to its bytes."""
        self._core.close()

    # ---- figures ---------------------------------------------------------------------------

    def stats(self) -> MemPoolStats:
        """torch-style keys: ``allocated_bytes.current``, ``reserved_bytes.peak``, ..."""
        return self._core.stats()

    def snapshot(self) -> list[LiveAllocation]:
        """Live allocations in address order: offset, size, requested, ptr."""
        return self._core.snapshot()

    def free_ranges(self) -> list[tuple[int, int]]:
        """Free ranges in address order: (offset, size)."""
        return self._core.free_ranges()

    def _check_invariants(self) -> None:
        """Raises AssertionError naming the first broken internal invariant."""
        self._core._check_invariants()

    def __repr__(self) -> str:
        return repr(self._core)

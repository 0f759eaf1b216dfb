"""`MemPool`: one region reserved up front, acl-like malloc/free of any size inside it."""

from __future__ import annotations

from typing import Literal

from atb_mem import _core
from atb_mem._forwarding import bind_forwards
from atb_mem._types import AlignmentPolicy, MemoryBacking
from atb_mem.memory.region_allocator import RegionAllocator

__all__ = ["MemPool"]


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class MemPool(RegionAllocator):
    """A preallocated byte pool with O(1) ``malloc``/``free`` of any size inside it.

    ``MemPool(capacity, *, alignment=64, policy="default", backing="host",
    max_allocations=65536)``. ``policy="ascend"`` applies CANN's rule (n bytes take
    ALIGN_UP(n, 32) + 32, from a 64-byte boundary). ``backing="host"`` owns one aligned host
    buffer (views are numpy arrays); ``backing=None`` hands out offsets only; any object with
    ``ptr``, ``nbytes`` and ``view(offset, nbytes, dtype, shape)`` can own the bytes instead.
    The pool itself is the core's (``core``, a ``_core.MemPool``): the methods and
    properties of ``RegionAllocator`` forward to it; ``malloc`` and ``free`` are the core's
    own methods, bound on the instance (no Python frame per call).
    """

    def __init__(self, capacity: int, *, alignment: int | None = None,
                 policy: AlignmentPolicy | None = None,
                 backing: Literal["host"] | MemoryBacking | None = "host",
                 max_allocations: int | None = None) -> None:
        self._release_threshold = 0
        self._core = _core.MemPool(capacity, alignment=alignment, policy=policy,
                                   backing=backing, max_allocations=max_allocations)
        bind_forwards(self, RegionAllocator, RegionAllocator.BOUND_FORWARDS)

    @property
    def core(self) -> _core.MemPool:
        """The Rust pool."""
        return self._core

    @property
    def release_threshold(self) -> int:
        """CANN's ACL_RT_MEM_POOL_ATTR_RELEASE_THRESHOLD, kept for ported code (bytes)."""
        return self._release_threshold

    @release_threshold.setter
    def release_threshold(self, value: int) -> None:
        self._release_threshold = value

    def __enter__(self) -> MemPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def memory_summary(self) -> str:
        """A readable table of the pool's state, in the spirit of torch's memory_summary()."""
        stats = self.stats()
        live = self.snapshot()
        rows = [
            ("capacity", _bytes(stats["capacity"])),
            ("reserved (current / peak)",
             f"{_bytes(stats['reserved_bytes.current'])} / {_bytes(stats['reserved_bytes.peak'])}"),
            ("allocated (current / peak)",
             f"{_bytes(stats['allocated_bytes.current'])} / "
             f"{_bytes(stats['allocated_bytes.peak'])}"),
            ("requested (current)", _bytes(stats["requested_bytes.current"])),
            ("free / largest free range",
             f"{_bytes(stats['free_bytes'])} / {_bytes(stats['largest_free'])}"),
            ("free ranges", f"{stats['free_ranges']}"),
            ("fragmentation (1 - largest/free)", f"{stats['fragmentation']:.4f}"),
            ("fragmentation (Sawicki)", f"{stats['sawicki_fragmentation']:.4f}"),
            ("live allocations", f"{stats['active_allocations.current']}"
                                 f" (max {stats['max_allocations']})"),
            ("mallocs / frees / OOMs",
             f"{stats['num_allocs']} / {stats['num_frees']} / {stats['num_ooms']}"),
            ("alignment / policy", f"{stats['alignment']} / {stats['policy']}"),
        ]
        width = max(len(name) for name, _ in rows)
        lines = ["MemPool memory summary", "=" * (width + 24)]
        lines += [f"{name:<{width}}  {value}" for name, value in rows]
        if live:
            largest = sorted(live, key=lambda a: a["size"], reverse=True)[:5]
            lines.append("largest live allocations:")
            lines += [f"  offset {a['offset']:>14}  size {_bytes(a['size']):>12}" for a in largest]
        return "\n".join(lines)

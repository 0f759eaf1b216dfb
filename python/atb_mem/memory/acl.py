"""The `MemPool` under the names of CANN's memory-pool API, for code being ported.

    pool = acl.aclrtMemPoolCreate({"maxSize": 1 << 30})
    ptr = acl.aclrtMemPoolMalloc(pool, 256 * 1024)
    acl.aclrtMemPoolFree(pool, ptr)
    used = acl.aclrtMemPoolGetAttr(pool, acl.ACL_RT_MEM_POOL_ATTR_USED_MEM_CURRENT)
    acl.aclrtMemPoolDestroy(pool)

One difference from CANN: these functions return their result and raise the library's
exceptions (``OutOfMemoryError``, ``InvalidHandleError``, ``ValueError``, ``TypeError``)
instead of returning an ``aclError`` code and writing through output pointers. The pool
lives in host memory unless ``backing`` says otherwise (a device backing object).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from atb_mem._core import InvalidHandleError
from atb_mem.memory.mem_pool import MemPool

__all__ = [
    "ACL_RT_MEM_POOL_ATTR_RELEASE_THRESHOLD",
    "ACL_RT_MEM_POOL_ATTR_RESERVED_MEM_CURRENT",
    "ACL_RT_MEM_POOL_ATTR_RESERVED_MEM_HIGH",
    "ACL_RT_MEM_POOL_ATTR_USED_MEM_CURRENT",
    "ACL_RT_MEM_POOL_ATTR_USED_MEM_HIGH",
    "aclrtMemPoolCreate",
    "aclrtMemPoolDestroy",
    "aclrtMemPoolFree",
    "aclrtMemPoolGetAttr",
    "aclrtMemPoolMalloc",
    "aclrtMemPoolSetAttr",
    "aclrtMemPoolTrimTo",
]

# The values of CANN's aclrtMemPoolAttr enum.
ACL_RT_MEM_POOL_ATTR_RELEASE_THRESHOLD = 0x4
ACL_RT_MEM_POOL_ATTR_RESERVED_MEM_CURRENT = 0x5
ACL_RT_MEM_POOL_ATTR_RESERVED_MEM_HIGH = 0x6
ACL_RT_MEM_POOL_ATTR_USED_MEM_CURRENT = 0x7
ACL_RT_MEM_POOL_ATTR_USED_MEM_HIGH = 0x8

_StatName = Literal["reserved_bytes.current", "reserved_bytes.peak", "allocated_bytes.current",
                   "allocated_bytes.peak"]
_STAT_OF_ATTR: dict[int, _StatName] = {
    ACL_RT_MEM_POOL_ATTR_RESERVED_MEM_CURRENT: "reserved_bytes.current",
    ACL_RT_MEM_POOL_ATTR_RESERVED_MEM_HIGH: "reserved_bytes.peak",
    ACL_RT_MEM_POOL_ATTR_USED_MEM_CURRENT: "allocated_bytes.current",
    ACL_RT_MEM_POOL_ATTR_USED_MEM_HIGH: "allocated_bytes.peak",
}


def _check_pool(pool: object, *, open_only: bool = True) -> MemPool:
    if not isinstance(pool, MemPool):
        raise TypeError(f"expected a pool from aclrtMemPoolCreate, got {type(pool).__name__}")
    if open_only and pool.closed:
        raise InvalidHandleError("the pool was destroyed (aclrtMemPoolDestroy)")
    return pool


def aclrtMemPoolCreate(pool_props: Mapping[str, Any] | int, **options: Any) -> MemPool:
    """Creates a pool of ``pool_props["maxSize"]`` bytes (or of ``pool_props`` bytes).

    ``options`` go to ``MemPool`` (``alignment``, ``backing``, ``max_allocations``); the
    policy defaults to ``"ascend"``, CANN's rounding for self-managed memory.
    """
    if isinstance(pool_props, Mapping):
        if "maxSize" not in pool_props:
            raise ValueError("pool_props needs 'maxSize' (the pool's size in bytes)")
        size = pool_props["maxSize"]
    else:
        size = pool_props
    options.setdefault("policy", "ascend")
    return MemPool(size, **options)


def aclrtMemPoolMalloc(pool: MemPool, size: int) -> int:
    """Allocates ``size`` bytes; returns the device (or host) address."""
    return _check_pool(pool).malloc(size).ptr


def aclrtMemPoolFree(pool: MemPool, ptr: int) -> None:
    """Frees the allocation at ``ptr`` (a double free raises ``InvalidHandleError``)."""
    _check_pool(pool).free(ptr)


def aclrtMemPoolDestroy(pool: MemPool) -> None:
    """Frees every allocation and releases the pool; later calls on it raise."""
    _check_pool(pool, open_only=False).close()  # idempotent, like close()


def aclrtMemPoolTrimTo(pool: MemPool, min_bytes_to_keep: int) -> None:
    """Releases free memory at the end of the pool, keeping at least ``min_bytes_to_keep``."""
    _check_pool(pool).trim_to(min_bytes_to_keep)


def aclrtMemPoolSetAttr(pool: MemPool, attr: int, value: int) -> None:
    """Sets ``ACL_RT_MEM_POOL_ATTR_RELEASE_THRESHOLD``, the only settable attribute here."""
    _check_pool(pool)
    if attr != ACL_RT_MEM_POOL_ATTR_RELEASE_THRESHOLD:
        raise ValueError(f"attribute {attr!r} cannot be set; only RELEASE_THRESHOLD (0x4) can")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"the release threshold must be an int >= 0, got {value!r}")
    pool.release_threshold = value


def aclrtMemPoolGetAttr(pool: MemPool, attr: int) -> int:
    """Reads one of the ``ACL_RT_MEM_POOL_ATTR_*`` attributes."""
    _check_pool(pool)
    if attr == ACL_RT_MEM_POOL_ATTR_RELEASE_THRESHOLD:
        return pool.release_threshold
    if attr not in _STAT_OF_ATTR:
        raise ValueError(f"unknown memory-pool attribute {attr!r}")
    return int(pool.stats()[_STAT_OF_ATTR[attr]])

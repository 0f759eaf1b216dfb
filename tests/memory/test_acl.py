"""The `MemPool` under CANN's ``aclrtMemPool*`` names (``atb_mem.memory.acl``)."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest

from atb_mem import InvalidHandleError, MemPool, OutOfMemoryError
from atb_mem.memory import acl
from tests.memory.mem_pool_helpers import KiB, MiB
from tests.support.unchanged import assert_unchanged, mem_pool_snapshot


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
    threshold = pool.release_threshold
    assert_unchanged(lambda: mem_pool_snapshot(pool), exc, lambda: call(pool),
                     match=re.escape(fragment))
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

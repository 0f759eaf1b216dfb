"""`MemPool` views: numpy views of an allocation's bytes, and the backings that own them
(a host region, none for offsets only, or any object with ``ptr``, ``nbytes`` and ``view``)."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import atb_mem
from atb_mem import MemPool
from tests.memory.mem_pool_helpers import ArrayBacking, KiB, MiB
from tests.support.unchanged import assert_unchanged, mem_pool_snapshot


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
    assert_unchanged(lambda: mem_pool_snapshot(pool), ValueError, lambda: pool.view(a, np.uint8),
                     match="offsets-only")
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

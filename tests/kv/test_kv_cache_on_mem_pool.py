"""`KVCachePool(pool=...)`: a KV cache takes its block region from a `MemPool`."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest

import atb_mem
from atb_mem import MemPool, OutOfMemoryError
from tests.support.devices import require_torch
from tests.support.unchanged import assert_unchanged, failed_malloc_counted, mem_pool_snapshot

KiB = 1024
MiB = 1024 * KiB


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

    def observe() -> dict[str, Any]:
        gc.collect()  # a KV cache that failed half-built gives back what it took
        return mem_pool_snapshot(mem)

    assert_unchanged(observe, OutOfMemoryError,
                     lambda: atb_mem.KVCachePool(16, 16, num_layers=1, num_kv_heads=1,
                                                 head_dim=64, pool=mem),
                     match=f"requested {need} bytes", allow=failed_malloc_counted)
    with pytest.raises(TypeError, match="MemPool"):
        atb_mem.KVCachePool(16, 16, pool="not a pool")  # type: ignore[arg-type]
    mem.free(blocker)
    with atb_mem.KVCachePool(16, 16, num_layers=1, num_kv_heads=1, head_dim=64, pool=mem):
        assert len(mem) == 1


def test_bytes_come_from_a_given_mem_pool() -> None:
    torch = require_torch()
    host_pool = atb_mem.MemPool(1 << 20)
    pool = atb_mem.KVCachePool(16, 4, num_layers=2, num_kv_heads=2, head_dim=8, pool=host_pool)
    assert pool.device == "host" and isinstance(pool.kv_cache, np.ndarray)
    backing = atb_mem.memory.backends.TorchRegion(1 << 20, "cpu")
    device_pool = atb_mem.MemPool(1 << 20, backing=backing)
    workspace = device_pool.malloc(4096)
    pool = atb_mem.KVCachePool(16, 4, num_layers=2, num_kv_heads=2, head_dim=8,
                               dtype="bfloat16", pool=device_pool)
    assert pool.device == "cpu" and pool.kv_cache.dtype == torch.bfloat16
    assert pool.region.offset >= workspace.size
    assert device_pool.view(workspace, torch.float32).shape == (1024,)
    pool.close()
    assert len(device_pool) == 1
    with pytest.raises(ValueError, match="offsets-only"):
        atb_mem.KVCachePool(16, 4, pool=atb_mem.MemPool(1 << 20, backing=None))

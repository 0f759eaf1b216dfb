"""The Python classes over Rust ones hold their core (composition) and answer from it
without a Python frame per call."""

from __future__ import annotations

import pytest

import atb_mem
from atb_mem import _core
from atb_mem.scheduling.continuous import ContinuousBatchScheduler


@pytest.mark.parametrize("make, core_type", [
    (lambda: atb_mem.KVCachePool(16, 4, device=None), _core.KVCachePool),
    (lambda: atb_mem.KVCachePool(16, 4), _core.KVCachePool),
    (lambda: atb_mem.MemPool(1 << 16), _core.MemPool),
])
def test_pools_hold_their_core_and_bind_its_methods(make, core_type) -> None:
    pool = make()
    assert not isinstance(pool, core_type)
    assert type(pool.core) is core_type
    for name in type(pool)._core_methods:
        method = getattr(pool, name)
        # The core's own bound method: calling it is calling the core.
        assert getattr(method, "__self__", None) is pool.core, name
    assert repr(pool) == repr(pool.core)


def test_forwarded_properties_read_the_core_now() -> None:
    kv = atb_mem.KVCachePool(16, 4, device=None)
    free = kv.num_free_blocks
    kv.alloc_sequence(7, 9)
    assert kv.num_free_blocks == free - 3 == kv.core.num_free_blocks
    assert 7 in kv and len(kv) == 1 == len(kv.core)
    assert kv.stats()["num_sequences"] == 1


def test_what_the_python_class_adds_is_its_own() -> None:
    kv = atb_mem.KVCachePool(16, 4, num_host_blocks=4)
    kv.alloc_sequence(1, 5)
    # swap_out and stats are the Python class's (they add the executor and the bytes).
    assert "swap_out" not in type(kv)._core_methods
    pairs = kv.swap_out([1])
    assert len(pairs) == 2 and kv.is_swapped(1)
    assert kv.stats()["bytes_device"] == 16 * kv.bytes_per_block


def test_the_scheduler_takes_a_pool_or_its_core_and_nothing_else() -> None:
    kv = atb_mem.KVCachePool(16, 4, device=None)
    config = ContinuousBatchScheduler(kv).config
    assert _core.ContinuousScheduler(kv.core, config).config() == config
    with pytest.raises(TypeError, match="KVCachePool"):
        _core.ContinuousScheduler(kv, config)  # the pool itself is not the core
    with pytest.raises(TypeError, match="KVCachePool"):
        ContinuousBatchScheduler(object())  # type: ignore[arg-type]

"""KV bytes on host memory (numpy) and CPU torch: views, write_kv, copy-on-write, swapping, the
host tier, and the host copy kernels."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import atb_mem
from tests.kv.kv_arrays import as_numpy, check_attention, make_pool, random_kv
from tests.support.devices import DEVICES, require_torch


def read_tokens(pool: atb_mem.KVCachePool, layer: int, seq_id: int) -> tuple[Any, Any]:
    """The sequence's K/V in token order, read back through its slots."""
    slots = pool.slot_mapping([seq_id], [0], [pool.seq_len(seq_id)])
    flat = (-1, pool.num_kv_heads, pool.head_dim)
    keys = as_numpy(pool.key_cache(layer).reshape(flat))[slots]
    values = as_numpy(pool.value_cache(layer).reshape(flat))[slots]
    return keys, values


@pytest.mark.parametrize("device", DEVICES)
def test_views_share_one_region(device: str) -> None:
    pool = make_pool(device)
    kv = pool.kv_cache
    assert tuple(kv.shape) == (2, 2, 64, 4, 2, 8)
    assert tuple(pool.key_cache(1).shape) == (64, 4, 2, 8)
    pool.key_cache(1)[3, 2, 1, 5] = 7.0
    assert float(kv[1, 0, 3, 2, 1, 5]) == 7.0
    assert pool.region.size == pool.num_blocks * pool.bytes_per_block
    assert pool.stats()["bytes_device"] == pool.region.size
    with pytest.raises(ValueError, match="out of range"):
        pool.value_cache(2)
    with pytest.raises(TypeError, match="layer"):
        pool.key_cache(1.0)


@pytest.mark.parametrize("device", DEVICES)
def test_write_kv_scatters_into_slots(device: str) -> None:
    rng = np.random.default_rng(1)
    pool = make_pool(device)
    pool.alloc_sequence(1, 6)
    pool.alloc_sequence(2, 3)
    slots = pool.slot_mapping([1, 2], [0, 0], [6, 3])
    key, value = random_kv(pool, 9, rng)
    pool.write_kv(1, slots, key, value)
    keys, values = read_tokens(pool, 1, 2)
    np.testing.assert_array_equal(keys, as_numpy(key)[6:])
    np.testing.assert_array_equal(values, as_numpy(value)[6:])
    assert not as_numpy(pool.key_cache(0)).any()  # the other layer is untouched


@pytest.mark.parametrize("device", DEVICES)
def test_write_kv_skips_padding_and_refuses_unheld_slots(device: str) -> None:
    rng = np.random.default_rng(2)
    pool = make_pool(device)
    pool.alloc_sequence(1, 2)
    slots = pool.slot_mapping([1], [0], [2])
    key, value = random_kv(pool, 3, rng)
    pool.write_kv(0, np.array([slots[0], -1, slots[1]], dtype=np.int32), key, value)
    keys, _ = read_tokens(pool, 0, 1)
    np.testing.assert_array_equal(keys, as_numpy(key)[[0, 2]])
    before = as_numpy(pool.kv_cache).copy()
    unheld = (pool.block_table(1)[0] + 1) * pool.block_size  # the next block: nobody's
    bad_calls = [
        (lambda: pool.write_kv(0, np.array([unheld, -1, 0]), key, value), ValueError, "holds"),
        (lambda: pool.write_kv(0, np.array([10**6, -1, 1]), key, value), ValueError, "holds"),
        (lambda: pool.write_kv(0, slots, key, value), ValueError, "shape"),
        (lambda: pool.write_kv(0, np.zeros(3), key, value), TypeError, "integer"),
        (lambda: pool.write_kv(0, np.zeros(3, np.int32), as_numpy(key).tolist(), value),
         TypeError, "array"),
        (lambda: pool.write_kv(5, np.zeros(3, np.int32), key, value), ValueError, "range"),
    ]
    for call, error, match in bad_calls:
        with pytest.raises(error, match=match):
            call()
        np.testing.assert_array_equal(as_numpy(pool.kv_cache), before)


def test_write_kv_checks_dtype_and_device() -> None:
    torch = require_torch()
    pool = make_pool("cpu", dtype="float16")
    pool.alloc_sequence(1, 2)
    slots = pool.slot_mapping([1], [0], [2])
    wrong = torch.ones(2, 2, 8, dtype=torch.float32)
    with pytest.raises(TypeError, match="dtype"):
        pool.write_kv(0, slots, wrong, wrong)
    with pytest.raises(TypeError, match="torch"):
        pool.write_kv(0, slots, np.ones((2, 2, 8), np.float16), np.ones((2, 2, 8), np.float16))


@pytest.mark.parametrize("device", DEVICES)
def test_swap_out_and_in_keeps_the_bytes(device: str) -> None:
    rng = np.random.default_rng(5)
    pool = make_pool(device, head_dim=16, num_host_blocks=16)
    history = {}
    for seq_id, length in ((1, 9), (2, 5)):
        pool.alloc_sequence(seq_id, length)
        key, value = random_kv(pool, length, rng)
        pool.write_kv(1, pool.slot_mapping([seq_id], [0], [length]), key, value)
        history[seq_id] = (as_numpy(key), as_numpy(value))
    pool.fork(1, 3)
    history[3] = history[1]
    device_before = pool.num_free_blocks
    moves = pool.swap_out([1, 3])
    assert moves.shape == (3, 2)  # 3 blocks shared by 1 and 3, each moved once
    assert pool.num_free_blocks == device_before + 3
    assert pool.is_swapped(1) and pool.is_swapped(3)
    with pytest.raises(ValueError, match="swapped out"):
        pool.append_tokens([1])
    with pytest.raises(ValueError, match="swapped out"):
        pool.block_tables([3])
    # Reuse the freed device blocks for something else, so the data must come back by copy.
    pool.alloc_sequence(9, 12)
    pool.write_kv(1, pool.slot_mapping([9], [0], [12]), *random_kv(pool, 12, rng))
    pool.free_sequence(9)
    moves = pool.swap_in([3, 1])
    assert moves.shape == (3, 2)
    assert not pool.is_swapped(1)
    assert pool.block_table(1).tolist() == pool.block_table(3).tolist()
    check_attention(pool, {s: history[s] for s in (1, 2, 3)}, [9, 5, 9], rng, "float32")
    pool._check_invariants()


def test_swap_errors_change_nothing() -> None:
    pool = make_pool("host", num_host_blocks=2)
    pool.alloc_sequence(1, 9)  # 3 blocks
    pool.alloc_sequence(2, 4)
    before = (pool.stats(), pool.block_table(1).tolist(), pool.num_free_host_blocks)
    with pytest.raises(atb_mem.OutOfMemoryError, match="host"):
        pool.swap_out([1])
    with pytest.raises(ValueError, match="not swapped out"):
        pool.swap_in([2])
    with pytest.raises(ValueError, match="twice"):
        pool.swap_out([2, 2])
    with pytest.raises(atb_mem.UnknownSequenceError):
        pool.swap_out([2, 7])
    assert (pool.stats(), pool.block_table(1).tolist(), pool.num_free_host_blocks) == before
    with pytest.raises(ValueError, match="host tier"):
        make_pool("host").swap_out([])


def test_int8_and_bfloat16() -> None:
    pool = make_pool("host", dtype="int8")
    assert pool.kv_cache.dtype == np.int8
    # numpy has no bfloat16: the host holds its 16-bit words.
    assert make_pool("host", dtype="bfloat16").kv_cache.dtype == np.uint16
    torch = require_torch()
    assert make_pool("cpu", dtype="bfloat16").kv_cache.dtype == torch.bfloat16


def test_device_none_has_no_bytes_and_unknown_devices_fail() -> None:
    pool = atb_mem.KVCachePool(16, 4, device=None)
    assert pool.device is None and pool.region is None
    with pytest.raises(ValueError, match="no bytes"):
        pool.key_cache(0)
    with pytest.raises(ValueError, match="unknown device"):
        atb_mem.KVCachePool(16, 4, device="tpu")


def test_npu_without_torch_npu_says_what_to_install() -> None:
    require_torch()
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install torch-npu"):
            atb_mem.KVCachePool(16, 4, device="npu:0")
    else:
        pytest.fail("this test expects a machine without torch-npu")


def test_write_kv_from_bytes_overlapping_the_cache() -> None:
    """A key that is itself a view of the cache is read before anything is written."""
    torch = require_torch()
    pool = atb_mem.KVCachePool(4, 4, num_layers=1, num_kv_heads=1, head_dim=1,
                               dtype="float32", device="cpu")
    pool.alloc_sequence(1, 8)
    slots = pool.slot_mapping([1], [0], [8])
    keys = pool.key_cache(0)
    keys.view(-1)[:] = torch.arange(keys.numel(), dtype=torch.float32)
    source = keys[1].clone()
    pool.write_kv(0, slots[1:5], keys[1], torch.zeros(4, 1, 1))
    written = keys.view(-1)[slots[1:5].tolist()]
    assert written.tolist() == source.view(-1).tolist()


def test_write_kv_takes_grad_tensors_without_building_a_graph() -> None:
    torch = require_torch()
    pool = make_pool("cpu")
    pool.alloc_sequence(1, 2)
    key = torch.ones(2, 2, 8, requires_grad=True)
    pool.write_kv(0, pool.slot_mapping([1], [0], [2]), key, key * 2)
    assert not pool.kv_cache.requires_grad and pool.kv_cache.grad_fn is None
    first_slot = int(pool.slot_mapping([1], [0], [1])[0])
    assert float(pool.value_cache(0).reshape(-1, 2, 8)[first_slot][0, 0]) == 2


def test_host_copy_kernels_refuse_overflowing_sizes() -> None:
    from atb_mem import _core

    dst = np.zeros(16, np.uint8)
    none = np.zeros((0, 2), np.int32)
    with pytest.raises(ValueError, match="overflows"):
        _core.copy_blocks(dst, 2**32, None, 0, 2**32, none)
    with pytest.raises(ValueError):
        _core.copy_blocks(dst, 1, np.zeros(0, np.uint8), 2**60, 16, np.array([[1, 0]], np.int32))
    with pytest.raises(ValueError, match="overflows"):
        _core.scatter_rows(dst, 2**62, 1, np.zeros(8, np.int64), [(0, np.zeros(0, np.uint8))])
    with pytest.raises(ValueError, match="read-only"):
        frozen = np.zeros(16, np.uint8)
        frozen.flags.writeable = False
        _core.scatter_rows(frozen, 4, 4, np.zeros(1, np.int64), [(0, np.ones(4, np.uint8))])


def test_the_executor_is_public_and_runs_a_pools_moves() -> None:
    """``KVCachePool.executor`` is what schedulers hand the core: it copies the bytes of a
    move; a pool without bytes has none (its moves stay pending for the caller)."""
    import numpy as np

    import atb_mem

    pool = atb_mem.KVCachePool(8, 4, num_layers=1, num_kv_heads=1, head_dim=2)
    assert atb_mem.KVCachePool(8, 4, device=None).executor is None
    kv = pool.kv_cache
    kv[:, :, 1] = 7.0
    pool.executor(np.array([[0, 1, 2]], np.int32))  # copy block 1 to block 2
    assert (kv[:, :, 2] == 7.0).all()

"""Quantized KV blocks in the pool (``kv_cache_dtype="int8"`` / ``"fp8_e4m3"``): their sizes,
what a written token reads back as, that a row depends on its token alone, that moves carry
the scales, and that bad input changes nothing."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import atb_mem
from atb_mem import _core
from atb_mem.kv.planning import plan_kv_cache
from atb_mem.kv.quantized_rows import dequantize_rows
from tests.support.models import require_torch
from tests.support.unchanged import assert_unchanged, kv_snapshot

QUANTIZED = ["int8", "fp8_e4m3"]
QWEN3_0_6B = {"num_layers": 28, "num_kv_heads": 8, "head_dim": 128}


def test_the_names_are_the_cores() -> None:
    from typing import get_args

    from atb_mem._types import KVCacheDtype

    assert list(_core.KV_CACHE_DTYPES) == list(get_args(KVCacheDtype))


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_a_gib_holds_at_least_1_9_times_the_blocks_of_bfloat16(kv_cache_dtype: str) -> None:
    def blocks(kind: str) -> int:
        plan = plan_kv_cache(1 << 30, 0, gpu_memory_utilization=1.0, block_size=16,
                             dtype="bfloat16", max_model_len=4096, kv_cache_dtype=kind,
                             **QWEN3_0_6B)
        return plan.num_blocks

    assert blocks(kv_cache_dtype) >= 1.9 * blocks("auto")
    pool = atb_mem.KVCachePool(4, 16, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype,
                               device=None, **QWEN3_0_6B)
    # A row: 128 one-byte codes and a four-byte scale, for K and V of every layer and head.
    assert pool.bytes_per_block == 2 * 28 * 16 * 8 * (128 + 4)
    assert pool.kv_cache_dtype == kv_cache_dtype and pool.dtype == "bfloat16"


def write_random(pool: Any, seq_id: int, length: int, rng: np.random.Generator,
                 scale: float = 1.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Keys and values (float32) written for a new sequence's ``length`` tokens."""
    pool.alloc_sequence(seq_id, length)
    slots = pool.slot_mapping([seq_id], [0], [length])
    shape = (length, pool.num_kv_heads, pool.head_dim)
    key = (rng.standard_normal(shape) * scale + rng.uniform(-3, 3)).astype(np.float32)
    value = (rng.standard_normal(shape) * scale).astype(np.float32)
    pool.write_kv(0, slots, *_on_device(pool, key, value))
    return np.asarray(slots), key, value


def _on_device(pool: Any, *arrays: np.ndarray) -> list[Any]:
    if pool.device == "host":
        return list(arrays)
    torch = require_torch()
    return [torch.from_numpy(array) for array in arrays]


def rows_at(pool: Any, layer: int, half: int, slots: np.ndarray) -> np.ndarray:
    cache = pool.key_cache(layer) if half == 0 else pool.value_cache(layer)
    if not isinstance(cache, np.ndarray):
        cache = cache.numpy()
    return cache.reshape(-1, pool.num_kv_heads, cache.shape[-1])[slots]


@pytest.mark.parametrize("device", ["host", "cpu"])
@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_written_tokens_read_back_within_the_bound(device: str, kv_cache_dtype: str) -> None:
    if device == "cpu":
        require_torch()
    rng = np.random.default_rng(3)
    pool = atb_mem.KVCachePool(16, 4, num_layers=2, num_kv_heads=2, head_dim=32,
                               dtype="float32", kv_cache_dtype=kv_cache_dtype, device=device)
    slots, key, value = write_random(pool, 1, 11, rng, scale=5.0)
    for half, written in ((0, key), (1, value)):
        rows = rows_at(pool, 0, half, slots)
        back = dequantize_rows(rows, kv_cache_dtype, 32)
        error = np.abs(back - written)
        if kv_cache_dtype == "int8":
            # Half the row's own step: its bfloat16 scale, the trailer's first two bytes.
            steps = (rows[..., 32:34].copy().view(np.uint16).astype(np.uint32) << 16
                     ).view(np.float32)
            assert np.all(error <= steps / 2 * (1 + 1e-5) + 1e-6)
            span = written.max(axis=-1, keepdims=True) - written.min(axis=-1, keepdims=True)
            assert np.all(steps <= (span / 255 + np.abs(written).max(axis=-1, keepdims=True)
                                    / 255 / 128) * (1 + 1 / 128) + 1e-6)
        else:
            scales = rows[..., 32:36].copy().view(np.float32)
            assert np.all(error <= np.maximum(np.abs(written) / 16, scales / 1024) * 1.000001)
        # The negative control: the rows are not the values themselves.
        assert error.max() > 0


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_a_tokens_rows_depend_on_its_values_alone(kv_cache_dtype: str) -> None:
    """The same token written beside different neighbours, into another block, gives the same
    bytes: what a prefix hit reads is what a recompute would write."""
    rng = np.random.default_rng(4)
    pool = atb_mem.KVCachePool(16, 4, num_layers=1, num_kv_heads=2, head_dim=16,
                               dtype="float32", kv_cache_dtype=kv_cache_dtype, device="host")
    slots_a, key, value = write_random(pool, 1, 6, rng)
    pool.alloc_sequence(2, 6)
    slots_b = np.asarray(pool.slot_mapping([2], [0], [6]))
    other_key, other_value = key.copy(), value.copy()
    other_key[::2] *= 7.0  # every other token differs
    other_value[::2] += 1.0
    pool.write_kv(0, slots_b, other_key, other_value)
    same = np.arange(1, 6, 2)
    for half in (0, 1):
        assert np.array_equal(rows_at(pool, 0, half, slots_a[same]),
                              rows_at(pool, 0, half, slots_b[same]))
        assert not np.array_equal(rows_at(pool, 0, half, slots_a[::2]),
                                  rows_at(pool, 0, half, slots_b[::2]))


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_a_swap_carries_the_rows_and_their_scales(kv_cache_dtype: str) -> None:
    rng = np.random.default_rng(5)
    pool = atb_mem.KVCachePool(8, 4, num_layers=1, num_kv_heads=2, head_dim=16,
                               dtype="float32", kv_cache_dtype=kv_cache_dtype, device="host",
                               num_host_blocks=8)
    slots, _, _ = write_random(pool, 1, 7, rng)
    before = [rows_at(pool, 0, half, slots).copy() for half in (0, 1)]
    pool.swap_out([1])
    pool.alloc_sequence(2, 7)  # the freed blocks written over
    write_random(pool, 3, 4, rng, scale=9.0)
    pool.write_kv(0, pool.slot_mapping([2], [0], [7]),
                  *[rng.standard_normal((7, 2, 16)).astype(np.float32) for _ in range(2)])
    pool.free_sequence(2)
    pool.swap_in([1])
    after_slots = np.asarray(pool.slot_mapping([1], [0], [7]))
    for half in (0, 1):
        assert np.array_equal(rows_at(pool, 0, half, after_slots), before[half])


def test_bad_kv_cache_dtypes_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown kv_cache_dtype"):
        atb_mem.KVCachePool(4, 4, kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="int8"):
        atb_mem.KVCachePool(4, 4, dtype="int8", kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        _core.kv_layout_bytes(1, 1, 8, "float16", 4, "fp4")
    with pytest.raises(ValueError, match="auto"):
        _core.quantize_kv_rows(np.zeros((1, 8), np.float32), np.zeros((1, 12), np.uint8),
                               "auto")
    with pytest.raises(ValueError, match="shape"):
        _core.quantize_kv_rows(np.zeros((2, 8), np.float32), np.zeros((2, 8), np.uint8),
                               "int8")


def test_bad_rows_and_attention_calls_are_refused_and_write_nothing() -> None:
    rows = np.zeros((2, 12), np.uint8)
    out = np.full((2, 8), 7.0, np.float32)
    for threads, match in ((0, "at least 1"), (1025, "1 to 1024")):
        with pytest.raises(ValueError, match=match):
            _core.quantize_kv_rows(out, rows, "int8", threads=threads)
        assert not rows.any()
    with pytest.raises(ValueError, match="shape"):
        _core.dequantize_kv_rows(rows, np.zeros((2, 9), np.float32), "int8")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        _core.dequantize_kv_rows(rows, out, "fp4")
    assert np.all(out == 7.0)
    # The kernel over a quantized cache: an unknown dtype, and rows of the model's width.
    query = np.ones((1, 2, 8), np.float32)
    attended = np.full_like(query, 7.0)
    steps = (np.array([0, 1], np.int32), np.array([1], np.int32), np.ones((1, 1), np.int32))
    for kv_cache_dtype, row, match in (("int4", 12, "kv_cache_dtype"), ("int8", 8, "head_dim")):
        cache = np.zeros((2 * 4, 1, row), np.uint8)
        with pytest.raises(ValueError, match=match):
            _core.paged_attention(query, cache, cache.copy(), attended, *steps, block_size=4,
                                  scale=1.0, dtype="float32",
                                  kv_cache_dtype=kv_cache_dtype)  # type: ignore[arg-type]
        assert np.all(attended == 7.0) and not cache.any()


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_a_write_in_the_wrong_dtype_changes_nothing(kv_cache_dtype: str) -> None:
    rng = np.random.default_rng(6)
    pool = atb_mem.KVCachePool(8, 4, num_layers=1, num_kv_heads=2, head_dim=16,
                               dtype="float16", kv_cache_dtype=kv_cache_dtype, device="host")
    slots, _, _ = write_random_float16(pool, rng)

    def observe() -> tuple[Any, bytes]:
        return kv_snapshot(pool), pool.key_cache(0).tobytes() + pool.value_cache(0).tobytes()

    codes = np.zeros((4, 2, 16), np.uint8)  # codes are what the cache stores, not K/V
    assert_unchanged(observe, TypeError, lambda: pool.write_kv(0, slots, codes, codes),
                     match="float16")
    rows = np.zeros((4, 2, 20), np.uint8)
    assert_unchanged(observe, ValueError, lambda: pool.write_kv(0, slots, rows, rows),
                     match="shape")
    wrong = np.zeros((4, 2, 16), np.float32)
    assert_unchanged(observe, TypeError, lambda: pool.write_kv(0, slots, wrong, wrong),
                     match="float16")


def write_random_float16(pool: Any, rng: np.random.Generator
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    pool.alloc_sequence(1, 4)
    slots = np.asarray(pool.slot_mapping([1], [0], [4]))
    key, value = (rng.standard_normal((4, 2, 16)).astype(np.float16) for _ in range(2))
    pool.write_kv(0, slots, key, value)
    return slots, key, value

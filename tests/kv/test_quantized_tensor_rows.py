"""Quantized rows written and read in torch (``quantize_tensor_rows`` /
``dequantize_tensor_rows``, the reference attention's path on any device) are the core's: the
same bytes for every finite row, the same values read back, NaN for a row that is not all
finite, over rows of every magnitude and the edges of both formats."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from atb_mem import _core
from atb_mem.kv.quantized_rows import dequantize_tensor_rows, quantize_tensor_rows
from tests.support.models import require_torch

QUANTIZED = ["int8", "fp8_e4m3"]


def rows_of_every_kind(head_dim: int) -> np.ndarray:
    """Random rows at magnitudes from f32's subnormals to 1e37, rows far from zero, constant
    rows, zeros, single huge values, and values on bfloat16 and fp8 rounding boundaries."""
    generator = np.random.default_rng(7)
    rows = [generator.standard_normal((64, head_dim)) * 10.0 ** exponent
            for exponent in range(-44, 38, 3)]
    rows.append(generator.uniform(-1, 1, (64, head_dim)) + generator.uniform(
        -1e6, 1e6, (64, 1)))
    rows.append(np.repeat(generator.standard_normal((16, 1)), head_dim, axis=1))
    rows.append(np.zeros((2, head_dim)))
    signed_zeros = np.zeros((4, head_dim))
    signed_zeros[1::2, ::2] = -0.0                     # either zero may be a row's bound
    rows.append(signed_zeros)
    spike = generator.standard_normal((16, head_dim))
    spike[:, 0] = 3e38
    rows.append(spike)
    # Halfway between neighbouring bfloat16s, and between fp8 codes after the scale.
    halfway = (np.arange(1, head_dim + 1, dtype=np.uint32) << 16 | 0x8000).view(np.float32)
    rows.append(halfway[None, :] * np.array([[1.0], [-1.0], [1e-30]]))
    # Rows whose offset lies within f32's rounding of a halfway point between two bfloat16s,
    # where rounding once (not through f32, as the core does) would give the other one.
    through_f32 = np.array([[-0.486322820186615, 2.9494118690490723],
                            [-0.5036417841911316, 1.6553314924240112],
                            [-1.1777799129486084, 1.0299619436264038],
                            [-2.6365292072296143, 1.1178996562957764]])
    rows.append(np.concatenate([through_f32, np.repeat(through_f32[:, :1], max(
        head_dim - 2, 0), axis=1)], axis=1)[:, :head_dim])
    fp8 = np.linspace(0, 448, head_dim)[None, :] * (1 + np.arange(8)[:, None] / 64)
    rows.append(fp8)
    return np.concatenate(rows).astype(np.float32)


def core_rows(values: np.ndarray, kv_cache_dtype: str) -> np.ndarray:
    rows = np.empty((values.shape[0], values.shape[1] + 4), dtype=np.uint8)
    _core.quantize_kv_rows(np.ascontiguousarray(values), rows, kv_cache_dtype)
    return rows


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("head_dim", [1, 7, 64, 128])
@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_finite_rows_are_the_cores_bytes_and_read_back_as_the_core_reads_them(
        kv_cache_dtype: str, head_dim: int, device: str) -> None:
    torch = require_torch()
    with np.errstate(over="ignore"):
        values = rows_of_every_kind(head_dim)
    finite = np.isfinite(values).all(axis=1)
    want = core_rows(values, kv_cache_dtype)
    got = quantize_tensor_rows(torch.from_numpy(values).to(device), kv_cache_dtype).cpu().numpy()
    assert got.shape == want.shape and got.dtype == np.uint8
    differing = np.flatnonzero((got != want).any(axis=1) & finite)
    assert differing.size == 0, (values[differing[:3]], got[differing[:3]], want[differing[:3]])
    back = np.empty_like(values)
    _core.dequantize_kv_rows(want, back, kv_cache_dtype)
    read = dequantize_tensor_rows(torch.from_numpy(want).to(device), kv_cache_dtype).cpu().numpy()
    np.testing.assert_array_equal(read, back)


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_rows_that_are_not_all_finite_read_back_as_nan(kv_cache_dtype: str) -> None:
    torch = require_torch()
    values = np.ones((3, 8), dtype=np.float32)
    values[0, 2], values[1, 7], values[2, 0] = np.nan, np.inf, -np.inf
    rows = quantize_tensor_rows(torch.from_numpy(values), kv_cache_dtype)
    assert torch.isnan(dequantize_tensor_rows(rows, kv_cache_dtype)).all()
    back = np.empty_like(values)
    _core.dequantize_kv_rows(rows.numpy(), back, kv_cache_dtype)  # the core reads them so too
    assert np.isnan(back).all()


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_bfloat16_values_and_leading_dimensions_keep_their_shape(kv_cache_dtype: str) -> None:
    torch = require_torch()
    values = torch.randn(5, 3, 16, dtype=torch.bfloat16)
    rows = quantize_tensor_rows(values, kv_cache_dtype)
    assert rows.shape == (5, 3, 20)
    flat = values.float().reshape(-1, 16).numpy()
    np.testing.assert_array_equal(rows.reshape(-1, 20).numpy(), core_rows(flat, kv_cache_dtype))
    assert dequantize_tensor_rows(rows, kv_cache_dtype).shape == (5, 3, 16)


def test_an_unknown_dtype_is_refused() -> None:
    torch: Any = require_torch()
    with pytest.raises(ValueError, match="int8"):
        quantize_tensor_rows(torch.ones(2, 4), "auto")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="int8"):
        dequantize_tensor_rows(torch.zeros(2, 8, dtype=torch.uint8), "int4")  # type: ignore

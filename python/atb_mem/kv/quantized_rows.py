"""K/V in a quantized cache (``kv_cache_dtype="int8"`` or ``"fp8_e4m3"``): each token's keys
(or values) for one KV head are one row of ``head_dim`` one-byte codes followed by its
four-byte scale, written once from that token's values alone (the core's row formats,
docs/bytes.md). These convert a model's K/V to such rows and back: on the host through the
core, and in torch on any device (the reference attention's path: CUDA, or
``attention_backend="torch"``), writing the same bytes the core writes, so a block is the same
whichever device wrote it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from atb_mem import _core
from atb_mem._types import KVCacheDtype

if TYPE_CHECKING:
    import torch

__all__ = ["dequantize_rows", "dequantize_tensor_rows", "quantize_host_rows", "quantize_rows",
           "quantize_tensor_rows"]

FP8_E4M3_MAX = 448.0
TRAILER_BYTES = 4
"""Bytes of a row's scale (int8: scale and offset) after its codes, in either format."""


def _as_float32(values: Any) -> np.ndarray:
    """``values`` (numpy, bfloat16 held as uint16 words) as float32."""
    array = np.asarray(values)
    if array.dtype == np.uint16:  # the host backing's bfloat16
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.float32)


def quantize_rows(backend: Any, values: Any, kv_cache_dtype: KVCacheDtype, like: Any) -> Any:
    """``values`` ``[tokens, kv_heads, head_dim]`` in the model's dtype as quantized rows
    ``[tokens, kv_heads, row_bytes]``, an array of ``backend`` where ``like`` (the cache) is."""
    if backend.name == "torch":
        return quantize_tensor_rows(values.to(like.device), kv_cache_dtype)
    return quantize_host_rows(_as_float32(values), kv_cache_dtype)


def quantize_host_rows(values: np.ndarray, kv_cache_dtype: KVCacheDtype,
                       threads: int = 1) -> np.ndarray:
    """float32 ``values`` ``[..., head_dim]`` as uint8 rows ``[..., head_dim + 4]``, by the
    core, on ``threads`` threads (the attention kernel's)."""
    flat = np.ascontiguousarray(values, dtype=np.float32).reshape(-1, values.shape[-1])
    rows = np.empty((flat.shape[0], flat.shape[1] + TRAILER_BYTES), dtype=np.uint8)
    _core.quantize_kv_rows(flat, rows, kv_cache_dtype, threads=threads)
    return rows.reshape(*values.shape[:-1], -1)


def dequantize_rows(rows: Any, kv_cache_dtype: KVCacheDtype, head_dim: int) -> np.ndarray:
    """Quantized rows ``[..., row_bytes]`` (numpy or torch) as float32 ``[..., head_dim]``."""
    if not isinstance(rows, np.ndarray):
        rows = rows.detach().cpu().numpy()
    flat = np.ascontiguousarray(rows).reshape(-1, rows.shape[-1])
    out = np.empty((flat.shape[0], head_dim), dtype=np.float32)
    _core.dequantize_kv_rows(flat, out, kv_cache_dtype)
    return out.reshape(*rows.shape[:-1], head_dim)


def quantize_tensor_rows(values: torch.Tensor, kv_cache_dtype: KVCacheDtype) -> torch.Tensor:
    """``values`` ``[..., head_dim]`` (any float dtype, any device) as uint8 rows
    ``[..., head_dim + 4]`` on the same device, byte for byte the core's for finite rows (a
    row that is not all finite reads back as NaN, as the core's)."""
    import torch

    flat = values.detach().reshape(-1, values.shape[-1]).float()
    finite = torch.isfinite(flat).all(-1, keepdim=True)
    if kv_cache_dtype == "int8":
        codes, trailer = _int8_rows(flat, finite)
    elif kv_cache_dtype == "fp8_e4m3":
        codes, trailer = _fp8_e4m3_rows(flat, finite)
    else:
        raise ValueError(f"kv_cache_dtype must be 'int8' or 'fp8_e4m3', got {kv_cache_dtype!r}")
    rows = torch.cat([codes.view(torch.uint8), trailer.contiguous().view(torch.uint8)], dim=-1)
    return rows.reshape(*values.shape[:-1], -1)


def dequantize_tensor_rows(rows: torch.Tensor, kv_cache_dtype: KVCacheDtype) -> torch.Tensor:
    """uint8 rows ``[..., head_dim + 4]`` as float32 ``[..., head_dim]``, on their device, each
    value computed as the core's kernel reads it."""
    import torch

    head_dim = rows.shape[-1] - TRAILER_BYTES
    trailer = rows[..., head_dim:].contiguous()
    if kv_cache_dtype == "int8":
        scale_and_offset = trailer.view(torch.bfloat16).float()
        codes = rows[..., :head_dim].view(torch.int8).float()
        return codes * scale_and_offset[..., :1] + scale_and_offset[..., 1:]
    if kv_cache_dtype == "fp8_e4m3":
        codes = rows[..., :head_dim].view(torch.float8_e4m3fn).float()
        return codes * trailer.view(torch.float32)
    raise ValueError(f"kv_cache_dtype must be 'int8' or 'fp8_e4m3', got {kv_cache_dtype!r}")


def _int8_rows(flat: torch.Tensor, finite: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes and the ``[scale, offset]`` bfloat16 trailer: the core's arithmetic (in
    f64 where it takes f64), so that both write the same bytes."""
    import torch

    # + 0.0: a zero bound is +0, whichever zero the row's minimum or maximum was (the core's).
    low = flat.amin(-1, keepdim=True).double() + 0.0
    high = flat.amax(-1, keepdim=True).double() + 0.0
    offset = _bfloat16_nearest(low + (high - low) * 128.0 / 255.0)
    rounded = offset.double()
    # + 0.0: a row of zeros needs +0, whichever zero torch's maximum returns.
    needed = torch.maximum((rounded - low) / 128.0, (high - rounded) / 127.0) + 0.0
    scale = _bfloat16_round_up(needed)
    valid = finite & torch.isfinite(scale)
    nan = torch.tensor(float("nan"), dtype=torch.bfloat16, device=flat.device)
    scale, offset = torch.where(valid, scale, nan), torch.where(valid, offset, nan)
    scale32, offset32 = scale.float(), offset.float()
    inverse = torch.where(scale32 > 0, 1.0 / scale32, 0.0)
    # A scale under 2^-128 has no f32 inverse: such rows divide.
    units = torch.where(torch.isfinite(inverse), (flat - offset32) * inverse,
                        (flat - offset32) / scale32)
    codes = torch.where(valid, units.round().clamp(-128, 127), 0).to(torch.int8)
    return codes, torch.cat([scale, offset], dim=-1)


def _fp8_e4m3_rows(flat: torch.Tensor, finite: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 E4M3 codes (ties to even, as the core's) and the f32 scale, largest / 448."""
    import torch

    largest = flat.abs().amax(-1, keepdim=True)
    scale = torch.where(finite, largest / FP8_E4M3_MAX, float("nan"))
    inverse = torch.where(scale > 0, 1.0 / scale, scale)
    scaled = torch.where(torch.isinf(inverse), flat / scale, flat * inverse)
    # torch's conversion rounds to nearest even and gives NaN only from 464 up: the scaled
    # values stay under it (448 times a few ulp at most), where the core saturates alike.
    codes = scaled.to(torch.float8_e4m3fn)
    return codes, scale


def _bfloat16_nearest(values: torch.Tensor) -> torch.Tensor:
    """f64 ``values`` rounded to bfloat16 as the core rounds them (``half``'s ``from_f64``):
    to the nearest f32, then to the nearest bfloat16, ties to even both times. (Once in a
    while that is one bfloat16 off a single rounding; the same bytes matter more.)"""
    import torch

    return values.float().to(torch.bfloat16)


def _bfloat16_round_up(values: torch.Tensor) -> torch.Tensor:
    """The smallest bfloat16 at least each non-negative f64 of ``values``."""
    import torch

    nearest = _bfloat16_nearest(values)
    below = nearest.double() < values
    return torch.where(below, (nearest.view(torch.int16) + 1).view(torch.bfloat16), nearest)

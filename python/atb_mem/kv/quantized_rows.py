"""K/V in a quantized cache (``kv_cache_dtype="int8"`` or ``"fp8_e4m3"``): each token's keys
(or values) for one KV head are one row of ``head_dim`` one-byte codes followed by its
four-byte scale, written once from that token's values alone (the core's row formats,
docs/bytes.md). These convert a model's K/V to such rows and back, on the host.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from atb_mem import _core
from atb_mem._types import KVCacheDtype

__all__ = ["dequantize_rows", "quantize_rows"]


def _as_float32(backend: Any, values: Any) -> np.ndarray:
    """``values`` (numpy, bfloat16 held as uint16 words; or a torch tensor) as float32."""
    if backend.name == "torch":
        array: np.ndarray = values.detach().float().cpu().numpy()
        return array
    array = np.asarray(values)
    if array.dtype == np.uint16:  # the host backing's bfloat16
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.float32)


def quantize_rows(backend: Any, values: Any, kv_cache_dtype: KVCacheDtype, like: Any) -> Any:
    """``values`` ``[tokens, kv_heads, head_dim]`` in the model's dtype as quantized rows
    ``[tokens, kv_heads, row_bytes]``, an array of ``backend`` where ``like`` (the cache) is."""
    flat = np.ascontiguousarray(_as_float32(backend, values))
    tokens, heads, head_dim = flat.shape
    rows = np.empty((tokens * heads, like.shape[-1]), dtype=np.uint8)
    _core.quantize_kv_rows(flat.reshape(tokens * heads, head_dim), rows, kv_cache_dtype)
    shaped = rows.reshape(tokens, heads, -1)
    if backend.name == "torch":
        import torch

        return torch.from_numpy(shaped).to(like.device)
    return shaped


def dequantize_rows(rows: Any, kv_cache_dtype: KVCacheDtype, head_dim: int) -> np.ndarray:
    """Quantized rows ``[..., row_bytes]`` (numpy or torch) as float32 ``[..., head_dim]``."""
    if not isinstance(rows, np.ndarray):
        rows = rows.detach().cpu().numpy()
    flat = np.ascontiguousarray(rows).reshape(-1, rows.shape[-1])
    out = np.empty((flat.shape[0], head_dim), dtype=np.float32)
    _core.dequantize_kv_rows(flat, out, kv_cache_dtype)
    return out.reshape(*rows.shape[:-1], head_dim)

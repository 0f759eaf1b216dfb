"""Which paged kernel a model runner's attention layers run on.

``"auto"``: atb-mem's own kernel on the CPU (:mod:`atb_mem.integrations.cpu_attention`);
FlashInfer on CUDA where it imports and runs the model's head size and dtype, else the torch
reference with a one-line warning. ``"cpu"`` and ``"flashinfer"`` insist on theirs; ``"torch"``
is the reference (:mod:`atb_mem.integrations.reference_attention`) everywhere.
"""

from __future__ import annotations

import warnings
from typing import Any

from atb_mem._types import AttentionBackend, KVCacheDtype
from atb_mem.integrations.cpu_attention import CpuPagedAttention
from atb_mem.integrations.flashinfer import FlashInferAttention

__all__ = ["ATTENTION_BACKENDS", "attention_kernel"]

ATTENTION_BACKENDS: tuple[AttentionBackend, ...] = ("auto", "torch", "flashinfer", "cpu")


def attention_kernel(backend: AttentionBackend, device: Any, num_heads: int, num_kv_heads: int,
                     head_dim: int, block_size: int, dtype: Any,
                     kv_cache_dtype: KVCacheDtype = "auto"
                     ) -> FlashInferAttention | CpuPagedAttention | None:
    """The paged kernel a model runner uses, or None for the torch reference. A quantized
    cache (``kv_cache_dtype``) is read by atb-mem's CPU kernel and by the torch reference;
    FlashInfer's fp8 takes one scale per tensor, not the rows' own, so on CUDA the reference
    serves it (and asking for FlashInfer is an error)."""
    import torch

    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    device = torch.device(device)
    cpu_kernel = backend == "cpu" or (backend == "auto" and device.type == "cpu")
    if kv_cache_dtype != "auto" and backend == "flashinfer":
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: FlashInfer does not read "
                         "atb-mem's quantized rows (a scale per token and head); use "
                         "attention_backend 'auto' or 'torch'")
    if backend == "torch" or (kv_cache_dtype != "auto" and not cpu_kernel):
        return None
    if cpu_kernel:
        if device.type != "cpu":
            raise ValueError(f"the 'cpu' attention backend runs on the CPU, not on {device}")
        return CpuPagedAttention(block_size, dtype, kv_cache_dtype)
    if backend == "auto" and device.type != "cuda":
        return None
    try:
        import flashinfer

        kernel = FlashInferAttention(flashinfer, device, num_heads, num_kv_heads, head_dim,
                                     block_size, dtype)
        kernel.probe()
    except Exception as error:  # any failure to import, build or run the kernel falls back
        reason = f"{type(error).__name__}: {error}".splitlines()[0]
        if backend == "flashinfer":
            raise RuntimeError(f"FlashInfer cannot serve this model here ({reason})") from error
        warnings.warn(f"atb-mem: FlashInfer is not usable here ({reason}); using the torch "
                      "reference attention", stacklevel=3)
        return None
    return kernel

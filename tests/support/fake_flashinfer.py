"""FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` as its documentation states it, in
plain torch on the CPU, so what atb-mem hands the real kernel (which needs CUDA) is checked
here: the CSR page table, the ``plan`` arguments, the ``NHD`` page views, the window.

Semantics (FlashInfer's docs for ``plan``/``run``): row ``r``'s queries are
``q[qo_indptr[r]:qo_indptr[r+1]]``; its K/V are the pages ``kv_indices[kv_indptr[r]:
kv_indptr[r+1]]``, all full but the last, which holds ``kv_last_page_len[r]`` tokens; queries
align with the end of the K/V (query ``i`` of ``n`` sits at ``kv_len - n + i``); ``causal``
hides later keys; ``window_left >= 0`` hides keys more than ``window_left`` before the query.
Stricter than the kernel in one way: every key of a listed page is multiplied in, masked or
not, so a NaN-poisoned page in the table shows up even where the mask hides it.
"""

from __future__ import annotations

import types
from typing import Any

import torch

INT32 = torch.int32


class BatchPrefillWithPagedKVCacheWrapper:
    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD") -> None:
        assert float_workspace_buffer.dtype == torch.uint8
        assert kv_layout == "NHD", kv_layout
        self.calls: list[dict[str, Any]] = CALLS

    def plan(self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor,
             paged_kv_indices: torch.Tensor, paged_kv_last_page_len: torch.Tensor,
             num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, page_size: int, *,
             causal: bool = False, sm_scale: float | None = None, window_left: int = -1,
             q_data_type: Any = torch.float16, kv_data_type: Any = None) -> None:
        for array in (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len):
            assert array.dtype == INT32 and array.dim() == 1, array
        batch = len(qo_indptr) - 1
        assert len(paged_kv_indptr) == batch + 1 and len(paged_kv_last_page_len) == batch
        assert int(paged_kv_indptr[-1]) == len(paged_kv_indices)
        assert bool((paged_kv_indptr.diff() >= 1).all()), "a row without pages"
        assert bool(((paged_kv_last_page_len >= 1) & (paged_kv_last_page_len <= page_size))
                    .all()), paged_kv_last_page_len
        assert num_qo_heads % num_kv_heads == 0
        self.qo_indptr, self.kv_indptr = qo_indptr.tolist(), paged_kv_indptr.tolist()
        self.kv_indices = paged_kv_indices.long()
        self.last_page_len = paged_kv_last_page_len.tolist()
        self.heads, self.kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim_qk
        self.page_size, self.causal, self.window_left = page_size, causal, window_left
        self.sm_scale = sm_scale if sm_scale is not None else head_dim_qk ** -0.5
        self.q_data_type = q_data_type
        self.kv_data_type = kv_data_type or q_data_type

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]
            ) -> torch.Tensor:
        k_cache, v_cache = paged_kv_cache
        assert q.is_contiguous() and q.dtype == self.q_data_type
        assert tuple(q.shape) == (self.qo_indptr[-1], self.heads, self.head_dim), q.shape
        for cache in (k_cache, v_cache):
            assert cache.dtype == self.kv_data_type
            assert tuple(cache.shape[1:]) == (self.page_size, self.kv_heads, self.head_dim)
        CALLS.append({"window_left": self.window_left, "tokens": q.shape[0]})
        out = torch.empty_like(q)
        group = self.heads // self.kv_heads
        for row in range(len(self.qo_indptr) - 1):
            pages = self.kv_indices[self.kv_indptr[row]:self.kv_indptr[row + 1]]
            length = (len(pages) - 1) * self.page_size + self.last_page_len[row]
            keys = k_cache[pages].reshape(-1, self.kv_heads, self.head_dim)[:length]
            values = v_cache[pages].reshape(-1, self.kv_heads, self.head_dim)[:length]
            start, end = self.qo_indptr[row], self.qo_indptr[row + 1]
            query_positions = length - (end - start) + torch.arange(end - start)
            key_positions = torch.arange(length)
            visible = torch.ones((end - start, length), dtype=torch.bool)
            if self.causal:
                visible &= key_positions[None, :] <= query_positions[:, None]
            if self.window_left >= 0:
                visible &= key_positions[None, :] >= query_positions[:, None] - self.window_left
            keys = keys.float().repeat_interleave(group, 1)
            values = values.float().repeat_interleave(group, 1)
            logits = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys) * self.sm_scale
            weights = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
            out[start:end] = torch.einsum("hqk,khd->qhd", weights, values).to(q.dtype)
        return out


CALLS: list[dict[str, Any]] = []
"""Every ``run``: its ``window_left`` and token count (tests check the kernel was used)."""


def module() -> types.ModuleType:
    """A ``flashinfer`` module to put in ``sys.modules``."""
    fake = types.ModuleType("flashinfer")
    fake.BatchPrefillWithPagedKVCacheWrapper = BatchPrefillWithPagedKVCacheWrapper  # type: ignore[attr-defined]
    return fake

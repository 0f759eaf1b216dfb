"""The torch reference attention over atb-mem's paged KV cache: what serves the layers no
paged kernel does (on CUDA without FlashInfer, or with ``attention_backend="torch"``).

Rows whose K/V is all new attend over their own new keys with torch's SDPA; the others gather
their K/V through their block tables (:class:`PagedRows`) and attend with an explicit mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from atb_mem._types import KVCacheDtype
from atb_mem.integrations.layer_attention import LayerAttention
from atb_mem.kv.quantized_rows import dequantize_tensor_rows

if TYPE_CHECKING:
    import torch

    from atb_mem.scheduling.continuous import StepPlan

__all__ = ["PagedRows", "attend_paged", "sdpa_attention"]


@dataclass(frozen=True)
class PagedRows:
    """Rows attended together over K/V gathered through their block tables: ``Q`` is the
    longest row's new tokens, ``L`` the longest row's K/V length. Padding gathers slot 0 and is
    masked out and zeroed (0 × NaN is NaN: a poisoned block behind padding must not leak)."""

    tokens: torch.Tensor
    """int64 ``[rows, Q]``: the step-token index of each row's ``j``-th new token (0: padding)."""
    token_ids: torch.Tensor
    token_row: torch.Tensor
    token_col: torch.Tensor
    """int64 ``[n]``: the rows' real tokens, and each one's row and place in the row."""
    kv_slots: torch.Tensor
    """int64 ``[rows, L]``: the slot of each row's ``j``-th K/V position (0 for padding)."""
    kv_valid: torch.Tensor
    """bool ``[rows, L, 1, 1]``: ``j`` < the row's length."""
    masks: dict[LayerAttention, torch.Tensor]
    """Per kind of layer, bool ``[rows, 1, Q, L]``: the new token may attend position ``j``."""

    @classmethod
    def build(cls, plan: StepPlan, rows: np.ndarray, tables: np.ndarray, block_size: int,
              device: Any, kinds: set[LayerAttention]) -> PagedRows:
        """``tables``: the block tables of the plan's rows in the layers' KV-cache group; a
        null block there (a window released it) is padding too."""
        import torch

        query_lens = plan.query_lens.astype(np.int64)[rows]
        seq_lens = plan.seq_lens.astype(np.int64)[rows]
        starts = plan.query_start_loc.astype(np.int64)[rows]
        width, length = int(query_lens.max()), int(seq_lens.max())
        token_row = np.repeat(np.arange(len(rows)), query_lens)
        token_col = np.arange(len(token_row)) - np.repeat(np.cumsum(query_lens) - query_lens,
                                                          query_lens)
        token_ids = starts[token_row] + token_col
        tokens = np.zeros((len(rows), width), dtype=np.int64)
        tokens[token_row, token_col] = token_ids
        positions = np.arange(length)
        tables = tables[rows]
        columns = np.minimum(positions // block_size, tables.shape[1] - 1)
        blocks = tables[:, columns].astype(np.int64)
        kv_valid = (positions[None, :] < seq_lens[:, None]) & (blocks != 0)
        kv_slots = blocks * block_size + positions % block_size
        kv_slots[~kv_valid] = 0
        # The j-th new token of a row sits at position seq_len - query_len + j.
        query_positions = (seq_lens - query_lens)[:, None] + np.arange(width)[None, :]
        padded = np.nonzero(np.arange(width)[None, :] >= query_lens[:, None])

        def tensor(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array)).to(device)

        def mask(kind: LayerAttention) -> torch.Tensor:
            visible = kind.visible(query_positions[:, :, None], positions[None, None, :])
            visible &= kv_valid[:, None, :]
            visible[padded] = kv_valid[padded[0]]  # padding rows: any finite softmax
            return tensor(visible[:, None])

        return cls(tokens=tensor(tokens), token_ids=tensor(token_ids),
                   token_row=tensor(token_row), token_col=tensor(token_col),
                   kv_slots=tensor(kv_slots), kv_valid=tensor(kv_valid[:, :, None, None]),
                   masks={kind: mask(kind) for kind in kinds})


def sdpa_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               mask: torch.Tensor | None, scaling: float | None,
               sinks: torch.Tensor | None) -> torch.Tensor:
    """``[B, H, Q, D]`` queries over ``[B, kv, L, D]`` keys and values; ``mask`` None means
    causal with Q == L. With ``sinks`` (``[H]``) each head's softmax also spreads over one
    extra logit that carries no value, as gpt-oss trains it."""
    import torch
    import torch.nn.functional as F

    if sinks is None:
        return F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask,
                                              is_causal=mask is None, scale=scaling,
                                              enable_gqa=True)
    if mask is None:
        length = keys.shape[2]
        mask = torch.ones((length, length), dtype=torch.bool, device=keys.device).tril()
    group = queries.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scale = scaling if scaling is not None else queries.shape[-1] ** -0.5
    logits = torch.matmul(queries, keys.transpose(2, 3)) * scale
    logits = logits.masked_fill(~mask, float("-inf"))
    sink = sinks.to(logits.dtype).reshape(1, -1, 1, 1).expand(*logits.shape[:3], 1)
    weights = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(weights.to(values.dtype), values)


def attend_paged(queries_by_token: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, rows: PagedRows, mask: torch.Tensor,
                 scaling: float | None, sinks: torch.Tensor | None,
                 kv_cache_dtype: KVCacheDtype = "auto") -> torch.Tensor:
    """The rows' new tokens attending over their gathered K/V: ``[n, heads, D]``; a
    quantized cache's rows (``kv_cache_dtype``) are dequantized as they are gathered."""
    import torch

    count, length = rows.kv_slots.shape
    slots = rows.kv_slots.reshape(-1)
    dtype = queries_by_token.dtype

    def gathered(cache: torch.Tensor) -> torch.Tensor:
        """[rows, L, kv, D] -> [rows, kv, L, D], padding zeroed."""
        kv = cache.index_select(0, slots)
        if kv_cache_dtype != "auto":
            kv = dequantize_tensor_rows(kv, kv_cache_dtype)
        kv = kv.view(count, length, *kv.shape[1:])
        return torch.where(rows.kv_valid, kv, 0).to(dtype).transpose(1, 2)

    keys, values = gathered(key_cache), gathered(value_cache)
    queries = queries_by_token[rows.tokens].transpose(1, 2)               # [rows, H, Q, D]
    out = sdpa_attention(queries, keys, values, mask, scaling, sinks)
    return out.transpose(1, 2)[rows.token_row, rows.token_col]

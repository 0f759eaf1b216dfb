"""Reference paged attention: decode attention that reads K/V through a block table.

It exists to prove the layout: K/V caches ``[num_blocks, block_size, num_kv_heads, head_dim]``
(ATB's PagedAttention / vLLM layout), ``block_tables`` int32 ``[batch, max_blocks]`` padded
with block 0, ``context_lens`` int32 ``[batch]``. Grouped-query attention: query head ``h``
reads KV head ``h // (num_heads // num_kv_heads)``. Computed in float32, returned in the
query's dtype. Works on numpy arrays and on torch tensors (whichever ``query`` is).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import torch

__all__ = ["dense_attention", "paged_attention"]


def _check(query: Any, key_cache: Any, block_tables: Any, context_lens: Any) -> tuple[int, int]:
    if query.ndim != 3 or key_cache.ndim != 4:
        raise ValueError("query must be [batch, heads, head_dim] and the caches "
                         "[num_blocks, block_size, kv_heads, head_dim]")
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    if num_heads % num_kv_heads or query.shape[2] != key_cache.shape[3]:
        raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads of "
                         f"dim {key_cache.shape[3]} (query head_dim {query.shape[2]})")
    if len(block_tables) != query.shape[0] or len(context_lens) != query.shape[0]:
        raise ValueError("block_tables and context_lens need one row per query")
    return num_heads, num_kv_heads


def paged_attention(query: Any, key_cache: Any, value_cache: Any, block_tables: Any,
                    context_lens: Any, scale: float | None = None) -> Any:
    """Attention of one new token per sequence over its cached context."""
    num_heads, num_kv_heads = _check(query, key_cache, block_tables, context_lens)
    scale = 1.0 / math.sqrt(query.shape[2]) if scale is None else scale
    group = num_heads // num_kv_heads
    if isinstance(query, np.ndarray):
        return _paged_numpy(query, key_cache, value_cache, block_tables, context_lens, group,
                            scale)
    return _paged_torch(query, key_cache, value_cache, block_tables, context_lens, group, scale)


def _paged_numpy(query: npt.NDArray[Any], key_cache: npt.NDArray[Any],
                 value_cache: npt.NDArray[Any], block_tables: Any, context_lens: Any,
                 group: int, scale: float) -> npt.NDArray[Any]:
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    out = np.empty(query.shape, dtype=np.float32)
    for row, length in enumerate(np.asarray(context_lens).tolist()):
        blocks = np.asarray(block_tables[row][: -(-length // block_size)])
        keys = key_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length]
        values = value_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length]
        out[row] = _attend_numpy(query[row], keys, values, group, scale)
    return out.astype(query.dtype)


def _paged_torch(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 block_tables: Any, context_lens: Any, group: int,
                 scale: float) -> torch.Tensor:
    import torch

    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    out = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    lens = context_lens.tolist() if hasattr(context_lens, "tolist") else list(context_lens)
    for row, length in enumerate(lens):
        blocks = torch.as_tensor(block_tables[row][: -(-int(length) // block_size)],
                                 device=key_cache.device, dtype=torch.long)
        keys = key_cache.index_select(0, blocks).reshape(-1, num_kv_heads, head_dim)
        values = value_cache.index_select(0, blocks).reshape(-1, num_kv_heads, head_dim)
        keys = keys[:length].float().repeat_interleave(group, dim=1)      # [n, heads, d]
        values = values[:length].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", query[row].float(), keys) * scale
        out[row] = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), values)
    return out.to(query.dtype)


def _attend_numpy(query: npt.NDArray[Any], keys: npt.NDArray[Any], values: npt.NDArray[Any],
                  group: int, scale: float) -> npt.NDArray[np.float32]:
    keys = np.repeat(keys.astype(np.float32), group, axis=1)       # [n, heads, d]
    values = np.repeat(values.astype(np.float32), group, axis=1)
    scores = np.einsum("hd,nhd->hn", query.astype(np.float32), keys) * scale
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    attended: npt.NDArray[np.float32] = np.einsum("hn,nhd->hd", weights, values)
    return attended


def dense_attention(query: np.ndarray, keys: list[np.ndarray], values: list[np.ndarray],
                    scale: float | None = None) -> np.ndarray:
    """The same attention over contiguous K/V (``keys[i]``: ``[len_i, kv_heads, head_dim]``),
    with a plain numpy softmax: the reference paged attention is checked against it."""
    scale = 1.0 / math.sqrt(query.shape[2]) if scale is None else scale
    group = query.shape[1] // keys[0].shape[1]
    out = np.stack([_attend_numpy(q, k, v, group, scale)
                    for q, k, v in zip(query, keys, values, strict=True)])
    return out.astype(query.dtype)

"""KV caches on the devices the tests run on, the arrays written into and read out of
them (numpy on the host, torch tensors on a torch device), and the attention check over them."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import atb_mem
from atb_mem.kv.attention import dense_attention, paged_attention
from tests.support.devices import require_torch

TOLERANCE = {"float32": 2e-5, "float16": 3e-3, "bfloat16": 3e-2}


def make_pool(device: str, dtype: str = "float32", **kwargs: Any) -> atb_mem.KVCachePool:
    if device != "host":
        torch = require_torch()
        if device == "cuda" and not torch.cuda.is_available():
            pytest.fail("the cuda tests were asked for (-m cuda) but CUDA is not available")
    options = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": dtype} | kwargs
    return atb_mem.KVCachePool(64, 4, device=device, **options)


def random_kv(pool: atb_mem.KVCachePool, n: int, rng: np.random.Generator) -> tuple[Any, Any]:
    shape = (n, pool.num_kv_heads, pool.head_dim)
    key = rng.standard_normal(shape).astype(np.float32) + 0.5  # never zeros
    value = rng.standard_normal(shape).astype(np.float32) - 0.5
    return convert(pool, key), convert(pool, value)


def convert(pool: atb_mem.KVCachePool, array: np.ndarray) -> Any:
    if pool.device == "host":
        return array.astype(pool.kv_cache.dtype)
    torch = require_torch()
    return torch.from_numpy(array).to(dtype=pool.kv_cache.dtype, device=pool.kv_cache.device)


def as_numpy(value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value.astype(np.float32)
    return value.detach().float().cpu().numpy()


def check_attention(pool: atb_mem.KVCachePool, history: dict[int, tuple[Any, Any]],
                    lengths: list[int], rng: np.random.Generator, dtype: str) -> None:
    seq_ids = list(history)
    heads = 8  # grouped-query: 8 query heads share 2 KV heads
    query = rng.standard_normal((len(seq_ids), heads, pool.head_dim)).astype(np.float32)
    tables, lens = pool.block_tables(seq_ids), pool.context_lens(seq_ids)
    assert lens.tolist() == lengths
    out = paged_attention(convert(pool, query), pool.key_cache(1), pool.value_cache(1),
                          tables, lens)
    rounded = as_numpy(convert(pool, query))
    expected = dense_attention(rounded, [history[s][0] for s in seq_ids],
                               [history[s][1] for s in seq_ids])
    np.testing.assert_allclose(as_numpy(out), expected, rtol=TOLERANCE[dtype],
                               atol=TOLERANCE[dtype])
    if pool.device != "host":
        torch = require_torch()
        for row, seq_id in enumerate(seq_ids):
            keys, values = (torch.from_numpy(t).transpose(0, 1) for t in history[seq_id])
            q = torch.from_numpy(rounded[row]).unsqueeze(1)        # [heads, 1, d]
            group = heads // pool.num_kv_heads
            sdpa = torch.nn.functional.scaled_dot_product_attention(
                q, keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0))
            np.testing.assert_allclose(as_numpy(out)[row], sdpa.squeeze(1).numpy(),
                                       rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])

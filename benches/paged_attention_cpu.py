"""atb-mem's CPU paged-attention kernel against torch's SDPA over K/V gathered through the
same block tables (what the torch reference path does), in one process, alternating rounds.

Decode: ``S`` sequences of ``L`` cached tokens each get one new token. Prefill: one row's
256-, 512- and 2,048-token chunks with no context (also against SDPA causal over the new K/V
alone, no gather), and a 2,048-token chunk after 2,048 cached tokens. The shapes are the Engine
benchmark's model (4 query heads, 2 KV heads of 64, 16-token blocks, fp32) unless given. The
kernel runs on torch's OpenMP threads, as in the Engine (``--own-threads``: a pool of its own).

    python benches/paged_attention_cpu.py --rounds 5
    python benches/paged_attention_cpu.py --heads 16 --kv-heads 8 --head-dim 128 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from atb_mem import _core
from atb_mem.integrations.cpu_attention import numpy_bits, share_torchs_threads

Calls = tuple[Callable[[], object], Callable[[], object], Callable[[], object] | None]


def case(rows: int, cached: int, new: int, heads: int, kv_heads: int, dim: int,
         block_size: int, dtype: str = "float32") -> Calls:
    """The kernel's call, the gather + SDPA baseline and, for rows without context, SDPA
    causal over the new K/V alone (no gather, no mask: what attends a first prefill chunk
    fastest in torch) for one shape."""
    length = cached + new
    per_row = -(-length // block_size)
    num_blocks = rows * per_row + 1
    generator = torch.Generator().manual_seed(0)
    element = getattr(torch, dtype)
    keys = torch.randn(num_blocks * block_size, kv_heads, dim, generator=generator).to(element)
    values = torch.randn(num_blocks * block_size, kv_heads, dim, generator=generator).to(element)
    queries = torch.randn(rows * new, heads, dim, generator=generator).to(element)
    order = np.random.default_rng(0).permutation(np.arange(1, num_blocks))
    tables = order.reshape(rows, per_row).astype(np.int32)
    starts = np.arange(rows + 1, dtype=np.int32) * new
    seq_lens = np.full(rows, length, dtype=np.int32)
    out = torch.empty_like(queries)
    threads = torch.get_num_threads()

    def kernel() -> object:
        _core.paged_attention(numpy_bits(queries), numpy_bits(keys), numpy_bits(values),
                              numpy_bits(out), starts, seq_lens, tables,
                              block_size=block_size, scale=dim ** -0.5, dtype=dtype,
                              threads=threads)
        return out

    positions = np.arange(length)
    slots = torch.from_numpy(
        (tables[:, positions // block_size].astype(np.int64) * block_size
         + positions % block_size).reshape(-1))
    causal = torch.ones(new, length, dtype=torch.bool).tril(cached)

    def gathered() -> object:
        k = keys.index_select(0, slots).view(rows, length, kv_heads, dim).transpose(1, 2)
        v = values.index_select(0, slots).view(rows, length, kv_heads, dim).transpose(1, 2)
        q = queries.view(rows, new, heads, dim).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal, enable_gqa=True)

    torch.testing.assert_close(
        kernel(), gathered().transpose(1, 2).reshape(rows * new, heads, dim),  # type: ignore[union-attr]
        atol=1e-4 if dtype == "float32" else 3e-2, rtol=1e-4 if dtype == "float32" else 3e-2)
    new_keys = keys[slots].view(rows, length, kv_heads, dim).transpose(1, 2).contiguous()
    new_values = values[slots].view(rows, length, kv_heads, dim).transpose(1, 2).contiguous()
    by_head = queries.view(rows, new, heads, dim).transpose(1, 2).contiguous()

    def causal_new() -> object:
        return F.scaled_dot_product_attention(by_head, new_keys, new_values, is_causal=True,
                                              enable_gqa=True)

    return kernel, gathered, causal_new if cached == 0 else None


def timed(call: Callable[[], object], repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--own-threads", action="store_true",
                        help="the kernel on a pool of its own, not torch's OpenMP threads")
    args = parser.parse_args()
    shape = (args.heads, args.kv_heads, args.head_dim, args.block_size)
    cases = {f"decode {rows} x {cached}": (rows, cached, 1)
             for rows in (64, 256) for cached in (512, 4096)}
    cases.update({"prefill 256, no context": (1, 0, 256),
                  "prefill 512, no context": (1, 0, 512),
                  "prefill 2048, no context": (1, 0, 2048),
                  "prefill 2048 after 2048": (1, 2048, 2048)})
    runtime = None if args.own_threads else share_torchs_threads()
    print(f"torch threads: {torch.get_num_threads()}, the kernel's on "
          f"{runtime or 'a pool of its own'}; heads, kv heads, head_dim, block: {shape}, "
          f"{args.dtype}")
    print(f"{'case':28} {'kernel ms':>10} {'gather+SDPA ms':>15} {'speed-up':>9} "
          f"{'SDPA causal, new K/V ms':>24} {'speed-up':>9}")
    for name, (rows, cached, new) in cases.items():
        kernel, gathered, causal_new = case(rows, cached, new, *shape, args.dtype)
        repeats = 3 if rows * (cached + new) > 200_000 else 10
        ours, theirs, fresh = [], [], []
        for _ in range(args.rounds):
            ours.append(timed(kernel, repeats))
            theirs.append(timed(gathered, repeats))
            if causal_new is not None:
                fresh.append(timed(causal_new, repeats))
        a, b = statistics.median(ours) * 1e3, statistics.median(theirs) * 1e3
        line = f"{name:28} {a:10.2f} {b:15.2f} {b / a:8.2f}x"
        if fresh:
            c = statistics.median(fresh) * 1e3
            line += f" {c:24.2f} {c / a:8.2f}x"
        print(line)


if __name__ == "__main__":
    main()

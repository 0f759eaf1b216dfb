"""Moving KV bytes (issue 4): write_kv and swap_out/swap_in in GB/s, each against a plain
contiguous copy of the same bytes (torch ``copy_`` / numpy ``copyto``) measured in the same run.

    python -m pytest benches/test_bench_kv_tensors.py --benchmark-enable --benchmark-only -s

Model shape: 8 KV heads of 128, float16, block size 16 (4 KiB of K+V per token per layer).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import atb_mem
from atb_mem.tools import workloads

HEADS, HEAD_DIM, BLOCK = 8, 128, 16


DEVICES = ["host", "cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def synchronizer(device: str) -> Callable[[], None]:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.synchronize
    return lambda: None


def median_seconds(run: Callable[[], object], device: str, repeat: int = 7) -> float:
    return workloads.median_per_operation((run, 1), repeat, warmup=True,
                                           synchronize=synchronizer(device))


def contiguous_copy(device: str, nbytes: int) -> Callable[[], None]:
    if device == "host":
        src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
        return lambda: np.copyto(dst, src)
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    return lambda: dst.copy_(src)


def tensor(device: str, array: np.ndarray) -> Any:
    if device == "host":
        return array
    import torch

    return torch.from_numpy(array).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens", [256, 4096])
def test_write_kv(benchmark, device: str, tokens: int) -> None:
    num_blocks = 4096 // BLOCK * 2 + 300
    pool = atb_mem.KVCachePool(num_blocks, BLOCK, device=device, num_kv_heads=HEADS,
                               head_dim=HEAD_DIM, dtype="float16")
    if tokens == 256:  # a decode step: one new token for each of 256 sequences
        for seq_id in range(256):
            pool.alloc_sequence(seq_id, 1)
        slots = pool.slot_mapping(list(range(256)), [0] * 256, [1] * 256)
    else:  # a 4,096-token prefill
        pool.alloc_sequence(0, tokens)
        slots = pool.slot_mapping([0], [0], [tokens])
    rng = np.random.default_rng(20240607)
    key = tensor(device, rng.standard_normal((tokens, HEADS, HEAD_DIM)).astype(np.float16))
    value = tensor(device, rng.standard_normal((tokens, HEADS, HEAD_DIM)).astype(np.float16))
    benchmark.pedantic(pool.write_kv, args=(0, slots, key, value), rounds=20, iterations=1)
    keys, _ = pool.key_cache(0), pool.value_cache(0)
    flat = pool.slot_mapping([0], [0], [1]) if tokens == 4096 else slots[:1]
    assert float(keys.reshape(-1, HEADS, HEAD_DIM)[int(flat[0])][0, 0]) == float(key[0, 0, 0])
    if benchmark.disabled:  # run once as a test: nothing to time
        return
    nbytes = 2 * tokens * HEADS * HEAD_DIM * 2
    written = median_seconds(lambda: pool.write_kv(0, slots, key, value), device)
    baseline = median_seconds(contiguous_copy(device, nbytes), device)
    print(f"\nwrite_kv {device} {tokens} tokens: {nbytes / written / 1e9:.2f} GB/s; contiguous "
          f"copy {nbytes / baseline / 1e9:.2f} GB/s ({baseline / written:.0%})")


@pytest.mark.parametrize("device", DEVICES)
def test_swap_one_gib(benchmark, device: str) -> None:
    layers = 4
    block_bytes = 2 * layers * BLOCK * HEADS * HEAD_DIM * 2  # 256 KiB
    blocks = (1 << 30) // block_bytes
    pool = atb_mem.KVCachePool(blocks + 64, BLOCK, device=device, num_layers=layers,
                               num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype="float16",
                               num_host_blocks=blocks)
    seq_ids = list(range(64))
    for seq_id in seq_ids:
        pool.alloc_sequence(seq_id, blocks // 64 * BLOCK)

    def round_trip() -> None:
        pool.swap_out(seq_ids)
        pool.swap_in(seq_ids)

    benchmark.pedantic(round_trip, rounds=3, iterations=1)
    assert pool.num_free_host_blocks == blocks and not pool.is_swapped(0)
    if benchmark.disabled:
        return
    out = median_seconds(round_trip, device, repeat=3)
    baseline = median_seconds(contiguous_copy(device, 1 << 30), device, repeat=3)
    # One round trip moves the GiB twice.
    rate = 2 * (1 << 30) / out
    print(f"\nswap_out+swap_in {device} of 1 GiB: {rate / 1e9:.2f} GB/s; contiguous copy "
          f"{(1 << 30) / baseline / 1e9:.2f} GB/s ({rate * baseline / (1 << 30):.0%})")

"""Sizing a KV cache from memory figures: plan_kv_cache and KVCachePool.from_device."""

from __future__ import annotations

import pytest

import atb_mem
from tests.kv.kv_arrays import make_pool
from tests.support.devices import DEVICES


def test_plan_kv_cache_arithmetic_and_refusals() -> None:
    gib = 1 << 30
    plan = atb_mem.plan_kv_cache(80 * gib, 16 * gib, gpu_memory_utilization=0.9,
                                 block_size=16, num_layers=32, num_kv_heads=8, head_dim=128,
                                 dtype="float16", max_model_len=8192)
    assert plan.bytes_per_block == 2 * 32 * 16 * 8 * 128 * 2
    usable = int(80 * gib * 0.9) - 16 * gib
    assert plan.usable_bytes == usable
    assert plan.num_blocks == usable // plan.bytes_per_block
    assert plan.blocks_per_seq == 512
    assert plan.max_num_seqs == int(usable / (512 * plan.bytes_per_block) * 0.9)
    base = {"block_size": 16, "num_layers": 32, "num_kv_heads": 8, "head_dim": 128,
            "dtype": "float16", "max_model_len": 8192}
    for args, kwargs, match in [
        ((80 * gib, 16 * gib), {"gpu_memory_utilization": 0.0}, "utilization"),
        ((80 * gib, 16 * gib), {"gpu_memory_utilization": 1.5}, "utilization"),
        ((80 * gib, 90 * gib), {}, "does not fit"),
        ((17 * gib, 16 * gib), {"gpu_memory_utilization": 1.0}, "fewer than one"),
        ((80 * gib, 16 * gib), {"safety": 0}, "safety"),
        ((80 * gib, 16 * gib), {"dtype": "float8"}, "dtype"),
        ((80 * gib, -1), {}, "model_bytes"),
    ]:
        with pytest.raises(ValueError, match=match):
            atb_mem.plan_kv_cache(*args, **(base | kwargs))


@pytest.mark.parametrize("device", DEVICES)
def test_from_device_sizes_the_pool(device: str) -> None:
    if device != "host":
        make_pool(device)  # checks torch (and CUDA) are there
    from atb_mem.kv.cache_pool import device_memory

    free, total = device_memory(device)
    assert 0 < free <= total
    pool = atb_mem.KVCachePool.from_device(
        device, gpu_memory_utilization=0.001, model_bytes=0, block_size=16, num_layers=2,
        num_kv_heads=2, head_dim=64, dtype="float16", max_model_len=256)
    plan = atb_mem.plan_kv_cache(total, 0, gpu_memory_utilization=0.001, block_size=16,
                                 num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16",
                                 max_model_len=256)
    assert pool.num_blocks == min(plan.num_blocks, free // plan.bytes_per_block)
    assert pool.bytes_per_block == plan.bytes_per_block
    assert pool.device.startswith(device)
    with pytest.raises(ValueError, match="does not fit"):
        atb_mem.KVCachePool.from_device(device, model_bytes=total, block_size=16, num_layers=2,
                                        num_kv_heads=2, head_dim=64, max_model_len=256)



def test_windowed_layers_cost_their_window() -> None:
    """Gemma-3-like: 5 full and 27 sliding layers of a 1024 window make 7 groups of 5 layers
    per block; a 32k sequence costs the full group 2048 blocks and each sliding group 65."""
    types = ["full_attention" if (layer + 1) % 6 == 0 else "sliding_attention"
             for layer in range(32)]
    common = {"block_size": 16, "num_layers": 32, "num_kv_heads": 8, "head_dim": 128,
              "dtype": "bfloat16", "max_model_len": 32768}
    plain = atb_mem.plan_kv_cache(141 << 30, 20 << 30, **common)  # type: ignore[arg-type]
    grouped = atb_mem.plan_kv_cache(141 << 30, 20 << 30, layer_types=types, sliding_window=1024,
                            **common)  # type: ignore[arg-type]
    assert grouped.num_groups == 7 and plain.num_groups == 1
    assert grouped.bytes_per_block * 32 == plain.bytes_per_block * 5
    assert grouped.blocks_per_seq == 2048 + 6 * (1024 // 16 + 1)
    assert grouped.max_num_seqs >= 4 * plain.max_num_seqs
    # A window longer than the sequence costs the sequence, not the window.
    short = atb_mem.plan_kv_cache(141 << 30, 20 << 30, layer_types=types, sliding_window=1 << 20,
                          **{**common, "max_model_len": 4096})  # type: ignore[arg-type]
    assert short.blocks_per_seq == 7 * 256


def test_a_host_offload_tier_is_sized_in_blocks_and_tokens() -> None:
    common = {"block_size": 16, "num_layers": 32, "num_kv_heads": 8, "head_dim": 128,
              "dtype": "float16", "max_model_len": 8192}
    without = atb_mem.plan_kv_cache(80 << 30, 16 << 30, **common)  # type: ignore[arg-type]
    plan = atb_mem.plan_kv_cache(80 << 30, 16 << 30, host_offload_bytes=(32 << 30) + 1,
                                 **common)  # type: ignore[arg-type]
    assert without.num_host_blocks == 0 and without.host_tokens == 0
    assert plan.num_blocks == without.num_blocks  # the device's share does not change
    assert plan.num_host_blocks == (32 << 30) // plan.bytes_per_block
    assert plan.host_tokens == plan.num_host_blocks * 16
    assert plan.device_tokens == (plan.num_blocks - 1) * 16
    with pytest.raises(ValueError, match="host_offload_bytes"):
        atb_mem.plan_kv_cache(80 << 30, 16 << 30, host_offload_bytes=-1,
                              **common)  # type: ignore[arg-type]

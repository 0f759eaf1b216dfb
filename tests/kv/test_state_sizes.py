"""What recurrent layers' states take: the plan counts the blocks the pool takes for them (and
for a cached prefix's checkpoints), and model configs give the layer types and state bytes
the pool is built with."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atb_mem import KVCachePool, plan_kv_cache
from atb_mem.kv.model_config import layer_types_of, read_model_config
from atb_mem.kv.state_layout import STATE_ALIGNMENT, recurrent_state_layout
from tests.kv.hybrid_states import (
    BLOCK_SIZE,
    DIMS,
    FULL,
    LAYERS,
    LINEAR,
    SLOT_BYTES,
    STATE_BLOCKS,
    STATE_BYTES,
    hybrid,
)


@pytest.mark.parametrize(("layer_types", "state_bytes"), [
    (LAYERS, STATE_BYTES),
    ([LINEAR, FULL, LINEAR, FULL], 3 * SLOT_BYTES),
    ([LINEAR, "sliding_attention", LINEAR, FULL], 1),
])
def test_the_plan_counts_the_states_the_pool_takes(layer_types: list[str],
                                                   state_bytes: int) -> None:
    max_model_len = 10 * BLOCK_SIZE + 3
    extra: dict[str, Any] = {"sliding_window": 8} if "sliding_attention" in layer_types else {}
    plan = plan_kv_cache(1 << 20, 0, gpu_memory_utilization=1.0, block_size=BLOCK_SIZE,
                         max_model_len=max_model_len, layer_types=layer_types,
                         state_bytes=state_bytes, **DIMS, **extra)
    pool = hybrid(num_blocks=200, layer_types=layer_types, state_bytes=state_bytes, **extra)
    assert plan.bytes_per_block == pool.bytes_per_block
    assert plan.state_blocks_per_seq == pool.num_state_blocks > 0
    # Decoded to the maximum length, a sliding group holding only its window.
    free, peak = pool.num_free_blocks, 0
    pool.alloc_sequence(1, 1)
    while pool.seq_len(1) < max_model_len:
        pool.append_tokens([1], 1)
        pool.mark_computed(1)
        peak = max(peak, free - pool.num_free_blocks)
    assert free - pool.num_free_blocks == peak == plan.blocks_per_seq
    kv_blocks = sum(int(np.count_nonzero(pool.block_table(1, group=g)))
                    for g in range(len(pool.groups)))
    assert plan.blocks_per_seq == plan.state_blocks_per_seq + kv_blocks
    assert plan.bytes_per_seq == plan.blocks_per_seq * plan.bytes_per_block
    plain = plan_kv_cache(1 << 20, 0, block_size=BLOCK_SIZE, max_model_len=40, **DIMS)
    assert (plain.state_blocks_per_seq, plain.blocks_per_seq) == (0, 10)
    assert (plain.checkpoint_bytes, plain.prefix_blocks(40)) == (0, 10)


@pytest.mark.parametrize("interval", [1, 2])
def test_the_plan_counts_what_a_cached_prefix_and_its_checkpoints_take(interval: int) -> None:
    """A prompt computed a block at a time, with a checkpoint wherever one is due, leaves
    as many cached blocks as ``prefix_blocks`` says, each checkpoint ``checkpoint_bytes``."""
    plan = plan_kv_cache(1 << 20, 0, block_size=BLOCK_SIZE, max_model_len=64,
                         layer_types=LAYERS, state_bytes=STATE_BYTES, **DIMS)
    assert plan.checkpoint_bytes == STATE_BLOCKS * plan.bytes_per_block
    pool = hybrid(num_blocks=100, state_checkpoint_interval=interval)
    prompt = list(range(6 * BLOCK_SIZE + 1))
    pool.alloc_sequence(1, prompt)
    saved = 0
    for computed in range(BLOCK_SIZE, len(prompt), BLOCK_SIZE):
        pool.mark_computed(1, computed)
        saved += pool.checkpoint_state(1)
    pool.take_pending_copies()
    pool.free_sequence(1)
    assert saved == 6 // interval
    assert pool.stats()["blocks_cached"] == plan.prefix_blocks(6 * BLOCK_SIZE, interval)
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="state_checkpoint_interval"):
            plan.prefix_blocks(4, bad)  # type: ignore[arg-type]
    for tokens in (-1, 2.0, True):
        with pytest.raises(ValueError, match="tokens"):
            plan.prefix_blocks(tokens)  # type: ignore[arg-type]


# ---- model configs ---------------------------------------------------------------------------

GRANITE_LIKE = {"model_type": "granitemoehybrid", "num_hidden_layers": 4, "hidden_size": 64,
                "num_attention_heads": 4, "num_key_value_heads": 2, "dtype": "bfloat16",
                "layers_block_type": ["mamba", "attention", "mamba", "attention"],
                "mamba_expand": 2, "mamba_n_heads": 8, "mamba_n_groups": 1,
                "mamba_d_state": 5, "mamba_d_conv": 4, "mamba_d_head": 16}
QWEN3_NEXT_LIKE = {"model_type": "qwen3_next", "num_hidden_layers": 4, "hidden_size": 64,
                   "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
                   "torch_dtype": "float16", "full_attention_interval": 2,
                   "linear_num_key_heads": 2, "linear_num_value_heads": 3,
                   "linear_key_head_dim": 8, "linear_value_head_dim": 6,
                   "linear_conv_kernel_dim": 3}


def write(tmp_path: Path, config: dict[str, Any]) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_state_bytes_by_hand() -> None:
    """Granite: conv [2 × 64 + 2 × 1 × 5, 4] bf16 = 1104 bytes, aligned up to 1152; SSM
    [8, 16, 5] float32 = 2560. Qwen3-Next: conv [2 × 2 × 8 + 3 × 6, 3] fp16 = 300 bytes, up
    to 320; SSM [3, 8, 6] float32 = 576."""
    granite = recurrent_state_layout(GRANITE_LIKE, "bfloat16")
    assert granite.conv_shape == (138, 4) and granite.ssm_shape == (8, 16, 5)
    assert (granite.conv_bytes, granite.ssm_offset, granite.state_bytes) == (1104, 1152, 3712)
    qwen = recurrent_state_layout(QWEN3_NEXT_LIKE, "float16")
    assert qwen.conv_shape == (50, 3) and qwen.ssm_shape == (3, 8, 6)
    assert (qwen.conv_bytes, qwen.ssm_offset, qwen.state_bytes) == (300, 320, 896)
    assert qwen.ssm_offset % STATE_ALIGNMENT == 0
    # "auto" head dim: the heads split the expanded width (2 × 64 / 8).
    auto = recurrent_state_layout({**GRANITE_LIKE, "mamba_d_head": "auto"}, "bfloat16")
    assert auto == granite
    with pytest.raises(NotImplementedError, match="model_type 'jamba'"):
        recurrent_state_layout({**GRANITE_LIKE, "model_type": "jamba"}, "bfloat16")


@pytest.mark.parametrize(("config", "types", "dtype", "state_bytes"), [
    (GRANITE_LIKE, (LINEAR, FULL, LINEAR, FULL), "bfloat16", 3712),
    (QWEN3_NEXT_LIKE, (LINEAR, FULL, LINEAR, FULL), "float16", 896),
])
def test_model_configs_give_layer_types_and_state_bytes(
        tmp_path: Path, config: dict[str, Any], types: tuple[str, ...], dtype: str,
        state_bytes: int) -> None:
    model = read_model_config(write(tmp_path, config))
    assert model.layer_types == types and model.dtype == dtype
    assert model.state_bytes == recurrent_state_layout(config, dtype).state_bytes == state_bytes
    arguments = model.group_arguments()
    assert arguments["state_bytes"] == state_bytes
    pool = KVCachePool(64, 16, num_layers=model.num_layers, num_kv_heads=model.num_kv_heads,
                       head_dim=model.head_dim, dtype=model.dtype, device=None, **arguments)
    slot = pool.bytes_per_block // pool.layers_per_block
    assert slot == 2 * 16 * model.num_kv_heads * model.head_dim * 2
    assert [g.layers for g in pool.state_groups] == [(0, 2)]
    assert pool.num_state_blocks == math.ceil(state_bytes / slot)


def test_qwen3_next_interval_places_full_attention() -> None:
    config = {**QWEN3_NEXT_LIKE, "num_hidden_layers": 8, "full_attention_interval": 4}
    assert layer_types_of(config) == [LINEAR, LINEAR, LINEAR, FULL] * 2
    del config["full_attention_interval"]  # transformers' default: 4
    assert layer_types_of(config) == [LINEAR, LINEAR, LINEAR, FULL] * 2

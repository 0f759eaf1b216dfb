"""A hybrid model's cache as the state tests build it: three recurrent layers and one full
attention layer, each recurrent state a block's share and a bit (two blocks)."""

from __future__ import annotations

import math
from typing import Any

from atb_mem import KVCachePool

LINEAR, FULL = "linear_attention", "full_attention"
LAYERS = [LINEAR, LINEAR, LINEAR, FULL]
BLOCK_SIZE, HEADS, HEAD_DIM, ITEMSIZE = 4, 2, 8, 2  # float16
# One layer's share of a block: K and V of block_size tokens.
SLOT_BYTES = 2 * BLOCK_SIZE * HEADS * HEAD_DIM * ITEMSIZE
STATE_BYTES = SLOT_BYTES + 44  # a slot and a bit: two blocks per state
STATE_BLOCKS = 3 * math.ceil(STATE_BYTES / SLOT_BYTES)  # one state group per recurrent layer
DIMS: dict[str, Any] = {"num_layers": 4, "num_kv_heads": HEADS, "head_dim": HEAD_DIM,
                        "dtype": "float16"}
COPY, TO_HOST, TO_DEVICE = 0, 1, 2


def hybrid(num_blocks: int = 40, **kwargs: Any) -> KVCachePool:
    arguments: dict[str, Any] = {**DIMS, "layer_types": LAYERS, "state_bytes": STATE_BYTES,
                                 "device": None, **kwargs}
    return KVCachePool(num_blocks, BLOCK_SIZE, **arguments)

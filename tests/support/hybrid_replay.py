"""Replays a trace whose prompts share prefixes through the scheduler on a hybrid model's KV
cache, with KV-cache groups or keeping every block, on the same bytes: the prefix-cache hit
rate and the occupancy (blocks held by running sequences) it ran at.

The requests' lengths come from the Azure code trace (``tests/data``); each prompt is one of
a few shared prefixes (a system prompt and a document) plus its own tokens, so later requests
can hit what earlier ones computed."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import atb_mem
from atb_mem.kv.planning import block_bytes
from atb_mem.tools.simulate import load_trace
from tests.support.data import AZURE_CODE_TRACE

LAYERS = 6
LAYER_TYPES = ["full_attention" if (layer + 1) % 6 == 0 else "sliding_attention"
               for layer in range(LAYERS)]


@dataclass(frozen=True)
class Replay:
    hit_rate: float
    """Prompt tokens served from the cache over tokens that could have been."""
    occupancy: float
    """Mean share of usable blocks held by running sequences, over the steps."""


def prompts(count: int, prefixes: int = 4, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, output tokens) per request: trace lengths, capped at 2048 prompt tokens,
    each prompt starting with one of ``prefixes`` shared prefixes of 256 to 1024 tokens."""
    rng = np.random.default_rng(seed)
    shared = [rng.integers(0, 32000, int(length)).tolist()
              for length in rng.integers(256, 1025, prefixes)]
    out = []
    for request in load_trace(AZURE_CODE_TRACE, count):
        prefix = shared[int(rng.integers(prefixes))]
        own = max(1, min(request.prompt, 2048) - len(prefix))
        out.append((prefix + rng.integers(0, 32000, own).tolist(), min(request.output, 256)))
    return out


def replay(requests: list[tuple[list[int], int]], memory_bytes: int, grouped: bool,
           window: int = 128, block_size: int = 16, max_num_seqs: int = 64) -> Replay:
    """Admits requests in order (one new one a step) through continuous batching."""
    groups = {"layer_types": LAYER_TYPES, "sliding_window": window} if grouped else {}
    shape = {"num_layers": LAYERS, "num_kv_heads": 8, "head_dim": 128, "dtype": "bfloat16",
             **groups}
    bytes_per_block, _ = block_bytes(block_size, **shape)  # type: ignore[arg-type]
    kv = atb_mem.KVCachePool(memory_bytes // bytes_per_block, block_size, device=None,
                             **shape)  # type: ignore[arg-type]
    scheduler = atb_mem.ContinuousBatchScheduler(kv, max_num_seqs=max_num_seqs,
                                                 max_num_batched_tokens=4096)
    usage, pending = [], list(enumerate(requests))[::-1]
    while pending or scheduler.stats()["waiting"] or scheduler.stats()["running"]:
        if pending:
            seq_id, (prompt, output) = pending.pop()
            scheduler.add_request(seq_id, prompt, output)
        plan = scheduler.step()
        scheduler.on_tokens(plan.sample_seq_ids, np.ones(len(plan.sample_seq_ids), np.int32))
        stats = kv.stats()
        usage.append(stats["blocks_used"] / (stats["num_blocks"] - 1))
    stats = kv.stats()
    return Replay(stats["prefix_cache_hit_tokens"] / max(1, stats["prefix_cache_query_tokens"]),
                  float(np.mean(usage)))

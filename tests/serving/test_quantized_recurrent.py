"""Models with recurrent layers (Granite 4.0-H's Mamba2, Qwen3-Next's gated delta-net) over a
quantized cache: the attention layers' K/V is quantized, the recurrent layers' states keep the
model's dtype in the same pool's blocks.

The states are not quantized: the first layer's (recurrent, fed by the embeddings alone) is
bit-equal to an unquantized engine's, while a later one (fed through a quantized attention
layer) is not, which shows the comparison sees the cache's dtype. With quantized K/V, a prefix
resumed from a state checkpoint and a sequence swapped out and back give exactly a recompute's
(or a roomy cache's) tokens, unused blocks poisoned (0xFF: NaN rows and NaN states).
"""

from __future__ import annotations

from typing import Any

import pytest

from atb_mem.serving import Engine
from tests.serving.test_engine_recurrent import mixed_requests, turns
from tests.support.models import (
    RECURRENT_ARCHITECTURES,
    first_samples,
    greedy,
    model_pair,
    run_poisoned,
)

QUANTIZED = ["int8", "fp8_e4m3"]
BLOCK_SIZE = 4


def state_bytes(engine: Engine, layer: int) -> bytes:
    """The state bytes of ``layer`` for the engine's one running sequence."""
    import torch

    kv_cache = engine.kv_cache
    states = engine.runner.recurrent
    assert states is not None
    [seq_id] = list(kv_cache.seq_ids())
    place = states.places[layer]
    blocks = torch.from_numpy(kv_cache.state_table([seq_id])[:, place.columns]).long()
    plane = states.planes[place.slot]                   # [2, num_blocks, ...] bytes
    raw = plane[:, blocks].movedim(0, 1).reshape(-1)   # [K, V] × blocks, in order
    return bytes(raw[:states.layout.state_bytes].numpy())


@pytest.mark.parametrize("architecture", RECURRENT_ARCHITECTURES)
@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_states_keep_the_models_dtype(architecture: str, kv_cache_dtype: str) -> None:
    model, _ = model_pair(architecture)
    prompt = turns(architecture)[1][0][0]
    got = {}
    for kind in ("auto", kv_cache_dtype):
        engine = Engine(model, num_blocks=160, block_size=BLOCK_SIZE, kv_cache_dtype=kind)
        engine.add_request("r", prompt, greedy(4))
        engine.step()                                   # the whole prompt, still running
        got[kind] = [state_bytes(engine, layer) for layer in (0, 3)]
    assert [group.layers for group in engine.kv_cache.state_groups] == [(0,), (1,), (3,)]
    assert got["auto"][0] == got[kv_cache_dtype][0]
    assert got["auto"][1] != got[kv_cache_dtype][1]   # after a quantized attention layer


@pytest.mark.parametrize("architecture", RECURRENT_ARCHITECTURES)
@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_prefixes_resumed_from_state_checkpoints_give_a_recomputes_tokens(
        architecture: str, kv_cache_dtype: str) -> None:
    model, _ = model_pair(architecture)
    _, requests = turns(architecture)

    def serve(**kwargs: Any) -> tuple[list[list[int]], list[int]]:
        # Quantized rows are smaller: a state takes ~3x the blocks of an fp32 cache.
        engine = Engine(model, num_blocks=1600, block_size=BLOCK_SIZE,
                        kv_cache_dtype=kv_cache_dtype, **kwargs)
        outputs, hits = [], []
        for index, (prompt, _) in enumerate(requests):
            before = engine.kv_cache.stats()["prefix_cache_hit_tokens"]
            result = run_poisoned(engine, {0: [(f"t{index}", prompt, greedy(6))]})
            outputs.append(result[f"t{index}"][0][0])
            hits.append(engine.kv_cache.stats()["prefix_cache_hit_tokens"] - before)
        return outputs, hits

    want, _ = serve(enable_prefix_caching=False)
    got, hits = serve(state_checkpoint_interval=1)
    assert hits == [expected for _, expected in requests]
    assert got == want


@pytest.mark.parametrize("architecture", RECURRENT_ARCHITECTURES)
@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_sequences_swapped_out_and_back_give_a_roomy_caches_tokens(
        architecture: str, kv_cache_dtype: str) -> None:
    model, _ = model_pair(architecture)

    def serve(**kwargs: Any) -> tuple[dict[str, list[int]], Engine]:
        engine = Engine(model, block_size=BLOCK_SIZE, max_num_seqs=5,
                        max_num_batched_tokens=16, kv_cache_dtype=kv_cache_dtype, **kwargs)
        return first_samples(engine, mixed_requests()), engine

    want, _ = serve(num_blocks=400)
    # Room for two sequences' states (more blocks each than unquantized) and a little K/V:
    # ten blocks of it make these requests preempt one another, on both models.
    state_blocks = Engine(model, num_blocks=400, block_size=BLOCK_SIZE,
                          kv_cache_dtype=kv_cache_dtype).kv_cache.num_state_blocks
    tight = 2 * state_blocks + 10
    got, swapping = serve(num_blocks=tight, preemption="swap", num_host_blocks=400)
    assert swapping.scheduler.stats()["preemptions"] > 0
    assert got == want
    assert swapping.kv_cache.stats()["blocks_used"] == 0

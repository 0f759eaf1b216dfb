"""The engine's greedy tokens equal HF's own ``generate``, token for token, per architecture:
alone around block boundaries, and in a continuous batch with arrivals mid-way, early
finishes, preemption (both modes) and prefix hits — with every unused block poisoned (NaN)
before each step, so reading a block that is not the sequence's fails."""

from __future__ import annotations

import numpy as np
import pytest

from atb_mem.serving import Engine, SamplingParams
from tests.support.models import ARCHITECTURES, hf_greedy, model_pair, run_poisoned

BLOCK_SIZE = 4
GREEDY = SamplingParams(max_tokens=10, temperature=0)


def prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 256, size=length).tolist()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_single_prompts_around_block_boundaries(architecture: str, device: str) -> None:
    model, reference = (one.to(device) for one in model_pair(architecture))
    engine = Engine(model, num_blocks=32, block_size=BLOCK_SIZE)
    for length in (1, 3, 4, 5, 8, 9, 16, 17):
        tokens = prompt(length, length)
        results = run_poisoned(engine, {0: [("alone", tokens, GREEDY)]})
        produced, reason = results["alone"][0]
        expected = hf_greedy(reference, tokens, GREEDY.max_tokens)
        assert produced == expected, f"prompt of {length} tokens"
        assert reason == ("length" if len(expected) == GREEDY.max_tokens else "stop")
    assert engine.kv_cache.stats()["blocks_used"] == 0


def mixed_requests() -> dict[int, list[tuple[str, list[int], SamplingParams]]]:
    """Requests arriving at steps 0, 2 and 5; two share a long prefix with an earlier one;
    lengths of output from 3 to 14."""
    shared = prompt(100, 13)
    arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]] = {}
    specs = [(0, "a", prompt(1, 11), 14), (0, "b", prompt(2, 6), 3), (0, "c", shared, 12),
             (2, "d", prompt(3, 17), 9), (2, "e", [*shared, 7, 8], 8),
             (5, "f", [*shared[:9], 42], 12), (5, "g", prompt(4, 2), 5)]
    for step, request_id, tokens, max_tokens in specs:
        arrivals.setdefault(step, []).append(
            (request_id, tokens, SamplingParams(max_tokens=max_tokens, temperature=0)))
    return arrivals


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_continuous_batch_with_preemption_and_prefix_hits(architecture: str,
                                                          preemption: str) -> None:
    model, reference = model_pair(architecture)
    # 15 usable blocks of 4 tokens cannot hold the batch: sequences get preempted.
    engine = Engine(model, num_blocks=16, block_size=BLOCK_SIZE, max_num_seqs=6,
                    max_num_batched_tokens=24, preemption=preemption,  # type: ignore[arg-type]
                    num_host_blocks=32 if preemption == "swap" else None)
    plan_step = engine.scheduler.step
    swapped_blocks = []

    def step() -> object:
        plan = plan_step()
        swapped_blocks.append(len(plan.swap_out) + len(plan.swap_in))
        return plan

    engine.scheduler.step = step  # type: ignore[method-assign]
    results = run_poisoned(engine, mixed_requests())
    for requests in mixed_requests().values():
        for request_id, tokens, params in requests:
            produced, _ = results[request_id][0]
            assert produced == hf_greedy(reference, tokens, params.max_tokens), request_id
    stats = engine.kv_cache.stats()
    assert engine.scheduler.stats()["preemptions"] > 0
    assert stats["prefix_cache_hits"] > 0
    assert (sum(swapped_blocks) > 0) == (preemption == "swap")
    assert stats["blocks_used"] == 0 and stats["num_sequences"] == 0

"""The paged attention function against the model's own attention: last-token logits of a
chunked, mixed step equal HF's full forward; and negative controls that show the comparison
fails when the block table is permuted or the slot map shifted."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from atb_mem import ContinuousBatchScheduler, KVCachePool
from atb_mem.integrations import transformers as paged
from atb_mem.serving import Engine, SamplingParams
from tests.support.models import (
    ARCHITECTURES,
    hf_greedy,
    model_pair,
    poison_unused_blocks,
    require_torch,
    run_poisoned,
)


def prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 256, size=length).tolist()


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_last_token_logits_equal_a_full_forward(architecture: str) -> None:
    """Three prompts prefilled in chunks of at most 8 tokens per step, the later chunks
    attending to K/V earlier steps wrote: each prompt's last-token logits equal HF's."""
    torch = require_torch()
    model, reference = model_pair(architecture)
    kv = KVCachePool(32, 4, device="cpu", **paged.kv_cache_layout(model))
    scheduler = ContinuousBatchScheduler(kv, max_num_batched_tokens=8)
    runner = paged.ModelRunner(model, kv)
    prompts = {1: prompt(1, 11), 2: prompt(2, 5), 3: prompt(3, 14)}
    for seq_id, tokens in prompts.items():
        scheduler.add_request(seq_id, tokens, 1)
    seen: dict[int, Any] = {}
    while len(seen) < len(prompts):
        poison_unused_blocks(kv)
        plan = scheduler.step()
        logits = runner.execute(plan)
        for row, seq_id in enumerate(plan.sample_seq_ids.tolist()):
            seen[seq_id] = logits[row]
        scheduler.on_tokens(plan.sample_seq_ids, logits.argmax(-1).numpy().astype(np.int32))
    for seq_id, tokens in prompts.items():
        with torch.inference_mode():
            expected = reference(torch.tensor([tokens])).logits[0, -1]
        torch.testing.assert_close(seen[seq_id], expected, atol=2e-5, rtol=1e-4)


def corrupt(monkeypatch: pytest.MonkeyPatch, change: Callable[[Any], dict[str, Any]]) -> None:
    """Every step's attention metadata passes through ``change`` (fields to replace)."""
    build = paged.StepAttention.from_plan

    def from_plan(*args: Any, **kwargs: Any) -> paged.StepAttention:
        step = build(*args, **kwargs)
        return dataclasses.replace(step, **change(step))

    monkeypatch.setattr(paged.StepAttention, "from_plan", from_plan)


def mismatches(architecture: str) -> int:
    """How many of 3 prompts' greedy outputs differ from HF's (NaN-poisoned run)."""
    model, reference = model_pair(architecture)
    engine = Engine(model, num_blocks=48, block_size=4)
    params = SamplingParams(max_tokens=8, temperature=0)
    prompts = {f"r{n}": prompt(n, n) for n in (6, 9, 13)}
    results = run_poisoned(engine, {0: [(rid, p, params) for rid, p in prompts.items()]})
    return sum(results[rid][0][0] != hf_greedy(reference, p, 8) for rid, p in prompts.items())


def test_the_comparison_passes_unchanged() -> None:
    assert mismatches("llama") == 0


def test_a_permuted_block_table_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    build = paged.PagedRows.build

    def permuted(*args: Any, **kwargs: Any) -> paged.PagedRows:
        # Rows read each other's block tables. (Reordering a row's own blocks is invisible to
        # decode attention, a sum over positions: the rows must change.)
        rows = build(*args, **kwargs)
        return dataclasses.replace(rows, kv_slots=rows.kv_slots.roll(1, dims=0))

    monkeypatch.setattr(paged.PagedRows, "build", permuted)
    assert mismatches("llama") > 0


def test_a_shifted_slot_map_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    # New K/V lands one slot late: reads see a neighbour's bytes or poison.
    corrupt(monkeypatch, lambda step: {"slot_mappings": [slots + 1
                                                         for slots in step.slot_mappings]})
    assert mismatches("llama") > 0

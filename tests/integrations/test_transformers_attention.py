"""The paged attention function against the model's own attention, on atb-mem's CPU kernel and
on the torch reference: last-token logits of a chunked, mixed step equal HF's full forward;
and negative controls that show the comparison fails when the block table is permuted or the
slot map shifted, on each."""

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
    hf_tokens,
    model_pair,
    poison_unused_blocks,
    read_the_previous_rows_first_block,
    require_torch,
    run_poisoned,
)


def prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 256, size=length).tolist()


BACKENDS = ["cpu", "torch"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_last_token_logits_equal_a_full_forward(architecture: str, backend: str) -> None:
    """Three prompts prefilled in chunks of at most 8 tokens per step, the later chunks
    attending to K/V earlier steps wrote: each prompt's last-token logits equal HF's."""
    torch = require_torch()
    model, reference = model_pair(architecture)
    kv = KVCachePool(32, 4, device="cpu", **paged.kv_cache_layout(model))
    scheduler = ContinuousBatchScheduler(kv, max_num_batched_tokens=8)
    runner = paged.ModelRunner(model, kv, attention_backend=backend)  # type: ignore[arg-type]
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


def mismatches(architecture: str, backend: str) -> int:
    """How many of 3 prompts' greedy outputs differ from HF's (NaN-poisoned run)."""
    model, reference = model_pair(architecture)
    engine = Engine(model, num_blocks=48, block_size=4,
                    attention_backend=backend)  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=8, temperature=0)
    prompts = {f"r{n}": prompt(n, n) for n in (6, 9, 13)}
    results = run_poisoned(engine, {0: [(rid, p, params) for rid, p in prompts.items()]})
    return sum(results[rid][0][0] != hf_greedy(reference, p, 8) for rid, p in prompts.items())


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_comparison_passes_unchanged(backend: str) -> None:
    assert mismatches("llama", backend) == 0


def test_a_permuted_block_table_is_caught_on_the_cpu_kernel(
        monkeypatch: pytest.MonkeyPatch) -> None:
    read_the_previous_rows_first_block(monkeypatch)
    assert mismatches("llama", "cpu") > 0


def test_a_permuted_block_table_is_caught_on_the_reference(
        monkeypatch: pytest.MonkeyPatch) -> None:
    build = paged.PagedRows.build

    def permuted(*args: Any, **kwargs: Any) -> paged.PagedRows:
        # Rows read each other's block tables. (Reordering a row's own blocks is invisible to
        # decode attention, a sum over positions: the rows must change.)
        rows = build(*args, **kwargs)
        return dataclasses.replace(rows, kv_slots=rows.kv_slots.roll(1, dims=0))

    monkeypatch.setattr(paged.PagedRows, "build", permuted)
    assert mismatches("llama", "torch") > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_shifted_slot_map_is_caught(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    # New K/V lands one slot late: reads see a neighbour's bytes or poison.
    def shifted(step: paged.StepAttention) -> dict[str, Any]:
        if backend == "cpu":
            slots = step.kernel.slot_planes + 1
            return {"kernel": dataclasses.replace(step.kernel, slot_planes=slots)}
        return {"slot_mappings": [slots + 1 for slots in step.slot_mappings]}

    corrupt(monkeypatch, shifted)
    assert mismatches("llama", backend) > 0


def left_padded(tokens: list[list[int]]) -> tuple[Any, Any]:
    """A batch of prompts of different lengths, left-padded with 0, and its attention mask."""
    torch = require_torch()
    width = max(len(one) for one in tokens)
    ids = torch.tensor([[0] * (width - len(one)) + one for one in tokens])
    mask = torch.tensor([[0] * (width - len(one)) + [1] * len(one) for one in tokens])
    return ids, mask


def hf_batch(model: Any, tokens: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """``model.generate`` over a left-padded batch: wrong without the padding mask."""
    torch = require_torch()
    ids, mask = left_padded(tokens)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0)
    generated: list[list[int]] = out[:, ids.shape[1]:].tolist()
    return generated


@pytest.mark.parametrize("architecture", ["llama", "mistral", "granitemoehybrid"])
def test_the_model_runs_as_transformers_would_outside_the_engines_steps(
        architecture: str) -> None:
    """After ``Engine(model)`` the user's model still generates HF's tokens on its own —
    greedily, over a left-padded batch (padding mask) and for a sliding window (Mistral) or
    recurrent mixers (Granite 4.0-H) — also between the engine's steps, and the engine still
    equals HF afterwards (unused blocks NaN-poisoned)."""
    model, reference = model_pair(architecture)
    engine = Engine(model, num_blocks=48, block_size=4)
    prompts = [prompt(21, 11), prompt(22, 4), prompt(23, 8)]
    expected = hf_batch(reference, prompts, 6)
    assert hf_batch(model, prompts, 6) == expected
    assert hf_greedy(model, prompts[0], 6) == hf_greedy(reference, prompts[0], 6)

    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for index, tokens in enumerate(prompts):
        engine.add_request(str(index), tokens, params)
    results: dict[str, list[int]] = {str(index): [] for index in range(len(prompts))}
    steps = 0
    while engine.has_unfinished_requests():
        poison_unused_blocks(engine.kv_cache)
        for output in engine.step():
            results[output.request_id] += output.outputs[0].token_ids
        steps += 1
        if steps == 2:  # the user's own generate, between two steps
            assert hf_batch(model, prompts, 6) == expected
    assert hf_batch(model, prompts, 6) == expected  # and once the engine is idle
    assert results == {str(index): hf_tokens(reference, tokens, 8)
                       for index, tokens in enumerate(prompts)}

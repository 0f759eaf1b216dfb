"""Sliding-window and chunked attention through the engine: greedy tokens equal HF's own
``generate`` for prompts and outputs running to several windows, alone and in a continuous
batch with preemption and prefix hits, with unused blocks poisoned (NaN) before every step.
A negative control shows the comparison sees the window: attending fully where the model
slides fails it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from atb_mem.integrations import reference_attention, step_attention
from atb_mem.integrations import transformers as paged
from atb_mem.integrations.cpu_attention import CpuPagedStep
from atb_mem.integrations.layer_attention import FULL_ATTENTION
from atb_mem.serving import Engine, SamplingParams
from tests.support.models import (
    HYBRID_ARCHITECTURES,
    WINDOW,
    assert_each_matches_hf,
    greedy,
    hf_tokens,
    model_pair,
    require_transformers,
    run_poisoned,
)
from tests.support.models import random_prompt as prompt

BLOCK_SIZE = 4


@pytest.mark.parametrize("architecture", HYBRID_ARCHITECTURES)
def test_layer_attention_is_read_from_the_config(architecture: str) -> None:
    model, _ = model_pair(architecture)
    kinds = [(layer.kind, layer.window) for layer in paged.layer_attention(model.config)]
    if architecture == "mistral":
        assert kinds == [("sliding_attention", WINDOW)] * 3
    elif architecture == "llama4":
        assert kinds == [("chunked_attention", WINDOW), ("full_attention", None),
                         ("chunked_attention", WINDOW)]
    else:
        assert kinds == [("sliding_attention", WINDOW), ("full_attention", None),
                         ("sliding_attention", WINDOW)]


@pytest.mark.parametrize("architecture", HYBRID_ARCHITECTURES)
def test_single_prompts_past_the_window(architecture: str) -> None:
    model, reference = model_pair(architecture)
    engine = Engine(model, num_blocks=24, block_size=BLOCK_SIZE)
    # Outputs run to 3+ windows beyond prompts shorter than, equal to and longer than one.
    for length in (3, WINDOW, 2 * WINDOW + 1, 3 * WINDOW + 2):
        tokens = prompt(length, length)
        results = run_poisoned(engine, {0: [("alone", tokens, greedy(3 * WINDOW))]})
        assert results["alone"][0][0] == hf_tokens(reference, tokens, 3 * WINDOW), length
    assert engine.kv_cache.stats()["blocks_used"] == 0


def mixed_requests() -> dict[int, list[tuple[str, list[int], SamplingParams]]]:
    shared = prompt(100, 3 * WINDOW)
    specs = [(0, "a", prompt(1, 11), 2 * WINDOW), (0, "b", prompt(2, 5), 3),
             (0, "c", shared, 3 * WINDOW), (2, "d", prompt(3, 17), 9),
             (2, "e", [*shared, 7, 8], WINDOW), (5, "f", [*shared[:2 * WINDOW], 42], 12)]
    arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]] = {}
    for step, request_id, tokens, max_tokens in specs:
        arrivals.setdefault(step, []).append((request_id, tokens, greedy(max_tokens)))
    return arrivals


# Blocks of each model's KV-cache groups (a block holds one group's layers): few enough that
# requests are preempted, enough that the shared prefix's windowed blocks, released while
# its first request decodes, are still cached when the others arrive.
CONTINUOUS_BLOCKS = {"mistral": 14, "gemma3": 28, "gpt_oss": 28, "llama4": 20}


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("architecture", HYBRID_ARCHITECTURES)
def test_continuous_batch_with_preemption_and_prefix_hits(architecture: str,
                                                          preemption: str) -> None:
    model, reference = model_pair(architecture)
    engine = Engine(model, num_blocks=CONTINUOUS_BLOCKS[architecture], block_size=BLOCK_SIZE,
                    max_num_seqs=5,
                    max_num_batched_tokens=24, preemption=preemption,  # type: ignore[arg-type]
                    num_host_blocks=40 if preemption == "swap" else None)
    results = run_poisoned(engine, mixed_requests())
    assert_each_matches_hf(results, reference, mixed_requests())
    assert engine.scheduler.stats()["preemptions"] > 0
    assert engine.kv_cache.stats()["prefix_cache_hits"] > 0
    assert engine.kv_cache.stats()["blocks_used"] == 0


@pytest.mark.parametrize("architecture", HYBRID_ARCHITECTURES)
def test_attending_past_the_window_is_caught(architecture: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: the runner told every layer attends fully gets other tokens."""
    monkeypatch.setattr(paged, "layer_attention",
                        lambda config: [FULL_ATTENTION] * config.num_hidden_layers)
    model, reference = model_pair(architecture)
    engine = Engine(model, num_blocks=24, block_size=BLOCK_SIZE)
    tokens = prompt(7, 2 * WINDOW + 1)
    results = run_poisoned(engine, {0: [("r", tokens, greedy(3 * WINDOW))]})
    assert results["r"][0][0] != hf_tokens(reference, tokens, 3 * WINDOW)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_dropping_attention_sinks_is_caught(monkeypatch: pytest.MonkeyPatch,
                                            backend: str) -> None:
    """Negative control for gpt-oss, on the CPU kernel and on the torch reference: attention
    without its sinks gets other tokens."""
    if backend == "cpu":
        attend = CpuPagedStep.attend
        monkeypatch.setattr(CpuPagedStep, "attend", lambda self, *args, **kwargs: attend(
            self, *args[:6], None, *args[7:], **kwargs))
    else:
        attention = reference_attention.sdpa_attention
        for module in (step_attention, reference_attention):  # new rows', gathered rows'
            monkeypatch.setattr(module, "sdpa_attention",
                                lambda queries, keys, values, mask, scaling, sinks:
                                attention(queries, keys, values, mask, scaling, None))
    model, reference = model_pair("gpt_oss")
    engine = Engine(model, num_blocks=24, block_size=BLOCK_SIZE,
                    attention_backend=backend)  # type: ignore[arg-type]
    tokens = prompt(7, 2 * WINDOW + 1)
    results = run_poisoned(engine, {0: [("r", tokens, greedy(3 * WINDOW))]})
    assert results["r"][0][0] != hf_tokens(reference, tokens, 3 * WINDOW)


def test_a_softcapping_model_is_refused() -> None:
    transformers = require_transformers()
    config = transformers.Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=2,
                                       num_key_value_heads=1, head_dim=16)
    with pytest.raises(NotImplementedError, match="softcapping"):
        Engine(transformers.Gemma2ForCausalLM(config).eval(), num_blocks=8, block_size=4)


def kv_bytes_in_use(engine: Engine) -> int:
    return engine.kv_cache.stats()["blocks_used"] * engine.kv_cache.bytes_per_block


def test_sliding_groups_hold_only_their_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """After every decode step a sliding group holds at most ceil((W - 1) / B) + 1 blocks of
    a sequence, and the K/V bytes in use peak lower than in a cache that keeps every block
    for every layer (the same model without groups)."""
    model, reference = model_pair("gemma3")
    tokens = prompt(11, 5 * WINDOW)
    params = greedy(4 * WINDOW)
    peaks = {}
    for grouped in (True, False):
        if not grouped:
            monkeypatch.setattr("atb_mem.serving.kv_sizing.groups_for_layers", lambda _: {})
        engine = Engine(model, num_blocks=64, block_size=BLOCK_SIZE, max_num_batched_tokens=8)
        assert len(engine.kv_cache.groups) == (3 if grouped else 1)
        engine.add_request("r", tokens, params)
        computed: dict[int, int] = {}
        peak, out = 0, []
        while engine.has_unfinished_requests():
            for output in engine.step():
                out += output.outputs[0].token_ids
            peak = max(peak, kv_bytes_in_use(engine))
            for seq_id in engine.kv_cache.seq_ids():
                now, before = engine.kv_cache.num_computed(seq_id), computed.get(seq_id, 0)
                computed[seq_id] = now
                for group, spec in enumerate(engine.kv_cache.groups):
                    held = int((engine.kv_cache.block_table(seq_id, group=group) != 0).sum())
                    if grouped and spec.kind == "sliding_attention" and now - before == 1:
                        assert held <= -(-(WINDOW - 1) // BLOCK_SIZE) + 1, (now, held)
        assert out == hf_tokens(reference, tokens, params.max_tokens)
        peaks[grouped] = peak
    assert peaks[True] < 0.75 * peaks[False], peaks


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_groups_with_a_wrong_window_are_caught(monkeypatch: pytest.MonkeyPatch,
                                               backend: str) -> None:
    """Negative control for groups: attention that drops the window (the torch reference)
    sees other K/V (the positions still held before the window) and gets other tokens; so
    does the CPU kernel with a window one position short (a longer one would read blocks the
    window released, which the kernel refuses)."""
    if backend == "cpu":
        attend = CpuPagedStep.attend

        def short_window(self: CpuPagedStep, group: int, kind: paged.LayerAttention,
                         *args: Any, **kwargs: Any) -> Any:
            if kind.kind == "sliding_attention" and kind.window:
                kind = paged.LayerAttention(kind.kind, kind.window - 1)
            return attend(self, group, kind, *args, **kwargs)

        monkeypatch.setattr(CpuPagedStep, "attend", short_window)
    else:
        monkeypatch.setattr(paged.LayerAttention, "visible",
                            lambda self, query, key: np.asarray(key <= query))
    model, reference = model_pair("gemma3")
    engine = Engine(model, num_blocks=64, block_size=BLOCK_SIZE,
                    attention_backend=backend)  # type: ignore[arg-type]
    assert len(engine.kv_cache.groups) == 3
    tokens = prompt(7, 2 * WINDOW + 1)
    results = run_poisoned(engine, {0: [("r", tokens, greedy(3 * WINDOW))]})
    assert results["r"][0][0] != hf_tokens(reference, tokens, 3 * WINDOW)


@pytest.mark.parametrize(("architecture", "num_blocks", "length"), [
    ("mistral", 8, 60),  # every layer slides: a sequence needs a window's blocks, not 60 tokens'
    # Three groups (sliding, full, sliding): 10 blocks for the full one, 3 for each other.
    ("gemma3", 20, 40),
])
def test_a_sequence_longer_than_the_pool_fits_in_its_windows(architecture: str, num_blocks: int,
                                                             length: int) -> None:
    """Admission counts a windowed group's blocks by the window, as alloc and append do: a
    request longer than the pool could hold at full attention runs to its end."""
    model, reference = model_pair(architecture)
    engine = Engine(model, num_blocks=num_blocks, block_size=BLOCK_SIZE)
    tokens = prompt(11, 16)
    results = run_poisoned(engine, {0: [("long", tokens, greedy(length - len(tokens)))]})
    groups = len(engine.kv_cache.groups)
    assert (num_blocks - 1) * BLOCK_SIZE < length * groups  # no room at full attention
    assert results["long"][0][0] == hf_tokens(reference, tokens, length - len(tokens))


@pytest.mark.parametrize("architecture", ["mistral", "gemma3"])
def test_a_window_as_wide_as_the_pool_serves_what_fits(architecture: str) -> None:
    """A window of the pool's whole size (or wider): requests that fit in the pool are served
    (it once refused every request: the windowed need overflowed)."""
    model, reference = model_pair(architecture)
    for config in (model.config, reference.config):
        config.sliding_window = 64
    # 64 tokens per group: one group for Mistral, three for Gemma 3.
    engine = Engine(model, num_blocks={"mistral": 16, "gemma3": 48}[architecture],
                    block_size=BLOCK_SIZE)
    tokens = prompt(12, 20)
    results = run_poisoned(engine, {0: [("wide", tokens, greedy(10))]})
    assert results["wide"][0][0] == hf_tokens(reference, tokens, 10)

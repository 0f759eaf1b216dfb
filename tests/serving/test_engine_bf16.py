"""A bfloat16 model through the engine on the CPU kernel (K/V held as bf16, attended in f32):
greedy tokens equal HF's own bf16 ``generate`` for Llama, Qwen3, Mistral (sliding) and Gemma 3
(sliding and full layers), with unused blocks NaN-poisoned before every step, eager and
compiled; a negative control (each row reading the previous row's first block) fails it. On a
CPU with AMX tiles the rows of 16 new tokens or more take torch's SDPA (over the new K/V alone,
or over the K/V gathered from the cache where the row has context), and still equal."""

from __future__ import annotations

from typing import Any

import pytest

from atb_mem.integrations.compiled_forward import CompiledForward
from atb_mem.integrations.cpu_attention import CpuPagedAttention, CpuPagedStep
from atb_mem.serving import Engine
from tests.support.models import (
    assert_each_matches_hf,
    greedy,
    model_pair,
    random_prompt,
    read_the_previous_rows_first_block,
    require_torch,
    run_poisoned,
)

ARRIVALS = {0: [(f"r{n}", random_prompt(n, n), greedy(12)) for n in (3, 9, 17, 30)]}


def bf16_engine(architecture: str) -> tuple[Engine, Any]:
    torch = require_torch()
    model, reference = model_pair(architecture)
    model, reference = model.to(torch.bfloat16), reference.to(torch.bfloat16)
    engine = Engine(model, num_blocks=64, block_size=4, max_num_seqs=6,
                    max_num_batched_tokens=24)
    assert engine.kv_cache.dtype == "bfloat16"
    return engine, reference


@pytest.mark.parametrize("architecture", ["llama", "qwen3", "mistral", "gemma3"])
def test_bf16_greedy_tokens_equal_hf(architecture: str) -> None:
    engine, reference = bf16_engine(architecture)
    assert_each_matches_hf(run_poisoned(engine, ARRIVALS), reference, ARRIVALS)


@pytest.mark.usefixtures("compiled")
def test_bf16_greedy_tokens_equal_hf_compiled() -> None:
    engine, reference = bf16_engine("llama")
    assert isinstance(engine.runner.forward, CompiledForward)
    assert_each_matches_hf(run_poisoned(engine, ARRIVALS), reference, ARRIVALS)
    assert engine.runner.forward.failed is None


def test_a_wrong_block_table_in_bf16_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    engine, reference = bf16_engine("llama")
    read_the_previous_rows_first_block(monkeypatch)
    results = run_poisoned(engine, ARRIVALS)
    with pytest.raises(AssertionError):
        assert_each_matches_hf(results, reference, ARRIVALS)


@pytest.mark.parametrize("architecture", ["qwen3", "gemma3"])
def test_fresh_rows_take_sdpa_on_amx_and_the_others_the_kernel(
        architecture: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 on a CPU with AMX tiles: rows whose K/V is all new (16 tokens or more; Gemma 3's
    sliding layers only those within the window) go to torch's SDPA, the others to the kernel
    in the same layer call, and the tokens still equal HF's. Without AMX the kernel takes
    every row."""
    engine, reference = bf16_engine(architecture)
    kernel = engine.runner.kernel
    assert isinstance(kernel, CpuPagedAttention)
    splits: list[tuple[int, bool]] = []
    attend_split = CpuPagedStep._attend_split

    def spy(self: CpuPagedStep, split: Any, *args: Any) -> Any:
        splits.append((len(split.sdpa_rows), split.rest is not None))
        return attend_split(self, split, *args)

    monkeypatch.setattr(CpuPagedStep, "_attend_split", spy)
    assert_each_matches_hf(run_poisoned(engine, ARRIVALS), reference, ARRIVALS)
    if kernel.sdpa_min_tokens is None:
        assert not splits
    else:
        assert any(rest for _, rest in splits), "no step split its rows"
        assert all(count > 0 for count, _ in splits)


LONG = random_prompt(40, 60)
WITH_CONTEXT = {
    # 60 tokens in 24-token steps: chunks of 24 after 0 and 24 cached, the last 12 after 48.
    0: [("long", LONG, greedy(6))],
    # After "long" ends: its first 48 tokens hit the prefix cache, 20 more are new.
    12: [("hit", LONG[:48] + random_prompt(41, 20), greedy(6))],
}


@pytest.mark.parametrize("architecture", ["qwen3", "gemma3"])
def test_rows_with_context_take_sdpa_on_amx(
        architecture: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 on a CPU with AMX tiles: a later prefill chunk and a prefix hit's new tokens (16 or
    more after cached ones) are attended by SDPA over their K/V gathered from the cache, with
    unused blocks poisoned, and the tokens equal HF's (Gemma 3's sliding layers only while the
    whole row fits the window: there the kernel keeps them)."""
    engine, reference = bf16_engine(architecture)
    kernel = engine.runner.kernel
    assert isinstance(kernel, CpuPagedAttention)
    with_context: list[int] = []
    attend_split = CpuPagedStep._attend_split

    def spy(self: CpuPagedStep, split: Any, *args: Any) -> Any:
        with_context.extend(int(context.mask.shape[1]) for context in split.contexts
                            if context is not None)
        return attend_split(self, split, *args)

    monkeypatch.setattr(CpuPagedStep, "_attend_split", spy)
    results = run_poisoned(engine, WITH_CONTEXT)
    assert_each_matches_hf(results, reference, WITH_CONTEXT)
    assert engine.kv_cache.stats()["prefix_cache_hit_tokens"] >= 48
    if kernel.sdpa_min_tokens is None:
        assert not with_context
    else:
        # The second chunk (48 positions) and the hit's new tokens (68).
        assert {48, 68} <= set(with_context), with_context

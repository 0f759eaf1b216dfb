"""Qwen3-0.6B's attention shapes (16 query and 8 KV heads of 128, tied embeddings) through the
engine on the CPU kernel, in a continuous batch with chunked prefill, prefix hits and
preemption, unused blocks NaN-poisoned before every step: greedy tokens equal HF's own
``generate`` in float32 (eager and compiled) and in bfloat16; a wrong block table fails it."""

from __future__ import annotations

from typing import Any

import pytest

from atb_mem.integrations.compiled_forward import CompiledForward
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

SHARED = random_prompt(200, 13)
ARRIVALS = {0: [("a", random_prompt(201, 11), greedy(14)), ("b", random_prompt(202, 29), greedy(5)),
                ("c", SHARED, greedy(12))],
            2: [("e", random_prompt(203, 40), greedy(6))],
            6: [("d", [*SHARED, 7, 8], greedy(9))]}


def engine_for(model: Any, **options: Any) -> Engine:
    # 15 usable blocks of 4 tokens cannot hold the batch: sequences get preempted.
    return Engine(model, num_blocks=16, block_size=4, max_num_seqs=5,
                  max_num_batched_tokens=24, **options)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_float32_greedy_tokens_equal_hf(compiled: bool, request: pytest.FixtureRequest) -> None:
    if compiled:
        request.getfixturevalue("compiled")
    model, reference = model_pair("qwen3_shapes")
    engine = engine_for(model, enforce_eager=not compiled)
    assert isinstance(engine.runner.forward, CompiledForward) == compiled
    assert_each_matches_hf(run_poisoned(engine, ARRIVALS), reference, ARRIVALS)
    assert engine.kv_cache.stats()["prefix_cache_hits"] > 0
    assert engine.scheduler.stats()["preemptions"] > 0


def test_bfloat16_greedy_tokens_equal_hf() -> None:
    torch = require_torch()
    model, reference = model_pair("qwen3_shapes")
    model, reference = model.to(torch.bfloat16), reference.to(torch.bfloat16)
    engine = engine_for(model)
    assert engine.kv_cache.dtype == "bfloat16"
    assert_each_matches_hf(run_poisoned(engine, ARRIVALS), reference, ARRIVALS)


def test_a_wrong_block_table_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    model, reference = model_pair("qwen3_shapes")
    engine = engine_for(model)
    read_the_previous_rows_first_block(monkeypatch)
    results = run_poisoned(engine, ARRIVALS)
    with pytest.raises(AssertionError):
        assert_each_matches_hf(results, reference, ARRIVALS)

"""Requests through the engine: parallel sampling prefills once, seeded sampling repeats,
aborts free their blocks, and bad input is refused without changing anything."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from atb_mem.serving import Engine, SamplingParams
from tests.support.models import hf_greedy, model_pair, run_poisoned


def prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 256, size=length).tolist()


def engine_counting_prefill(**kwargs: Any) -> tuple[Engine, Any, list[int]]:
    model, reference = model_pair("llama")
    engine = Engine(model, num_blocks=64, block_size=4, **kwargs)
    prefilled: list[int] = []
    plan_step = engine.scheduler.step

    def step() -> Any:
        plan = plan_step()
        prefilled.append(int(plan.prefill_tokens.sum()))
        return plan

    engine.scheduler.step = step  # type: ignore[method-assign]
    return engine, reference, prefilled


def test_n_samples_share_one_prefill() -> None:
    engine, reference, prefilled = engine_counting_prefill()
    tokens = prompt(7, 10)
    greedy = SamplingParams(max_tokens=6, temperature=0, n=3)
    [output] = engine.generate(tokens, greedy)
    assert sum(prefilled) == len(tokens)
    assert [one.index for one in output.outputs] == [0, 1, 2]
    expected = hf_greedy(reference, tokens, 6)
    assert all(one.token_ids == expected for one in output.outputs)
    prefilled.clear()
    [sampled] = engine.generate(tokens, SamplingParams(max_tokens=6, n=3, seed=3))
    assert sum(prefilled) == len(tokens) - 8  # two full blocks come from the prefix cache
    assert len({tuple(one.token_ids) for one in sampled.outputs}) > 1
    assert engine.kv_cache.stats()["blocks_used"] == 0


def test_parallel_samples_match_the_same_seeds_run_alone() -> None:
    """Sample i of a seeded n=3 request draws from seed + i: equal to n=1 runs with those
    seeds (copy-on-write kept the forks' K/V apart), with poisoned unused blocks."""
    engine, _, _ = engine_counting_prefill()
    tokens = prompt(8, 9)
    forked = run_poisoned(engine, {0: [("n3", tokens, SamplingParams(max_tokens=8, n=3,
                                                                       seed=11))]})
    for index in range(3):
        alone = run_poisoned(engine, {0: [("one", tokens, SamplingParams(max_tokens=8,
                                                                         seed=11 + index))]})
        assert forked["n3"][index][0] == alone["one"][0][0]


def test_seeded_sampling_repeats_alone_and_in_a_busy_batch() -> None:
    engine, _, _ = engine_counting_prefill(max_num_batched_tokens=16)
    tokens = prompt(9, 12)
    params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, top_k=50, seed=1234)
    alone = run_poisoned(engine, {0: [("seeded", tokens, params)]})["seeded"][0][0]
    again = run_poisoned(engine, {0: [("seeded", tokens, params)]})["seeded"][0][0]
    busy = {0: [(f"noise{i}", prompt(20 + i, 5 + i), SamplingParams(max_tokens=12))
                for i in range(4)],
            2: [("seeded", tokens, params)],
            3: [("late", prompt(30, 7), SamplingParams(max_tokens=4))]}
    in_batch = run_poisoned(engine, busy)["seeded"][0][0]
    other_seed = run_poisoned(engine, {0: [("seeded", tokens, SamplingParams(
        max_tokens=10, temperature=0.8, top_p=0.9, top_k=50, seed=4321))]})["seeded"][0][0]
    assert alone == again == in_batch
    assert other_seed != alone


def test_stop_tokens_and_eos() -> None:
    engine, reference, _ = engine_counting_prefill()
    tokens = prompt(5, 8)
    expected = hf_greedy(reference, tokens, 12)
    stop_at = expected[3]
    [stopped] = engine.generate(tokens, SamplingParams(max_tokens=12, temperature=0,
                                                       stop_token_ids=[stop_at]))
    first = expected.index(stop_at)
    assert stopped.outputs[0].token_ids == expected[:first + 1]
    assert stopped.outputs[0].finish_reason == "stop"
    engine.eos_token_ids = frozenset({stop_at})
    [eos] = engine.generate(tokens, SamplingParams(max_tokens=12, temperature=0))
    [ignored] = engine.generate(tokens, SamplingParams(max_tokens=12, temperature=0,
                                                       ignore_eos=True))
    assert eos.outputs[0].token_ids == expected[:first + 1]
    assert ignored.outputs[0].token_ids == expected
    assert ignored.outputs[0].finish_reason == "length"


def test_abort_frees_blocks_and_is_reported() -> None:
    engine, _, _ = engine_counting_prefill()
    engine.add_request("long", prompt(1, 20), SamplingParams(max_tokens=50, n=2, seed=0))
    engine.add_request("short", prompt(2, 6), SamplingParams(max_tokens=3, temperature=0))
    for _ in range(3):
        engine.step()
    assert engine.kv_cache.stats()["blocks_used"] > 0
    engine.abort_request("long")
    engine.abort_request("long")  # late aborts are ignored
    outputs = {output.request_id: output for output in engine.step()}
    assert outputs["long"].finished
    assert {one.finish_reason for one in outputs["long"].outputs} == {"abort"}
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.kv_cache.stats()
    assert stats["blocks_used"] == 0 and stats["num_sequences"] == 0


@pytest.mark.parametrize(("request_id", "prompt_ids", "params", "error", "match"), [
    (7, [1, 2], None, TypeError, "request_id must be a str"),
    ("x", [], None, ValueError, "the prompt is empty"),
    ("x", [1, 256], None, ValueError, "not an id in"),
    ("x", [1, -1], None, ValueError, "not an id in"),
    ("x", [1.5], None, ValueError, "not an id in"),
    ("x", "text", None, ValueError, "needs a tokenizer"),
    ("x", [1] * 500, SamplingParams(max_tokens=13), ValueError, "exceed the model's 512"),
    ("x", [1, 2], {"max_tokens": 3}, TypeError, "params must be SamplingParams"),
    ("x", [1] * 300, SamplingParams(max_tokens=100), ValueError,
     "^request 'x' may hold 400 tokens; .* the cache fits"),
])
def test_bad_requests_are_refused_and_change_nothing(request_id: Any, prompt_ids: Any,
                                                     params: Any, error: type[Exception],
                                                     match: str) -> None:
    engine, _, _ = engine_counting_prefill()
    engine.add_request("existing", prompt(1, 5), SamplingParams(max_tokens=4))
    before = (engine.kv_cache.stats(), engine.scheduler.stats(), engine.num_unfinished_requests)
    with pytest.raises(error, match=match):
        engine.add_request(request_id, prompt_ids, params)
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("existing", [1, 2])
    after = (engine.kv_cache.stats(), engine.scheduler.stats(), engine.num_unfinished_requests)
    assert after == before


@pytest.mark.parametrize(("kwargs", "error"), [
    ({"max_tokens": 0}, ValueError), ({"max_tokens": 1.0}, TypeError),
    ({"temperature": -0.1}, ValueError), ({"top_p": 0}, ValueError), ({"top_p": 1.5}, ValueError),
    ({"top_k": -2}, ValueError), ({"n": 0}, ValueError), ({"seed": -1}, ValueError),
    ({"stop_token_ids": [1, "x"]}, TypeError), ({"ignore_eos": 1}, TypeError),
])
def test_bad_sampling_params(kwargs: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error):
        SamplingParams(**kwargs)


def test_generate_needs_an_idle_engine_and_matching_params() -> None:
    engine, _, _ = engine_counting_prefill()
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        engine.generate([[1, 2, 3]], [SamplingParams(), SamplingParams()])
    engine.add_request("busy", [1, 2, 3])
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.generate([1, 2, 3])


def test_a_failed_forward_ends_its_requests_and_the_engine_goes_on() -> None:
    engine, reference, _ = engine_counting_prefill()
    engine.add_request("doomed", prompt(1, 9), SamplingParams(max_tokens=5, temperature=0))
    execute = engine.runner.execute

    def fail(plan: Any) -> Any:
        raise RuntimeError("device lost")

    engine.runner.execute = fail  # type: ignore[method-assign]
    [failed] = engine.step()  # the failure is the batch's requests', not the engine's
    engine.runner.execute = execute  # type: ignore[method-assign]
    assert failed.request_id == "doomed" and failed.outputs[0].finish_reason == "error"
    assert failed.finished and failed.error is not None and "device lost" in failed.error
    assert not engine.has_unfinished_requests()
    assert engine.step() == []  # the next step frees what the failed plan's rows held
    assert engine.kv_cache.stats()["blocks_used"] == 0
    tokens = prompt(2, 7)
    [output] = engine.generate(tokens, SamplingParams(max_tokens=5, temperature=0))
    assert output.outputs[0].token_ids == hf_greedy(reference, tokens, 5)

"""Recurrent layers through the engine: Granite 4.0-H (Mamba2) and Qwen3-Next (gated delta-net)
keep their conv and SSM states in the pool's state blocks; greedy tokens equal HF's own
``generate`` alone, in chunks, in a continuous batch with preemption (both modes) and for
forked samples, with every unused block poisoned (NaN) before every step. Negative controls
show the comparison sees the states: a fork whose state is not copied, and a state read where
a sequence starts afresh, and a resume from the wrong checkpoint, get other tokens. Prefix
hits resume from checkpoints of the states (see ``atb_mem.kv`` and the core's
``state_checkpoints``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from atb_mem.integrations import recurrent_state
from atb_mem.kv import tensors
from atb_mem.serving import Engine, SamplingParams
from tests.support.models import (
    RECURRENT_ARCHITECTURES,
    assert_each_matches_hf,
    greedy,
    hf_tokens,
    model_pair,
    run_poisoned,
)
from tests.support.models import random_prompt as prompt

BLOCK_SIZE = 4
# A state takes 11 (Granite) or 6 (Qwen3-Next) blocks per recurrent layer, 3 such layers.
NUM_BLOCKS = 160


@pytest.mark.parametrize("architecture", RECURRENT_ARCHITECTURES)
def test_states_are_kept_in_state_blocks(architecture: str) -> None:
    model, _ = model_pair(architecture)
    engine = Engine(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    kv_cache = engine.kv_cache
    layout = recurrent_state.model_state_layout(model)
    assert [list(group.layers) for group in kv_cache.state_groups] == [[0], [1], [3]]
    assert [group.kind for group in kv_cache.groups] == ["full_attention"]
    slot_bytes = kv_cache.bytes_per_block // len(kv_cache.groups[0].layers)
    assert all(group.state_bytes == layout.state_bytes
               and group.num_blocks == -(-layout.state_bytes // slot_bytes)
               for group in kv_cache.state_groups)
    engine.add_request("r", prompt(0, 6), greedy(2))
    engine.step()
    [seq_id] = list(kv_cache.seq_ids())
    assert kv_cache.state_table([seq_id]).shape == (1, kv_cache.num_state_blocks)
    assert kv_cache.stats()["blocks_used"] == kv_cache.num_state_blocks + 2


@pytest.mark.parametrize("architecture", RECURRENT_ARCHITECTURES)
@pytest.mark.parametrize("max_num_batched_tokens", [None, 5])
def test_single_prompts(architecture: str, max_num_batched_tokens: int | None) -> None:
    """A prompt of one token, one shorter than the conv kernel, and ones longer than a Mamba2
    chunk (8), whole or prefilled 5 tokens a step (each chunk resumes the state)."""
    model, reference = model_pair(architecture)
    engine = Engine(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                    max_num_batched_tokens=max_num_batched_tokens or 2048)
    for length in (1, 3, 13, 21):
        tokens = prompt(length, length)
        results = run_poisoned(engine, {0: [("alone", tokens, greedy(10))]})
        assert results["alone"][0][0] == hf_tokens(reference, tokens, 10), length
    assert engine.kv_cache.stats()["blocks_used"] == 0


def mixed_requests() -> dict[int, list[tuple[str, list[int], SamplingParams]]]:
    specs = [(0, "a", prompt(1, 11), 12), (0, "b", prompt(2, 5), 3), (0, "c", prompt(3, 9), 14),
             (2, "d", prompt(4, 17), 9), (2, "e", prompt(5, 2), 10), (5, "f", prompt(6, 7), 12)]
    arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]] = {}
    for step, request_id, tokens, max_tokens in specs:
        arrivals.setdefault(step, []).append((request_id, tokens, greedy(max_tokens)))
    return arrivals


# Room for two sequences' states and a little K/V: growing decodes preempt one another.
CONTINUOUS_BLOCKS = {"granitemoehybrid": 2 * 33 + 8, "qwen3_next": 2 * 18 + 8}


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("architecture", RECURRENT_ARCHITECTURES)
def test_continuous_batch_with_preemption(architecture: str, preemption: str) -> None:
    model, reference = model_pair(architecture)
    engine = Engine(model, num_blocks=CONTINUOUS_BLOCKS[architecture], block_size=BLOCK_SIZE,
                    max_num_seqs=5, max_num_batched_tokens=16,
                    preemption=preemption,  # type: ignore[arg-type]
                    num_host_blocks=200 if preemption == "swap" else None)
    step, swapped_out = engine.scheduler.step, []

    def counting_swaps(*args: Any, **kwargs: Any) -> Any:
        plan = step(*args, **kwargs)
        swapped_out.append(len(plan.swap_out))
        return plan

    engine.scheduler.step = counting_swaps  # type: ignore[method-assign]
    results = run_poisoned(engine, mixed_requests())
    assert_each_matches_hf(results, reference, mixed_requests())
    assert engine.scheduler.stats()["preemptions"] > 0
    if preemption == "swap":  # a swapped sequence takes its states along, not only its K/V
        assert sum(swapped_out) > engine.kv_cache.num_state_blocks
    else:
        assert sum(swapped_out) == 0
    assert engine.kv_cache.stats()["blocks_used"] == 0


@pytest.mark.parametrize("architecture", RECURRENT_ARCHITECTURES)
def test_a_forked_request_arriving_under_load_waits_for_its_states(architecture: str) -> None:
    """A greedy n=2 request that arrives while two others run: its second sample's states
    need blocks of their own when it forks, so it is admitted only once they are free (it
    was admitted at once, and its fork failed). Both samples equal HF's."""
    model, reference = model_pair(architecture)
    engine = Engine(model, num_blocks=CONTINUOUS_BLOCKS[architecture], block_size=BLOCK_SIZE,
                    max_num_seqs=5, max_num_batched_tokens=16)
    pair = prompt(7, 5)
    arrivals = {0: [("a", prompt(1, 6), greedy(10)), ("b", prompt(2, 5), greedy(8))],
                2: [("pair", pair, dataclasses.replace(greedy(6), n=2))]}
    results = run_poisoned(engine, arrivals)
    expected = hf_tokens(reference, pair, 6)
    assert [results["pair"][index] for index in range(2)] == [(expected, "length")] * 2
    assert_each_matches_hf(results, reference, {0: arrivals[0]})
    assert engine.kv_cache.stats()["blocks_used"] == 0


def forked_and_alone(architecture: str) -> tuple[dict[str, Any], list[list[int]]]:
    model, _ = model_pair(architecture)
    engine = Engine(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    tokens = prompt(8, 9)
    forked = run_poisoned(engine, {0: [("n3", tokens, SamplingParams(max_tokens=8, n=3,
                                                                       seed=11))]})
    alone = [run_poisoned(engine, {0: [("one", tokens, SamplingParams(
        max_tokens=8, seed=11 + index))]})["one"][0][0] for index in range(3)]
    return forked["n3"], alone


@pytest.mark.parametrize("architecture", RECURRENT_ARCHITECTURES)
def test_forked_samples_match_the_same_seeds_run_alone(architecture: str) -> None:
    """Sample i of a seeded n=3 request equals an n=1 run with seed + i: each fork's state
    started as a copy of its parent's and went its own way."""
    forked, alone = forked_and_alone(architecture)
    assert [forked[index][0] for index in range(3)] == alone
    assert len({tuple(tokens) for tokens in alone}) > 1


def test_a_fork_without_its_state_copy_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: copies into state blocks skipped, a fork reads a poisoned state."""
    copy_run = tensors.KVTensors._copy_run
    dropped = []

    def without_copies(self: Any, kind: int, src: np.ndarray, dst: np.ndarray) -> None:
        if kind == tensors.MOVE_COPY:
            dropped.append(len(src))
            return
        copy_run(self, kind, src, dst)

    monkeypatch.setattr(tensors.KVTensors, "_copy_run", without_copies)
    forked, alone = forked_and_alone("granitemoehybrid")
    assert dropped
    assert [forked[index][0] for index in range(3)] != alone


def test_reading_a_fresh_sequences_blocks_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: a row that starts its sequence reads its state blocks (what the last
    owner left, NaN here) instead of zeros."""
    gather = recurrent_state.RecurrentStates.gather

    def never_fresh(self: Any, layer: int, rows: Any, blocks: Any) -> Any:
        return gather(self, layer, dataclasses.replace(rows, fresh=False), blocks)

    monkeypatch.setattr(recurrent_state.RecurrentStates, "gather", never_fresh)
    model, reference = model_pair("qwen3_next")
    engine = Engine(model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    tokens = prompt(3, 9)
    results = run_poisoned(engine, {0: [("r", tokens, greedy(6))]})
    assert results["r"][0][0] != hf_tokens(reference, tokens, 6)


def turns(architecture: str, seed: int = 20) -> tuple[Any, list[tuple[list[int], int]]]:
    """A 21-token prompt, then its next turn (prompt, answer, 5 tokens more), a prompt
    sharing its first 21 tokens, and one sharing its first 17: the states at 20 and 24
    tokens (blocks 5 and 6) were kept, at the prompt's last boundary and while it decoded,
    but none at 16, where the K/V of the last prompt's hit ends."""
    _, reference = model_pair(architecture)
    first = prompt(seed, 21)
    answer = hf_tokens(reference, first, 6)
    return reference, [(first, 0), (first + answer + prompt(seed + 1, 5), 24),
                       (first + prompt(seed + 2, 8), 20), (first[:17] + prompt(seed + 3, 6), 0)]


def serve_turns(architecture: str) -> tuple[dict[str, Any], list[int], Engine, Any]:
    """Each turn run alone, in order; returns the outputs and what each turn's admission got
    from the prefix cache."""
    model, _ = model_pair(architecture)
    reference, requests = turns(architecture)
    # Room for every checkpoint kept (5 of 33 or 18 blocks) beside the sequences; one at
    # every block boundary, so that decoding keeps them too.
    engine = Engine(model, num_blocks=400, block_size=BLOCK_SIZE, state_checkpoint_interval=1)
    results: dict[str, Any] = {}
    hits = []
    for index, (tokens, _) in enumerate(requests):
        before = engine.kv_cache.stats()["prefix_cache_hit_tokens"]
        results.update(run_poisoned(engine, {0: [(f"t{index}", tokens, greedy(6))]}))
        hits.append(engine.kv_cache.stats()["prefix_cache_hit_tokens"] - before)
    return results, hits, engine, reference


@pytest.mark.parametrize("architecture", RECURRENT_ARCHITECTURES)
def test_prefix_hits_resume_from_state_checkpoints(architecture: str) -> None:
    """A later turn resumes from the checkpoint at the end of its hit (the K/V reaches
    further, the states only to the last checkpoint), and its greedy tokens equal HF's."""
    results, hits, engine, reference = serve_turns(architecture)
    _, requests = turns(architecture)
    assert hits == [expected for _, expected in requests]
    for index, (tokens, _) in enumerate(requests):
        assert results[f"t{index}"][0][0] == hf_tokens(reference, tokens, 6), index
    stats = engine.kv_cache.stats()
    assert stats["state_checkpoints_saved"] >= 3
    assert stats["prefix_cache_misses_state_checkpoint"] >= 1
    # The last prompt left a checkpoint where the K/V it shared ended: the next one hits it.
    why = engine.kv_cache.explain_prefix(requests[0][0][:17] + prompt(99, 6))
    assert (why.hit_tokens, why.groups[0].cached_tokens) == (16, 16)
    assert stats["blocks_used"] == 0


def test_resuming_from_the_wrong_checkpoint_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: a resume copies the checkpoint kept before the one it asked for
    (the states at 20 tokens where 24 were asked for)."""
    copy_run = tensors.KVTensors._copy_run
    checkpoints: list[list[int]] = []  # every save's blocks, in order
    redirected = []

    def earlier_checkpoint(self: Any, kind: int, src: np.ndarray, dst: np.ndarray) -> None:
        if kind == tensors.MOVE_COPY:
            where = {block: (index, column) for index, blocks in enumerate(checkpoints)
                     for column, block in enumerate(blocks)}
            if len(src) and all(int(block) in where for block in src):
                index, column = where[int(src[0])]
                if index > 0:
                    earlier = checkpoints[index - 1]
                    src = np.array(earlier[column:column + len(src)], dtype=src.dtype)
                    redirected.append(index)
            else:
                checkpoints.append(dst.tolist())
        copy_run(self, kind, src, dst)

    monkeypatch.setattr(tensors.KVTensors, "_copy_run", earlier_checkpoint)
    results, hits, _, reference = serve_turns("granitemoehybrid")
    _, requests = turns("granitemoehybrid")
    assert redirected and hits[1] == 24
    assert results["t1"][0][0] != hf_tokens(reference, requests[1][0], 6)

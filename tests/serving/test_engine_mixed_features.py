"""Randomized mixed-feature runs of the engine against HF's own ``generate`` (issue 39's
held-out cases among them): per seed, a random mix of block size, sub-block hits, swap or
recompute preemption, a host prefix tier, a disk tier whose directory another model (one
embedding row retrained) filled first, requests of ``n=2``, a recurrent model (Granite 4.0-H)
under load, and one injected block-move failure part-way through a step's moves.

Every request either finishes with HF's greedy tokens for every sample (unused blocks
NaN-poisoned before every step) or, only where a move failed, ends with ``"error"``; the
engine always comes back idle, with no block held."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atb_mem.kv.tensors import KVTensors
from atb_mem.serving import Engine, SamplingParams
from tests.support.models import hf_tokens, model_pair, random_prompt, run_with_errors

SEEDS = range(60)
Arrivals = dict[int, list[tuple[str, list[int], SamplingParams]]]


def retrained(model: Any, token: int) -> Any:
    import torch

    other = copy.deepcopy(model)
    with torch.no_grad():
        row = other.get_input_embeddings().weight[token]
        row.copy_(torch.randn(row.shape, generator=torch.Generator().manual_seed(token)) * 3)
    return other


def workload(rng: np.random.Generator, system: list[int], recurrent: bool) -> Arrivals:
    """Ten requests, most behind a shared system prompt, some of two samples, arriving over
    the first steps."""
    arrivals: Arrivals = {}
    for index in range(10):
        tokens = (system if rng.random() < 0.7 else []) + \
            random_prompt(int(rng.integers(1 << 30)), int(rng.integers(1, 9)))
        samples = 2 if rng.random() < (0.5 if recurrent else 0.3) else 1
        params = SamplingParams(max_tokens=int(rng.integers(2, 7)), temperature=0,
                                ignore_eos=True, n=samples)
        arrivals.setdefault(int(rng.integers(0, 8)), []).append((f"r{index}", tokens, params))
    return arrivals


def inject_one_failure(monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator) -> list[int]:
    """The executor's ``at``-th call with moves runs its moves up to a random one, then
    raises as a device error part-way would. Returns how many failures were injected."""
    execute, at, seen, failed = KVTensors.execute, int(rng.integers(1, 6)), [0], [0]

    def failing(tensors: KVTensors, moves: Any) -> None:
        moves = np.asarray(moves)
        if len(moves):
            seen[0] += 1
        if seen[0] != at or failed[0] or not len(moves):
            execute(tensors, moves)
            return
        index = int(rng.integers(len(moves)))
        execute(tensors, moves[:index + 1])
        failed[0] += 1
        error = RuntimeError("injected move failure")
        error.moves_attempted = index + 1  # type: ignore[attr-defined]
        raise error

    monkeypatch.setattr(KVTensors, "execute", failing)
    return failed


@pytest.mark.parametrize("seed", SEEDS)
def test_mixed_features_match_hf(seed: int, tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(seed)
    recurrent = seed % 3 == 2
    model, reference = model_pair("granitemoehybrid" if recurrent else "llama", seed)
    system = random_prompt(1000 + seed, int(rng.integers(4, 13)))
    block_size = int(rng.choice([2, 4]))
    options: dict[str, Any] = {
        "block_size": block_size, "max_num_seqs": int(rng.integers(3, 6)),
        "max_num_batched_tokens": int(rng.choice([16, 64])),
        "preemption": str(rng.choice(["recompute", "swap"])),
    }
    # Room for a few sequences, so that they preempt one another and evict prefixes.
    options["num_blocks"] = (80 if recurrent else 11) if block_size == 4 else \
        (160 if recurrent else 20)
    offload: dict[str, Any] = {}
    if not recurrent:
        if rng.random() < 0.5:
            options["hash_block_size"] = block_size // 2
        if rng.random() < 0.5:
            offload["host"] = "64KiB"
    if options["preemption"] == "swap" and "host" not in offload:
        options["num_host_blocks"] = 64
    if not recurrent:
        if rng.random() < 0.5:
            offload["disk"] = (str(tmp_path), "16MiB")
            # Another model of the same config wrote its blocks of this workload's system
            # prompt there first: none may be served to this one.
            other = Engine(retrained(model, system[0]), kv_offload=dict(offload), **options)
            run_with_errors(other, {0: [("other", [*system, 5], SamplingParams(max_tokens=2))]})
            assert other.tiers is not None and other.tiers.wait_for_saves(60)
            other.shutdown()
    engine = Engine(model, kv_offload=offload or None, **options)
    arrivals = workload(rng, system, recurrent)
    failed = inject_one_failure(monkeypatch, rng)
    results, _ = run_with_errors(engine, arrivals)
    for requests in arrivals.values():
        for request_id, tokens, params in requests:
            result = results[request_id]
            if result["error"] is not None:
                assert failed[0], f"{request_id} failed with no failure injected: {result}"
                continue
            expected = hf_tokens(reference, tokens, params.max_tokens)
            got = [result[index][0] for index in range(params.n)]
            assert got == [expected] * params.n, (request_id, options, offload)
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.stats()["blocks_used"] == 0
    if engine.tiers is not None:
        engine.shutdown()

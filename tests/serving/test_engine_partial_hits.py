"""Prefix hits finer than a block under a model: blocks of 128 tokens (Ascend's size) with
``hash_block_size=16``. Prompts that share 16·k tokens with a cached one reuse its whole
blocks and copy the first pieces of the next one, and the greedy tokens still equal HF's own
``generate`` — with every unused block poisoned (NaN) before each step, so a block whose
copy did not land reads NaN. Negative control: dropping the copies changes the tokens."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from atb_mem.kv.tensors import MOVE_COPY, KVTensors
from atb_mem.serving import Engine, SamplingParams
from tests.support.models import hf_greedy, model_pair, run_poisoned

BLOCK_SIZE, PIECE = 128, 16
GREEDY = SamplingParams(max_tokens=5, temperature=0)
CACHED = np.random.default_rng(7).integers(3, 256, size=300).tolist()  # 2 blocks + 44
# Shared tokens: within the first block, one block and a piece, up to the last piece. (The
# cached prompt's third block never fills, so it is never cached: nothing hits past 256.)
SHARED = [3 * PIECE, 9 * PIECE, 12 * PIECE, 15 * PIECE]


def sharing(shared: int) -> list[int]:
    tail = np.random.default_rng(shared).integers(3, 256, size=300 - shared).tolist()
    if tail[0] == CACHED[shared]:
        tail[0] = 3 + (tail[0] - 2) % 253  # the prompts part at exactly `shared`
    return CACHED[:shared] + tail


def partial_engine(model: Any) -> Engine:
    return Engine(model, num_blocks=32, block_size=BLOCK_SIZE, hash_block_size=PIECE,
                  max_num_seqs=8)


def run(engine: Engine) -> dict[str, list[int]]:
    """The cached prompt alone, then every sharing prompt in one batch."""
    produced = run_poisoned(engine, {0: [("cached", CACHED, GREEDY)]})
    arrivals = [(str(shared), sharing(shared), GREEDY) for shared in SHARED]
    produced.update(run_poisoned(engine, {0: arrivals}))
    return {request_id: output[0][0] for request_id, output in produced.items()}


def test_partial_hits_at_block_128_match_hf() -> None:
    model, reference = model_pair("llama")
    engine = partial_engine(model)
    expected = {"cached": hf_greedy(reference, CACHED, GREEDY.max_tokens)}
    expected.update({str(shared): hf_greedy(reference, sharing(shared), GREEDY.max_tokens)
                     for shared in SHARED})
    kv = engine.kv_cache
    produced = run_poisoned(engine, {0: [("cached", CACHED, GREEDY)]})
    for shared in SHARED:  # what each admission will get, asked before it
        why = kv.explain_prefix(sharing(shared))
        assert why.hit_tokens == shared, (shared, why)
        assert why.partial_tokens == shared % BLOCK_SIZE, (shared, why)
    arrivals = [(str(shared), sharing(shared), GREEDY) for shared in SHARED]
    produced.update(run_poisoned(engine, {0: arrivals}))
    assert {key: output[0][0] for key, output in produced.items()} == expected
    stats = kv.stats()
    assert stats["prefix_cache_partial_hit_tokens"] == sum(s % BLOCK_SIZE for s in SHARED)
    assert stats["blocks_used"] == 0


def test_without_hash_block_size_only_whole_blocks_hit() -> None:
    model, _ = model_pair("llama")
    engine = Engine(model, num_blocks=32, block_size=BLOCK_SIZE, max_num_seqs=8)
    run_poisoned(engine, {0: [("cached", CACHED, GREEDY)]})
    hits = [engine.kv_cache.explain_prefix(sharing(shared)).hit_tokens for shared in SHARED]
    assert hits == [shared // BLOCK_SIZE * BLOCK_SIZE for shared in SHARED]


def test_negative_control_dropped_copies_change_the_tokens(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model, reference = model_pair("llama")
    execute = KVTensors.execute

    def execute_without_copies(tensors: KVTensors, moves: np.ndarray) -> None:
        moves = np.asarray(moves)
        execute(tensors, moves[moves[:, 0] != MOVE_COPY])

    monkeypatch.setattr(KVTensors, "execute", execute_without_copies)
    produced = run(partial_engine(model))
    assert produced["cached"] == hf_greedy(reference, CACHED, GREEDY.max_tokens)
    differ = [produced[str(shared)] != hf_greedy(reference, sharing(shared), GREEDY.max_tokens)
              for shared in SHARED]
    assert all(differ), f"a partial hit was served without its copy: {differ}"


def test_a_bad_hash_block_size_is_a_clear_error() -> None:
    model, _ = model_pair("llama")
    with pytest.raises(ValueError, match="must divide block_size"):
        Engine(model, num_blocks=8, block_size=16, hash_block_size=5)

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
from tests.support.models import greedy, hf_greedy, hf_tokens, model_pair, run_poisoned

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


# Issue 39 item 7: the computed pieces of an ended request's last, partly filled block are
# part of the cached prefix. A request of 200 prompt tokens and 4 sampled ones computed 203
# tokens: a block and 75, so 4 whole pieces (64 tokens) of its second block.
FIRST: list[int] = np.random.default_rng(11).integers(3, 256, size=200).tolist()
TURN_TAIL: list[int] = np.random.default_rng(12).integers(3, 256, size=40).tolist()


def sharing_first(shared: int) -> list[int]:
    rng = np.random.default_rng(100 + shared)
    tail: list[int] = rng.integers(3, 256, size=240 - shared).tolist()
    if tail[0] == FIRST[shared]:
        tail[0] = 3 + (tail[0] - 2) % 253  # the prompts part at exactly `shared`
    return FIRST[:shared] + tail


def ended_then(engine: Engine) -> tuple[list[int], dict[str, list[int]]]:
    """Runs the first request to its end; returns its tokens and the prompts that follow:
    one sharing 160 of its prompt's tokens, and the next turn of its conversation."""
    produced = run_poisoned(engine, {0: [("first", FIRST, greedy(4))]})
    first: list[int] = produced["first"][0][0]
    return first, {"160": sharing_first(160), "turn": FIRST + first + TURN_TAIL}


def test_an_ended_requests_last_block_serves_its_computed_pieces() -> None:
    model, reference = model_pair("llama")
    engine = partial_engine(model)
    kv = engine.kv_cache
    first, prompts = ended_then(engine)
    assert first == hf_tokens(reference, FIRST, 4)
    # Block 128 alone served 128 tokens to both: the pieces serve 160 and 192 (= 203 // 16).
    expected_hits = {"160": (160, 32), "turn": (192, 64)}
    for name, prompt in prompts.items():  # what each admission will get, asked before it
        why = kv.explain_prefix(prompt)
        assert (why.hit_tokens, why.partial_tokens) == expected_hits[name], (name, why)
    produced = run_poisoned(engine, {0: [(name, p, greedy(5)) for name, p in prompts.items()]})
    assert {name: out[0][0] for name, out in produced.items()} == {
        name: hf_tokens(reference, prompt, 5) for name, prompt in prompts.items()}
    assert kv.stats()["prefix_cache_partial_hit_tokens"] == 32 + 64


def test_negative_control_the_pieces_need_their_copies(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model, reference = model_pair("llama")
    # Without hash_block_size the ended request's last block is no use.
    plain = Engine(model, num_blocks=32, block_size=BLOCK_SIZE, max_num_seqs=8)
    _, prompts = ended_then(plain)
    assert [plain.kv_cache.explain_prefix(p).hit_tokens for p in prompts.values()] == [128, 128]
    # Served without their copies, the pieces are the NaN of a fresh block: tokens change.
    execute = KVTensors.execute

    def execute_without_copies(tensors: KVTensors, moves: np.ndarray) -> None:
        moves = np.asarray(moves)
        execute(tensors, moves[moves[:, 0] != MOVE_COPY])

    monkeypatch.setattr(KVTensors, "execute", execute_without_copies)
    engine = partial_engine(model)
    _, prompts = ended_then(engine)
    produced = run_poisoned(engine, {0: [(name, p, greedy(5)) for name, p in prompts.items()]})
    differ = [produced[name][0][0] != hf_tokens(reference, p, 5) for name, p in prompts.items()]
    assert all(differ), f"pieces were served without their copies: {differ}"

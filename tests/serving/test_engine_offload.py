"""The host prefix tier under a model: with a device pool too small to keep any earlier prompt,
every repeated prompt's prefix comes back from the host tier, and the greedy tokens still
equal HF's own ``generate`` — with the device's unused blocks poisoned (NaN) before every
step. Negative control: the same run with the host tier's copies poisoned once they are
made gives different tokens, so the comparison reads the promoted bytes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from atb_mem.kv.tensors import MOVE_TO_HOST, KVTensors
from atb_mem.serving import Engine, SamplingParams
from tests.support.models import hf_greedy, model_pair, run_poisoned

BLOCK_SIZE = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0)
# Four prompts of 17 tokens (4 full blocks) and 6 generated: 6 blocks each. The device's
# 7 usable blocks hold one of them, so the next one evicts the last one's cached blocks.
PROMPTS = [np.random.default_rng(seed).integers(3, 256, size=17).tolist() for seed in range(4)]


def offload_engine(model: Any) -> Engine:
    return Engine(model, num_blocks=8, block_size=BLOCK_SIZE, max_num_seqs=1,
                  kv_offload={"host": 64 * 1024})


def run_rounds(engine: Engine) -> list[list[int]]:
    """Each prompt alone, twice round: the second round's prefixes are on the host tier."""
    produced = []
    for round_ in range(2):
        for index, tokens in enumerate(PROMPTS):
            results = run_poisoned(engine, {0: [(f"{round_}-{index}", tokens, GREEDY)]})
            produced.append(results[f"{round_}-{index}"][0][0])
    return produced


def test_repeated_prompts_are_served_from_the_host_tier_and_match_hf() -> None:
    model, reference = model_pair("llama")
    engine = offload_engine(model)
    expected = [hf_greedy(reference, tokens, GREEDY.max_tokens) for tokens in PROMPTS]
    kv = engine.kv_cache
    produced = run_rounds(engine)
    assert produced == expected * 2
    stats = kv.stats()
    # Every second-round prompt hit its 4 full blocks, and the device could not have kept them.
    assert stats["prefix_cache_host_hit_tokens"] >= 3 * 4 * BLOCK_SIZE, stats
    assert stats["host_prefix_promoted"] >= 12 and stats["host_prefix_demoted"] >= 12, stats
    assert stats["blocks_used"] == 0


def test_explain_prefix_says_the_hit_comes_from_the_host() -> None:
    model, _ = model_pair("llama")
    engine = offload_engine(model)
    for index, tokens in enumerate(PROMPTS[:2]):
        run_poisoned(engine, {0: [(str(index), tokens, GREEDY)]})
    why = engine.kv_cache.explain_prefix(PROMPTS[0])
    assert why.hit_tokens == 4 * BLOCK_SIZE
    assert [tier for tier, _ in why.tiers] in (["host"], ["device", "host"]), why
    assert sum(tokens for _, tokens in why.tiers) == why.hit_tokens


def poison_host_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fills every host block a demotion writes with NaN right after its move ran."""
    execute = KVTensors.execute

    def execute_then_poison(tensors: KVTensors, moves: np.ndarray) -> None:
        execute(tensors, moves)
        moves = np.asarray(moves)
        demoted = moves[moves[:, 0] == MOVE_TO_HOST, 2]
        tensors.host_kv[:, :, demoted] = float("nan")

    monkeypatch.setattr(KVTensors, "execute", execute_then_poison)


def test_negative_control_poisoned_host_copies_change_the_tokens(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model, reference = model_pair("llama")
    engine = offload_engine(model)
    expected = [hf_greedy(reference, tokens, GREEDY.max_tokens) for tokens in PROMPTS]
    poison_host_copies(monkeypatch)
    produced = run_rounds(engine)
    assert produced[:4] == expected, "the first round reads no host copy"
    differ = [got != want for got, want in zip(produced[4:], expected, strict=True)]
    assert all(differ), f"promoted blocks were not read from the host tier: {differ}"


@pytest.mark.parametrize("bad, message", [
    ({"tape": "1GiB"}, "unknown tiers"),
    ({"disk": "1GiB"}, "not PATH:SIZE"),
    ({"disk": ("/tmp", "1 parsec")}, "is not a size"),
    ({"host": "1 parsec"}, "is not a size"),
    ({"host": 10}, "holds no block"),
    ({"host": 2**70}, r"kv_offload host=1180591620717411303424 \(.* bytes\) is more than this "
                      "machine's memory"),
    ({"host": "1024TiB"}, "kv_offload host='1024TiB'.*machine's memory"),
])
def test_a_bad_kv_offload_is_a_clear_error(bad: dict[str, Any], message: str) -> None:
    model, _ = model_pair("llama")
    with pytest.raises(ValueError, match=message):
        Engine(model, num_blocks=8, block_size=BLOCK_SIZE, kv_offload=bad)


@pytest.mark.parametrize("argument", ["hash_block_size", "state_checkpoint_interval"])
@pytest.mark.parametrize("value", [0, -1, 2**64])
def test_a_bad_count_names_its_argument(argument: str, value: int) -> None:
    model, _ = model_pair("llama")
    with pytest.raises(ValueError, match=f"^{argument}"):
        Engine(model, num_blocks=8, block_size=BLOCK_SIZE, **{argument: value})


def test_the_engine_takes_an_eviction_policy() -> None:
    model, _ = model_pair("llama")
    assert Engine(model, num_blocks=8, eviction_policy="slru").kv_cache.eviction_policy == "slru"
    with pytest.raises(ValueError, match="unknown eviction_policy"):
        Engine(model, num_blocks=8, eviction_policy="mru")


def test_kv_offload_needs_prefix_caching_and_one_host_tier() -> None:
    model, _ = model_pair("llama")
    with pytest.raises(ValueError, match="needs prefix caching"):
        Engine(model, num_blocks=8, enable_prefix_caching=False, kv_offload={"host": "1MiB"})
    with pytest.raises(ValueError, match="host tier once"):
        Engine(model, num_blocks=8, num_host_blocks=4, kv_offload={"host": "1MiB"})

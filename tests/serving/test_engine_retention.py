"""Retention by priority under a model: a request that pins its system prompt at 100
(``SamplingParams.retention``) keeps it cached through a flood of one-off prompts that LRU
loses it to, and the request that reuses it still matches HF's own ``generate`` with unused
blocks NaN-poisoned."""

from __future__ import annotations

import numpy as np
import pytest

from atb_mem.serving import Engine, SamplingParams
from tests.support.models import hf_greedy, model_pair, run_poisoned

BLOCK_SIZE = 4
SYSTEM = np.random.default_rng(3).integers(3, 256, size=4 * BLOCK_SIZE).tolist()
GREEDY = SamplingParams(max_tokens=3, temperature=0)
PINNED = SamplingParams(max_tokens=3, temperature=0,
                        retention=[(0, len(SYSTEM), 100, None)])


def one_off(n: int) -> list[int]:
    return np.random.default_rng(100 + n).integers(3, 256, size=17).tolist()


@pytest.mark.parametrize("policy, kept", [("priority", True), (None, True)])
def test_a_pinned_system_prompt_outlives_a_flood(policy: str | None, kept: bool) -> None:
    """The default policy honours retention (it keeps 64 of 64 tokens, not 0)."""
    model, reference = model_pair("llama")
    policy_args = {} if policy is None else {"eviction_policy": policy}
    engine = Engine(model, num_blocks=24, block_size=BLOCK_SIZE, max_num_seqs=2,
                    **policy_args)
    run_poisoned(engine, {0: [("first", [*SYSTEM, 7, 8, 9], PINNED)]})
    for n in range(12):  # 12 × 5 blocks through a 23-block cache
        run_poisoned(engine, {0: [(f"flood-{n}", one_off(n), GREEDY)]})
    again = [*SYSTEM, 11, 12, 13]
    assert engine.kv_cache.explain_prefix(again).hit_tokens == (len(SYSTEM) if kept else 0)
    produced = run_poisoned(engine, {0: [("again", again, GREEDY)]})
    assert produced["again"][0][0] == hf_greedy(reference, again, GREEDY.max_tokens)


def test_retention_under_a_policy_that_ignores_it_is_refused() -> None:
    """``lru`` keeps no priorities: a request asking for retention is told so, and nothing
    changes; the same request without retention runs."""
    model, reference = model_pair("llama")
    engine = Engine(model, num_blocks=24, block_size=BLOCK_SIZE, max_num_seqs=2,
                    eviction_policy="lru")
    with pytest.raises(ValueError, match="eviction_policy='priority'"):
        engine.add_request("pinned", [*SYSTEM, 7, 8, 9], PINNED)
    assert not engine.has_unfinished_requests()
    produced = run_poisoned(engine, {0: [("plain", [*SYSTEM, 7, 8, 9], GREEDY)]})
    assert produced["plain"][0][0] == hf_greedy(reference, [*SYSTEM, 7, 8, 9],
                                                GREEDY.max_tokens)

"""Engines of different models never share a block of the tiers below the host.

Two models with one config that differ in one embedding row, far past any sample of the
first values of each parameter (a retrained row), share one disk directory: the second
loads nothing the first wrote and matches HF's own ``generate`` with its own weights, its
unused blocks NaN-poisoned. The negative control names both models alike (``kv_identity``):
the second then loads the first's blocks and its tokens differ from HF's, so the comparison
can fail. Engines of one model loaded twice share blocks.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atb_mem import _core
from atb_mem.serving import Engine, SamplingParams
from atb_mem.serving.model_identity import weights_digest
from tests.support.models import hf_greedy, model_pair, require_torch, run_poisoned

BLOCK_SIZE = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0)
RETRAINED = 200  # the token whose embedding row the second model changed
PROMPT = [RETRAINED, *np.random.default_rng(5).integers(3, 256, size=16).tolist()]


def retrained(model: Any) -> Any:
    """``model`` with token ``RETRAINED``'s embedding row drawn anew."""
    torch = require_torch()
    other = copy.deepcopy(model)
    with torch.no_grad():
        row = other.get_input_embeddings().weight[RETRAINED]
        row.copy_(torch.randn(row.shape, generator=torch.Generator().manual_seed(9)) * 3)
    return other


def disk_engine(model: Any, path: Path, **kwargs: Any) -> Engine:
    return Engine(model, num_blocks=8, block_size=BLOCK_SIZE, max_num_seqs=1,
                  kv_offload={"disk": (str(path), "16MiB")}, **kwargs)


def run(engine: Engine, label: str) -> list[int]:
    tokens: list[int] = run_poisoned(engine, {0: [(label, PROMPT, GREEDY)]})[label][0][0]
    assert engine.tiers is not None and engine.tiers.wait_for_saves(60)
    return tokens


def disk_tokens(engine: Engine) -> int:
    assert engine.tiers is not None
    return sum(tokens for medium, tokens in engine.tiers.explain_prefix(PROMPT).tiers
               if medium == "disk")


def written_by(model: Any, path: Path, **kwargs: Any) -> None:
    """Runs ``PROMPT`` on an engine of ``model`` until the disk tier holds its blocks."""
    engine = disk_engine(model, path, **kwargs)
    for round_ in range(2):
        run(engine, f"write-{round_}")
    engine.shutdown()


def test_the_first_values_of_every_parameter_are_equal() -> None:
    """The pair differs where a sample of each parameter's first 1,024 values cannot see."""
    torch = require_torch()
    model, _ = model_pair("llama")
    other = retrained(model)
    hidden = model.config.hidden_size
    assert RETRAINED * hidden > 1024
    for (name, a), (_, b) in zip(model.named_parameters(), other.named_parameters(),
                                 strict=True):
        assert torch.equal(a.reshape(-1)[:1024], b.reshape(-1)[:1024]), name
    assert weights_digest(model) != weights_digest(other)
    assert weights_digest(model) == weights_digest(copy.deepcopy(model))


def test_different_models_share_no_block(tmp_path: Path) -> None:
    model_a, _ = model_pair("llama")
    model_b = retrained(model_a)
    reference_b = copy.deepcopy(model_b)
    expected_b = hf_greedy(reference_b, PROMPT, GREEDY.max_tokens)
    written_by(model_a, tmp_path)
    engine_b = disk_engine(model_b, tmp_path)
    assert disk_tokens(engine_b) == 0, "B is offered A's blocks"
    assert run(engine_b, "b") == expected_b


def test_models_named_alike_share_blocks_the_negative_control(tmp_path: Path) -> None:
    model_a, _ = model_pair("llama")
    model_b = retrained(model_a)
    expected_b = hf_greedy(copy.deepcopy(model_b), PROMPT, GREEDY.max_tokens)
    written_by(model_a, tmp_path, kv_identity="org/model@main")
    engine_b = disk_engine(model_b, tmp_path, kv_identity="org/model@main")
    assert disk_tokens(engine_b) == 16, "named alike, B takes A's blocks"
    assert run(engine_b, "b") != expected_b, "A's K/V under B's weights passed for B's"


def test_one_model_loaded_twice_shares_blocks(tmp_path: Path) -> None:
    model, reference = model_pair("llama")
    expected = hf_greedy(reference, PROMPT, GREEDY.max_tokens)
    written_by(model, tmp_path)
    again, _ = model_pair("llama")  # the same weights, another object
    engine = disk_engine(again, tmp_path)
    assert disk_tokens(engine) == 16
    assert run(engine, "again") == expected


@pytest.mark.parametrize("bad, error", [("", ValueError), ("  ", ValueError), (3, TypeError)])
def test_a_bad_kv_identity_is_refused(tmp_path: Path, bad: object, error: type) -> None:
    model, _ = model_pair("llama")
    with pytest.raises(error, match="kv_identity"):
        disk_engine(model, tmp_path, kv_identity=bad)


def test_content_digests_cover_every_byte_and_refuse_what_is_not_bytes() -> None:
    data = np.zeros(3 * (8 << 20) + 7, dtype=np.uint8)
    base = _core.content_digests([data])[0]
    data[-1] = 1
    assert _core.content_digests([data], 2)[0] != base
    assert _core.content_digests([data], 1) == _core.content_digests([data], 3)
    with pytest.raises(ValueError, match="contiguous"):
        _core.content_digests([data[::2]])
    with pytest.raises(TypeError):
        _core.content_digests([np.zeros(4, dtype=np.float32)])


def test_the_digest_reads_the_values_whatever_their_layout_or_dtype() -> None:
    """A transposed (non-contiguous) parameter with the same values digests the same; bf16
    weights are read as their bytes, and one changed value changes the digest."""
    torch = require_torch()
    layer = torch.nn.Linear(4, 3)
    digest = weights_digest(layer)
    with torch.no_grad():
        layer.weight.data = layer.weight.data.t().contiguous().t()
    assert not layer.weight.is_contiguous()
    assert weights_digest(layer) == digest
    half = torch.nn.Linear(4, 3).to(torch.bfloat16)
    before = weights_digest(half)
    with torch.no_grad():
        half.weight[2, 3] += 1
    assert weights_digest(half) != before


def test_unloaded_weights_are_a_clear_error_and_config_tables_do_not_count() -> None:
    torch = require_torch()
    with torch.device("meta"):
        unloaded = torch.nn.Linear(4, 3)
    with pytest.raises(ValueError, match=r"meta device.*kv_identity"):
        weights_digest(unloaded)
    layer = torch.nn.Linear(4, 3)
    layer.register_buffer("table", torch.arange(4.0), persistent=False)
    digest = weights_digest(layer)
    layer.table += 1  # recomputed at run time, as a rotary table may be
    assert weights_digest(layer) == digest
    layer.register_buffer("scale", torch.ones(3))  # saved with the weights: it counts
    assert weights_digest(layer) != digest

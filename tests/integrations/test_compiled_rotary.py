"""A compiled forward's rotary embedding is computed once per step, behind an opaque operator
(``atb_mem::rotary_cos_sin``), with the module's own values: inductor would otherwise
evaluate cos and sin again inside every layer's fused loop. Greedy tokens through it equal
HF's (``test_compiled_forward``); here, that its tables are the module's bit for bit, that a
compiled step calls it once per rotary module rather than inlining it, and that a module
whose output is not one table per position is left alone."""

from __future__ import annotations

from typing import Any

import pytest

from atb_mem.integrations.compiled_rotary import compute_rotary_once
from atb_mem.serving import Engine
from tests.support.models import greedy, model_pair, random_prompt, require_torch


def rotary_modules(model: Any) -> list[Any]:
    return [module for module in model.modules()
            if type(module).__name__.endswith("RotaryEmbedding")]


@pytest.mark.parametrize("architecture", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_tables_are_the_modules_own(architecture: str, dtype: str) -> None:
    torch = require_torch()
    model, reference = model_pair(architecture)
    model, reference = model.to(getattr(torch, dtype)), reference.to(getattr(torch, dtype))
    assert compute_rotary_once(model) == len(rotary_modules(model)) >= 1
    assert compute_rotary_once(model) == len(rotary_modules(model))  # once per module
    positions = torch.randint(0, 500, (2, 37))
    probe = torch.zeros(1, dtype=model.dtype)
    for ours, theirs in zip(rotary_modules(model), rotary_modules(reference), strict=True):
        for variant in getattr(theirs, "layer_types", None) or [None]:  # Gemma 3: per kind
            extra = [] if variant is None else [variant]
            got, want = ours(probe, positions, *extra), theirs(probe, positions, *extra)
            for table, expected in zip(got, want, strict=True):
                assert table.dtype == expected.dtype and table.shape == expected.shape
                assert torch.equal(table, expected)


@pytest.mark.usefixtures("compiled")
def test_a_compiled_step_computes_the_tables_once() -> None:
    torch = require_torch()
    model, _ = model_pair("gemma3")            # one module, tables for two kinds of layer
    engine = Engine(model, num_blocks=32, block_size=4)
    engine.add_request("r", random_prompt(1, 11), greedy(3))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        engine.step()
    calls = [event.count for event in profile.key_averages()
             if event.key == "atb_mem::rotary_cos_sin"]
    assert calls == [2]


def test_a_module_of_another_shape_is_left_alone() -> None:
    torch = require_torch()

    class SectionedRotaryEmbedding(torch.nn.Module):
        """cos/sin per section (as a multimodal model's), not one table per position."""

        def __init__(self) -> None:
            super().__init__()
            self.inv_freq = torch.ones(4)

        def forward(self, x: Any, position_ids: Any) -> tuple[Any, Any]:
            table = torch.ones((3, *position_ids.shape, 8))
            return table, table

    model = torch.nn.Sequential(SectionedRotaryEmbedding())
    own = model[0].forward
    assert compute_rotary_once(model) == 0
    assert model[0].forward == own

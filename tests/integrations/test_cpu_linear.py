"""A compiled forward's bfloat16 linear layers (``integrations/cpu_linear.py``): below
``FEW_ROWS`` rows the core's product (float32 within float32 rounding of the exact product,
bfloat16 within one rounding, the same bits on any thread count), from ``FEW_ROWS`` rows summed
in float32 through the BLAS, within one rounding; layers taken over only where the CPU lacks
bfloat16 instructions, and only inside dynamo; a compiled Engine on Qwen3-0.6B's shapes that
uses them gives HF's tokens up to near ties (a wrong slice fails)."""

from __future__ import annotations

from typing import Any

import pytest

from atb_mem.integrations import cpu_linear as module
from atb_mem.integrations.compiled_forward import CompiledForward
from tests.serving.test_engine_qwen3_shapes import ARRIVALS, engine_for
from tests.support.models import model_pair, require_torch, run_poisoned
from tests.support.near_ties import assert_each_matches_hf_up_to_near_ties

torch = require_torch()


def within_one_rounding(result: Any, x: Any, weight: Any, bias: Any) -> bool:
    """Each element of ``result`` is the exact (float64) product rounded to bfloat16, or the
    bfloat16 value next to it (float32 sums carry an error of their own)."""
    exact = torch.nn.functional.linear(x.double(), weight.double(),
                                       None if bias is None else bias.double())
    nearest = exact.to(torch.bfloat16).double()
    # bfloat16 keeps 8 significant bits: two of its values one apart differ by 2^-7 of it.
    spacing = torch.maximum(nearest.abs(), exact.abs()) * 2.0 ** -7 + 1e-30
    return bool(((result.double() - exact).abs() <= spacing).all())


@pytest.mark.parametrize("rows", [1, 2, 3, 15, 16, 37])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_bfloat16_products_are_within_one_rounding(rows: int, with_bias: bool,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(module, "lacks_bf16_instructions", lambda: True)
    monkeypatch.setattr(module, "_SLICE_ELEMENTS", 16 * 48)  # 16 rows a slice: 7 slices, one short
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn((1, rows, 48), generator=generator).to(torch.bfloat16)
    weight = (torch.randn((100, 48), generator=generator) * 0.2).to(torch.bfloat16)
    bias = torch.randn(100, generator=generator).to(torch.bfloat16) if with_bias else None
    result = module.cpu_linear(x, weight, bias)
    assert result.shape == (1, rows, 100) and result.dtype == torch.bfloat16
    assert within_one_rounding(result, x, weight, bias)
    # The bound can fail: a slice (or the core's last features) left out is caught.
    broken = result.clone()
    broken[..., 96:] = 0
    assert not within_one_rounding(broken, x, weight, bias)


def within_float32_rounding(result: Any, x: Any, weight: Any) -> bool:
    """Each element within the error bound of a float32 dot product of K terms (K units in
    the last place of the sum of the terms' magnitudes), as torch's own product is."""
    exact = torch.nn.functional.linear(x.double(), weight.double())
    magnitude = torch.nn.functional.linear(x.double().abs(), weight.double().abs())
    bound = x.shape[-1] * 2.0 ** -24 * magnitude
    return bool(((result.double() - exact).abs() <= bound).all())


@pytest.mark.parametrize("rows", [1, 2, 5, 15])
@pytest.mark.parametrize("features", [(300, 70), (37, 5), (8, 1)], ids=str)
def test_few_float32_rows_take_the_cores_product(rows: int, features: tuple[int, int]) -> None:
    """K not a multiple of the core's 8 lanes, N not one of its groups of 4 nor of its
    64-feature pieces: every tail is exercised."""
    inner, outer = features
    generator = torch.Generator().manual_seed(rows * inner)
    x = torch.randn((rows, inner), generator=generator)
    weight = torch.randn((outer, inner), generator=generator)
    result = module.cpu_linear(x, weight, None)
    assert result.shape == (rows, outer) and within_float32_rounding(result, x, weight)
    torch_result = torch.nn.functional.linear(x, weight)
    assert within_float32_rounding(torch_result, x, weight)  # the bound torch's product meets
    # One thread or several: the same bits.
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(module.cpu_linear(x, weight, None), result)
    finally:
        torch.set_num_threads(threads)
    # The bound can fail: one term of a sum left out (its largest) is caught.
    terms = x[-1] * weight[-1]
    broken = result.clone()
    broken[-1, -1] -= terms[terms.abs().argmax()]
    assert not within_float32_rounding(broken, x, weight)


def test_other_dtypes_and_no_rows_are_torchs_own() -> None:
    weight = torch.randn((8, 4))
    x = torch.randn((32, 4))
    assert torch.equal(module.cpu_linear(x, weight, None), torch.nn.functional.linear(x, weight))
    empty = torch.zeros((0, 4), dtype=torch.bfloat16)
    assert module.cpu_linear(empty, weight.to(torch.bfloat16), None).shape == (0, 8)


def test_layers_are_taken_only_where_bfloat16_lacks_instructions(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = model_pair("qwen3_shapes")[0]
    linears = sum(type(layer) is torch.nn.Linear for layer in model.modules())
    monkeypatch.setattr(module, "lacks_bf16_instructions", lambda: True)
    assert module.compute_linears_on_cpu(model) == 0  # float32: torch's products stay
    model = model.to(torch.bfloat16)
    inputs = torch.randint(3, 100, (1, 20))
    with torch.inference_mode():
        before = model(inputs).logits
        assert module.compute_linears_on_cpu(model) == linears > 0
        assert module.compute_linears_on_cpu(model) == linears  # once per layer
        # Outside dynamo the model is transformers' own, bit for bit.
        assert torch.equal(model(inputs).logits, before)
    monkeypatch.setattr(module, "lacks_bf16_instructions", lambda: False)
    assert module.compute_linears_on_cpu(model_pair("qwen3_shapes")[0].to(torch.bfloat16)) == 0


def run_compiled_engine(monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, Any], Any, list[int]]:
    """A compiled bfloat16 Engine on Qwen3-0.6B's shapes, its linears taken over; the rows of
    each call of the operator."""
    monkeypatch.setattr(module, "lacks_bf16_instructions", lambda: True)
    calls: list[int] = []
    product = module.cpu_linear

    def counted(x: Any, weight: Any, bias: Any) -> Any:
        calls.append(x.numel() // x.shape[-1])
        return product(x, weight, bias)

    monkeypatch.setattr(module, "cpu_linear", counted)
    model, reference = (half.to(torch.bfloat16) for half in model_pair("qwen3_shapes"))
    engine = engine_for(model)
    assert isinstance(engine.runner.forward, CompiledForward)
    calls.clear()  # the warm-up's
    results = run_poisoned(engine, ARRIVALS)
    assert engine.runner.forward.failed is None
    return results, reference, calls


@pytest.mark.usefixtures("compiled")
def test_a_compiled_bfloat16_engine_sums_in_float32_and_gives_hfs_tokens(
        monkeypatch: pytest.MonkeyPatch) -> None:
    results, reference, calls = run_compiled_engine(monkeypatch)
    assert any(rows >= module.FEW_ROWS for rows in calls), calls
    assert any(rows < module.FEW_ROWS for rows in calls), calls
    differing = assert_each_matches_hf_up_to_near_ties(results, reference, ARRIVALS)
    print(f"requests leaving HF's tokens at a near tie: {len(differing)} of 5 {differing}")


@pytest.mark.usefixtures("compiled")
def test_a_wrong_product_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    product = module.cpu_linear

    def last_slice_dropped(x: Any, weight: Any, bias: Any) -> Any:
        result = product(x, weight, bias)
        if x.numel() // x.shape[-1] >= module.FEW_ROWS:
            result[..., -weight.shape[0] // 8:] = 0
        return result

    monkeypatch.setattr(module, "cpu_linear", last_slice_dropped)
    results, reference, _ = run_compiled_engine(monkeypatch)
    with pytest.raises(AssertionError, match="above twice"):
        assert_each_matches_hf_up_to_near_ties(results, reference, ARRIVALS)


@pytest.mark.usefixtures("compiled")
def test_a_compile_that_records_gradients_keeps_torchs_linear(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(module, "lacks_bf16_instructions", lambda: True)
    layer = torch.nn.Linear(8, 4).to(torch.bfloat16)
    assert module.compute_linears_on_cpu(layer) == 1
    x = torch.randn((32, 8)).to(torch.bfloat16)
    compiled = torch.compile(layer, backend="eager", fullgraph=True)
    compiled(x).float().sum().backward()  # the operator has no gradient: it must not be used
    assert layer.weight.grad is not None
    with torch.no_grad():
        taken = torch.compile(layer, backend="eager", fullgraph=True)(x)
    assert within_one_rounding(taken, x, layer.weight, layer.bias)


def test_bad_arguments_are_refused_and_change_nothing() -> None:
    weight = torch.randn((8, 4)).to(torch.bfloat16)
    for x in (torch.randn((32, 5)), torch.tensor(1.0), torch.randn((32, 8))):
        with pytest.raises(ValueError, match=r"x \[\.\.\., K\] and weight \[N, K\]"):
            module.cpu_linear(x.to(torch.bfloat16), weight, None)
    with pytest.raises(ValueError, match="weight"):
        module.cpu_linear(torch.randn((32, 4)).to(torch.bfloat16), weight[0], None)
    layer = torch.nn.Linear(4, 8).to(torch.bfloat16)
    forward = layer.forward
    with pytest.raises(TypeError, match="takes a torch module, got list"):
        module.compute_linears_on_cpu([layer])
    assert layer.forward == forward and not hasattr(layer, "_atb_mem_linear")


def test_the_cores_product_refuses_bad_arrays_and_writes_nothing() -> None:
    import numpy as np

    from atb_mem import _core

    x, weight = np.ones((2, 3), np.float32), np.ones((4, 3), np.float32)
    cases = [
        ((x, weight, np.zeros((2, 5), np.float32)), {}, "do not make"),
        ((x.reshape(6), weight, np.zeros((2, 4), np.float32)), {}, "x must be 2-D"),
        ((x, weight.astype(np.float64), np.zeros((2, 4), np.float32)), {}, "weight must be"),
        ((x, np.ones((3, 4), np.float32).T, np.zeros((2, 4), np.float32)), {}, "C-contiguous"),
        ((x, weight, np.zeros((2, 4), np.float32)), {"bias": np.ones(3, np.float32)}, "bias has 3"),
        ((x, weight, np.zeros((2, 4), np.float32)), {"bias": np.ones((1, 4), np.float32)}, "1-D"),
        ((x, weight, np.zeros((2, 4), np.float32)), {"threads": 0}, "threads"),
        ((x, weight, np.zeros((2, 4), np.float32)), {"dtype": "int8"}, "dtype must be"),
    ]
    for arrays, options, message in cases:
        out = arrays[2]
        before = out.copy()
        with pytest.raises((ValueError, OverflowError), match=message):
            _core.linear(*arrays, **{"dtype": "float32", **options})
        assert np.array_equal(out, before)
    out = np.zeros((2, 4), np.float32)
    _core.linear(x, weight, out, dtype="float32", bias=np.full(4, 0.5, np.float32), threads=2)
    assert np.array_equal(out, np.full((2, 4), 3.5, np.float32))

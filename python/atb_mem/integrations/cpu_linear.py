"""A compiled forward's bfloat16 linear layers on CPUs without bfloat16 instructions.

Without AVX512-BF16 or AMX (AVX2 CPUs, AMD's Zen 3 among them), torch's bfloat16 matrix
product converts and multiplies element by element inside oneDNN: ~20 GFLOP/s on two cores,
whatever the rows, where float32's BLAS runs at ~150 (oneDNN refuses a bfloat16 matmul
primitive there, so vLLM's CPU build falls back to the same ``F.linear``). So each such layer
becomes one opaque operator (``atb_mem::linear``), which decides by the step's rows when it
runs (no graph is compiled per size):

- below ``FEW_ROWS`` rows (decode steps) the core's product (``_core.linear``) reads the
  bfloat16 weight once, in place, and sums in float32, rounding once;
- from ``FEW_ROWS`` rows the weight is converted to float32 a slice of a few MiB at a time
  (converted while it stays in cache, so the model's memory does not grow), multiplied by
  float32's BLAS and the result rounded to bfloat16.

The products are torch's either way: a bfloat16 value is exactly a float32 one, and both
accumulate in float32 and round the sum to bfloat16 once; only the order of the additions
differs. Float32 layers stay torch's: the operator's call costs more than the core's product
saves over MKL's inside a compiled step (the toy's run, alternating: 9.0 s with them taken
over, 8.1 s without). A model called outside dynamo (the user's own ``generate``), or compiled
where autograd records (training), runs its linears as transformers made them.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from atb_mem import _core
from atb_mem.integrations.cpu_attention import CORE_DTYPES, numpy_bits, torch_cpu_has
from atb_mem.integrations.graph_operators import define_operator

if TYPE_CHECKING:
    import torch

__all__ = ["FEW_ROWS", "compute_linears_on_cpu", "cpu_linear", "lacks_bf16_instructions"]

FEW_ROWS = 16
"""Rows below which the core's product runs, and from which the product is taken in float32
through the BLAS (Qwen3-0.6B's 196 projections on a Zen 3 core pair, 16 rows: 0.49 against
torch's 0.70 s)."""

_SLICE_ELEMENTS = 1 << 21
"""Weight elements converted at a time: 8 MiB in float32, within a core pair's L3."""

_SCHEMA = "(Tensor x, Tensor weight, Tensor? bias) -> Tensor"


@functools.cache
def lacks_bf16_instructions() -> bool:
    """Whether this x86 CPU multiplies bfloat16 only by converting (no AVX512-BF16, no AMX);
    asked once (a linear of many rows asks on every call)."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    return not (torch_cpu_has("avx512_bf16") or torch_cpu_has("amx_tile"))


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: below ``FEW_ROWS`` rows of float32, bfloat16 or float16
    on the CPU the core's product; bfloat16 of more rows, on a CPU that lacks its
    instructions, in float32 through the BLAS; anything else torch's."""
    import torch

    if weight.dim() != 2 or x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"cpu_linear needs x [..., K] and weight [N, K]; got x "
                         f"{tuple(x.shape)} and weight {tuple(weight.shape)}")
    features = weight.shape[1]
    rows = x.numel() // features if features else 0
    same = x.dtype == weight.dtype and x.device.type == weight.device.type == "cpu"
    core_dtype = CORE_DTYPES.get(str(x.dtype))
    if 0 < rows < FEW_ROWS and same and core_dtype is not None:
        out = x.new_empty((rows, weight.shape[0]))
        _core.linear(numpy_bits(x.reshape(rows, features).contiguous()),
                     numpy_bits(weight.contiguous()), numpy_bits(out), dtype=core_dtype,
                     bias=None if bias is None else numpy_bits(bias.to(x.dtype).contiguous()),
                     threads=torch.get_num_threads())
        return out.reshape(*x.shape[:-1], weight.shape[0])
    if rows < FEW_ROWS or not same or x.dtype != torch.bfloat16 or not lacks_bf16_instructions():
        return torch.nn.functional.linear(x, weight, bias)
    inputs = x.reshape(rows, features).float()
    out = x.new_empty((rows, weight.shape[0]))
    step = max(16, _SLICE_ELEMENTS // max(features, 1))
    for start in range(0, weight.shape[0], step):
        stop = min(start + step, weight.shape[0])
        product = torch.mm(inputs, weight[start:stop].float().t())
        if bias is not None:
            product += bias[start:stop]
        out[:, start:stop] = product  # rounds to bfloat16, to nearest even
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _operator() -> Any:
    def kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return cpu_linear(x, weight, bias)

    def fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    return define_operator("linear", _SCHEMA, kernel, fake)


def compute_linears_on_cpu(model: Any) -> int:
    """Puts ``model``'s bfloat16 ``nn.Linear`` layers on the CPU behind the operator where
    dynamo traces them, on a CPU that lacks bfloat16 instructions; returns how many layers it
    took (none on another CPU, device or dtype)."""
    import torch

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"compute_linears_on_cpu takes a torch module, got "
                        f"{type(model).__name__}")
    if not lacks_bf16_instructions():
        return 0
    operator = _operator()
    layers: list[Any] = [module for module in model.modules()
                         if type(module) is torch.nn.Linear and module.weight.device.type == "cpu"
                         and module.weight.dtype == torch.bfloat16]
    for layer in layers:
        if not getattr(layer, "_atb_mem_linear", False):
            layer.forward = _forward(layer, operator)
            layer._atb_mem_linear = True
    return len(layers)


def _forward(module: Any, operator: Any) -> Any:
    import torch

    def forward(x: torch.Tensor) -> torch.Tensor:
        # Dynamo's own test: true only where this thread's dynamo traces this call. The
        # operator has no gradient: a compile that records one (the user's) keeps F.linear.
        if torch.compiler.is_dynamo_compiling() and not torch.is_grad_enabled():
            result: torch.Tensor = operator(x, module.weight, module.bias)
            return result
        return torch.nn.functional.linear(x, module.weight, module.bias)

    return forward

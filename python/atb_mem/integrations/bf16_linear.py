"""bfloat16 linear layers computed in float32 on CPUs without bfloat16 instructions.

Without AVX512-BF16 or AMX (AVX2 CPUs, AMD's Zen 3 among them), torch's bfloat16 matrix
product converts and multiplies element by element inside oneDNN: ~20 GFLOP/s on two cores,
where float32's BLAS runs at ~150 (oneDNN refuses a bfloat16 matmul primitive there, so vLLM's
CPU build falls back to the same ``F.linear``). The products are the same either way: a
bfloat16 value is exactly a float32 one, and both accumulate in float32 and round the sum to
bfloat16 once; only the order of the additions differs. So a linear over enough rows converts
its weight to float32 (a slice of a few MiB at a time, converted while it stays in cache, so
the model's memory does not grow), multiplies in float32 and rounds the result to bfloat16.
Below ``MIN_ROWS`` rows the conversion costs more than it saves: those keep torch's product
(a decode's single row is a matrix-vector product reading bfloat16 weights).

Only a compiled forward takes the layers over (``compute_bf16_linears_in_f32``): they become
one opaque operator each (``atb_mem::bf16_linear``), which decides by the step's rows when it
runs, so no graph is compiled per size. A model called outside dynamo (the user's own
``generate``), or compiled where autograd records (training), runs its linears as transformers
made them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from atb_mem.integrations.cpu_attention import torch_cpu_has
from atb_mem.integrations.graph_operators import define_operator

if TYPE_CHECKING:
    import torch

__all__ = ["MIN_ROWS", "bf16_linear", "compute_bf16_linears_in_f32", "lacks_bf16_instructions"]

MIN_ROWS = 16
"""Rows from which a product in float32 is faster (all 196 of Qwen3-0.6B's projections on a
Zen 3 core pair: 16 rows 0.49 against 0.70 s; 8 rows 0.36 against 0.37 s, no gain)."""

_SLICE_ELEMENTS = 1 << 21
"""Weight elements converted at a time: 8 MiB in float32, within a core pair's L3."""

_SCHEMA = "(Tensor x, Tensor weight, Tensor? bias) -> Tensor"


def lacks_bf16_instructions() -> bool:
    """Whether this x86 CPU multiplies bfloat16 only by converting (no AVX512-BF16, no AMX)."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    return not (torch_cpu_has("avx512_bf16") or torch_cpu_has("amx_tile"))


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for bfloat16 tensors, its products summed in float32."""
    import torch

    if weight.dim() != 2 or x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"bf16_linear needs x [..., K] and weight [N, K]; got x "
                         f"{tuple(x.shape)} and weight {tuple(weight.shape)}")
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows < MIN_ROWS or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        return torch.nn.functional.linear(x, weight, bias)
    features = weight.shape[1]
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
        return bf16_linear(x, weight, bias)

    def fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    return define_operator("bf16_linear", _SCHEMA, kernel, fake)


def compute_bf16_linears_in_f32(model: Any) -> int:
    """Puts ``model``'s bfloat16 ``nn.Linear`` layers behind the operator where dynamo traces
    them, on a CPU that lacks bfloat16 instructions; returns how many layers it took (none on
    another CPU, device or dtype)."""
    import torch

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"compute_bf16_linears_in_f32 takes a torch module, got "
                        f"{type(model).__name__}")
    if not lacks_bf16_instructions():
        return 0
    operator = _operator()
    layers: list[Any] = [module for module in model.modules()
                         if type(module) is torch.nn.Linear and module.weight.device.type == "cpu"
                         and module.weight.dtype == torch.bfloat16]
    for layer in layers:
        if not getattr(layer, "_atb_mem_bf16_linear", False):
            layer.forward = _forward(layer, operator)
            layer._atb_mem_bf16_linear = True
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

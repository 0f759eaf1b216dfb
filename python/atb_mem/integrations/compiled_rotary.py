"""A compiled forward's rotary embedding, computed once per step.

transformers computes a forward's cos/sin once (the model's rotary module) and hands them to
every layer. Under ``torch.compile`` that stays one computation on paper only: cos and sin are
pointwise in the positions, so inductor inlines them into each layer's fused rotary loop and
evaluates both transcendentals again in every layer (28 times a step on Qwen3-0.6B, where those
loops took ~4% of a prefill step). Behind an opaque operator (``atb_mem::rotary_cos_sin``) the
module's own forward computes them once, eagerly, and the layers' loops read them: the values
are the module's, bit for bit.

A rotary module is taken over only where its output is one ``[..., head_dim]`` table per
position (``position_ids``' shape plus one size), as every text model's is; any other (a
multimodal one's sections, say) is left as it is.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from atb_mem.integrations.graph_operators import define_operator

if TYPE_CHECKING:
    import torch

__all__ = ["compute_rotary_once"]

_SCHEMA = "(Tensor x, Tensor position_ids, int module, str? variant) -> (Tensor, Tensor)"
_forwards: list[tuple[weakref.WeakMethod[Any], dict[str | None, int]]] = []
"""Per module taken over, its own forward (weakly: a model let go goes) and, per variant it
computes (Gemma 3's one per kind of layer; else None), the size of its tables' last
dimension."""


def _operator() -> Any:
    def kernel(x: torch.Tensor, position_ids: torch.Tensor, module: int,
               variant: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        forward = _forwards[module][0]()
        if forward is None:
            raise RuntimeError("this rotary module no longer exists")
        cos, sin = forward(x, position_ids, *([] if variant is None else [variant]))
        return cos.contiguous(), sin.contiguous()

    def fake(x: torch.Tensor, position_ids: torch.Tensor, module: int,
             variant: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (*position_ids.shape, _forwards[module][1][variant])
        return x.new_empty(shape), x.new_empty(shape)

    return define_operator("rotary_cos_sin", _SCHEMA, kernel, fake)


def _table_sizes(module: Any, dtype: Any) -> dict[str | None, int] | None:
    """Per variant of ``module``, the size of its tables' last dimension; None where its
    output is not one table per position, or it does not compute every variant."""
    import torch

    sizes: dict[str | None, int] = {}
    variants: list[str | None] = list(getattr(module, "layer_types", None) or [None])
    device = next(iter(module.buffers()), torch.zeros(())).device
    probe = torch.zeros((1, 1), dtype=dtype, device=device)
    positions = torch.zeros((1, 1), dtype=torch.long, device=device)
    for variant in variants:
        try:
            with torch.inference_mode():
                cos, sin = module(probe, positions, *([] if variant is None else [variant]))
        except Exception:  # a variant it cannot compute: not ours to take over
            return None
        if cos.dim() != 3 or cos.shape[:2] != (1, 1) or sin.shape != cos.shape:
            return None
        sizes[variant] = int(cos.shape[-1])
    return sizes


def compute_rotary_once(model: Any) -> int:
    """Puts ``model``'s rotary modules behind the opaque operator (once per module); returns
    how many modules are behind it."""
    import torch

    operator = _operator()
    taken = 0
    for module in model.modules():
        if getattr(module, "_atb_mem_rotary", None) is not None:
            taken += 1
            continue
        if not type(module).__name__.endswith("RotaryEmbedding"):
            continue
        sizes = _table_sizes(module, getattr(model, "dtype", torch.float32))
        if sizes is None:
            continue
        index = len(_forwards)
        _forwards.append((weakref.WeakMethod(module.forward), sizes))

        def forward(x: torch.Tensor, position_ids: torch.Tensor, variant: str | None = None,
                    index: int = index) -> tuple[torch.Tensor, torch.Tensor]:
            result: tuple[torch.Tensor, torch.Tensor] = operator(x, position_ids, index,
                                                                 variant)
            return result

        module.forward = forward
        module._atb_mem_rotary = index
        taken += 1
    return taken

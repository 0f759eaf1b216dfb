"""The model's forward compiled with ``torch.compile``, atb-mem's paged attention inside it as
one opaque operator.

Eager transformers spends a CPU step on many small operators: RMSNorm's five, rotary's
slices and concatenations, SiLU times the up projection, residual adds, each a dispatch and a
pass over memory. Inductor fuses them into a few loops, as vLLM's CPU build does. The
attention stays atb-mem's: ``atb_mem::paged_attention`` is a custom operator that dynamo does
not trace into; it finds the step (block tables, slots, caches) where the eager path does,
writes the layer's new K/V into the cache and returns the attention output, so the graph sees
only ``(query, key, value) -> out``.

Shapes: the number of the step's tokens and of its sampled rows change every step. Both are
compiled as symbolic sizes (``dynamic=True``), so one graph serves every step from 2 tokens
up. torch specializes sizes 0 and 1: there the sampled rows are padded to two at least (the
padding row's logits are dropped). A step of one token (a single decode) has the second
graph, all of its sizes 1: its one row is not padded (the vocabulary's projection of one row
runs as a matrix-vector product, 12 against 19 ms on Qwen3-0.6B's in bfloat16).
The runner compiles both at start-up on steps that change no cache
(``forward_plan.warm_up_plans``); no step recompiles after that.
``benches/engine_vs_vllm.py`` reports what that start-up costs.
Not compiled: a model whose layers keep recurrent state (its mixers read and write the state
through Python hooks), a tensor-parallel rank, and CUDA (FlashInfer's path stays eager).
"""

from __future__ import annotations

import inspect
import warnings
from typing import TYPE_CHECKING, Any

from atb_mem.integrations.compiled_rotary import compute_rotary_once
from atb_mem.integrations.cpu_linear import compute_linears_on_cpu
from atb_mem.integrations.graph_operators import define_operator
from atb_mem.integrations.step_attention import attend_step

if TYPE_CHECKING:
    import torch

__all__ = ["CompiledForward", "attend_compiled", "paged_attention_op"]

_SCHEMA = ("(Tensor query, Tensor key, Tensor value, int layer_idx, float scaling, "
           "Tensor? sinks) -> Tensor")


def paged_attention_op() -> Any:
    """``torch.ops.atb_mem.paged_attention``, defined on first use: ``(query [1, H, T, D],
    key and value [1, kv_heads, T, D], layer index, scaling, sinks or None) -> [1, T, H, D]``,
    the current step's attention for that layer (``paged_attention_forward``). It writes the
    layer's K/V into the cache, which is no input of the graph: nothing to declare. Its output
    feeds the next layer, so the graph keeps the layers in order."""

    def kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int,
               scaling: float, sinks: torch.Tensor | None) -> torch.Tensor:
        return attend_step(layer_idx, query, key, value, scaling, sinks)

    def fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int,
             scaling: float, sinks: torch.Tensor | None) -> torch.Tensor:
        return query.new_empty((1, query.shape[2], query.shape[1], query.shape[3]))

    return define_operator("paged_attention", _SCHEMA, kernel, fake)


class CompiledForward:
    """``model``'s forward under ``torch.compile``, or eager where compiling fails: the first
    compiled call that fails where the eager forward succeeds (torch cannot compile this model
    here) warns once and the model runs eager from then on. Compiles its graphs when the
    runner warms it up (``forward_plan.warm_up_plans``)."""

    def __init__(self, model: Any) -> None:
        import torch

        paged_attention_op()
        compute_rotary_once(model)
        compute_linears_on_cpu(model)
        self.model = model
        # Graphs of its own: by default every compile of one model class shares the class's
        # forward's entries and their recompile limit (8), and the fifth engine of a class in
        # a process ran eager, silently, once its predecessors had used them up (an older
        # torch has no isolation to ask for).
        isolated = "isolate_recompiles" in inspect.signature(torch.compile).parameters
        self.compiled: Any = torch.compile(  # type: ignore[call-overload]
            model, dynamic=True, **({"isolate_recompiles": True} if isolated else {}))
        self.failed: str | None = None

    def __call__(self, *, logits_to_keep: torch.Tensor, **inputs: Any) -> Any:
        import torch

        # Two rows at least where the step has two tokens or more: sizes 0 and 1 would each
        # compile a graph of their own. A one-token step's graph has one row.
        count = len(logits_to_keep)
        rows = 1 if inputs["input_ids"].shape[-1] == 1 else 2
        if count < rows:
            logits_to_keep = torch.cat([logits_to_keep,
                                        logits_to_keep.new_zeros(rows - count)])
        output = self._run(logits_to_keep=logits_to_keep, **inputs)
        output.logits = output.logits[:, :count]
        return output

    def _run(self, **inputs: Any) -> Any:
        if self.failed is not None:
            return self.model(**inputs)
        try:
            return self.compiled(**inputs)
        except Exception as error:
            # Not only dynamo's own errors: a guard it cannot build, say, because another
            # thread's compile changed some library's state midway. The eager forward tells a
            # broken compile from a step the model itself refuses (its error is raised, the
            # graphs stay). Running the step again is safe: it writes the same K/V to the
            # same slots, and a compiled model keeps no recurrent state.
            reason = f"{type(error).__name__}: {error}".splitlines()[0]
        output = self.model(**inputs)
        self.failed = reason
        warnings.warn(f"atb-mem: torch.compile cannot compile this model here ({reason}); "
                      "it runs eager", stacklevel=3)
        return output


def attend_compiled(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    scaling: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """The attention call inside a compiled graph: the opaque operator."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out: torch.Tensor = paged_attention_op()(query, key, value, module.layer_idx, float(scale),
                                             sinks)
    return out

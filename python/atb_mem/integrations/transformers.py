"""Hugging Face transformers models over atb-mem's paged KV cache.

transformers (≥ 5) looks attention up by name in ``AttentionInterface``; this module registers
``"atb_mem_paged"`` there. A model switched to it (by ``ModelRunner``, for each step only) keeps
its own code for everything else — projections, rotary embeddings, q/k norms, experts — and
calls back here once per layer with the step's new queries, keys and values. The attention
function writes the new K/V into the cache's slots (ATB's ReshapeAndCache) and attends over each
sequence's paged K/V, causal within the sequence's new tokens, with grouped-query heads.

The step it serves is described by a :class:`StepAttention` built once per step from the
scheduler's ``StepPlan`` and shared by every layer; :class:`ModelRunner` does that and runs
the model over the plan's flattened tokens (one batch row, no padding between sequences).
transformers never builds a mask or a cache of its own here: no mask function is registered
under the name, so it skips the mask, and the model runs with ``use_cache=False``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import numpy as np

from atb_mem._types import AttentionBackend
from atb_mem.integrations.attention_backends import attention_kernel
from atb_mem.integrations.attention_switch import AttentionSwitch
from atb_mem.integrations.compiled_forward import CompiledForward, attend_compiled
from atb_mem.integrations.cpu_attention import CpuPagedAttention
from atb_mem.integrations.first_fx_trace import trace_inductors_dummy_once
from atb_mem.integrations.forward_plan import warm_up_plans
from atb_mem.integrations.hub_kernel_context import make_kernel_funcs_per_thread
from atb_mem.integrations.layer_attention import (
    LayerAttention,
    kv_cache_groups,
    layer_attention,
    layer_groups,
)
from atb_mem.integrations.recurrent_state import RecurrentStates, recurrent_step
from atb_mem.integrations.reference_attention import PagedRows
from atb_mem.integrations.step_attention import (
    ATTN_IMPLEMENTATION,
    StepAttention,
    attend_step,
    paged_step,
)

if TYPE_CHECKING:
    import torch

    from atb_mem.kv.cache_pool import KVCachePool
    from atb_mem.scheduling.continuous import StepPlan

__all__ = ["ATTN_IMPLEMENTATION", "LayerAttention", "ModelRunner", "PagedRows", "StepAttention",
           "attend_step", "kv_cache_groups", "kv_cache_layout", "layer_attention",
           "paged_attention_forward", "paged_step", "supported_layers", "use_paged_attention"]

_TORCH_TO_KV_DTYPE = {"torch.float32": "float32", "torch.float16": "float16",
                      "torch.bfloat16": "bfloat16"}

def paged_attention_forward(module: Any, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: Any, scaling: float | None = None,
                            dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: ``query`` ``[1, heads, T, D]``, ``key``/``value``
    ``[1, kv_heads, T, D]`` (this step's new tokens); returns ``[1, T, heads, D]``."""
    import torch

    # Dynamo's own test, true only where this thread's dynamo traces this call: the graph
    # holds one opaque call (compiled_forward). Not ``is_compiling()``: that is one flag for
    # the process, held while any thread compiles anything.
    if torch.compiler.is_dynamo_compiling():
        return attend_compiled(module, query, key, value, scaling, kwargs.get("s_aux")), None
    return attend_step(module.layer_idx, query, key, value, scaling, kwargs.get("s_aux")), None


def use_paged_attention(model: Any) -> None:
    """Registers the attention function and switches ``model`` to it for good, for a caller
    that runs every forward inside ``paged_step`` (``ModelRunner`` switches it per step)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)


def kv_cache_layout(model: Any, tensor_parallel_size: int = 1) -> dict[str, Any]:
    """``num_layers``, ``num_kv_heads``, ``head_dim`` and ``dtype`` of a model's KV cache (of
    one rank's share of the KV heads under tensor parallelism)."""
    config = model.config.get_text_config()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    dtype = _TORCH_TO_KV_DTYPE.get(str(model.dtype))
    if dtype is None:
        raise ValueError(f"atb-mem holds K/V as {sorted(_TORCH_TO_KV_DTYPE.values())}; the model "
                         f"computes in {model.dtype}")
    return {"num_layers": config.num_hidden_layers,
            "num_kv_heads": (getattr(config, "num_key_value_heads", None) or heads)
            // tensor_parallel_size,
            "head_dim": head_dim, "dtype": dtype}


def supported_layers(model: Any) -> list[LayerAttention]:
    """Each layer's attention; refuses what this function does not compute as the model does."""
    config = model.config.get_text_config()
    if getattr(config, "attn_logit_softcapping", None):
        raise NotImplementedError(f"{type(model).__name__} caps attention logits (softcapping); "
                                  "atb-mem's attention does not")
    if getattr(config, "attn_temperature_tuning", False) and \
            not all(getattr(config, "no_rope_layers", None) or [1]):
        # Llama 4 scales NoPE layers' queries by position read from its own cache's length.
        raise NotImplementedError(f"{type(model).__name__} tunes attention temperature from its "
                                  "own cache; set attn_temperature_tuning=False to serve it here")
    return layer_attention(config)


class ModelRunner:
    """Runs a transformers causal LM for each ``StepPlan`` over a ``KVCachePool``'s bytes.

    ``execute(plan)`` returns the logits of the plan's ``sample_seq_ids``, in that order.
    """

    def __init__(self, model: Any, kv_cache: KVCachePool, tensor_parallel_size: int = 1,
                 attention_backend: AttentionBackend = "auto", enforce_eager: bool = False
                 ) -> None:
        import torch

        if not isinstance(enforce_eager, bool):
            raise TypeError(f"enforce_eager must be a bool, got {type(enforce_eager).__name__}")
        self.layers = supported_layers(model)
        layout = kv_cache_layout(model, tensor_parallel_size)
        for name, expected in layout.items():
            if getattr(kv_cache, name) != expected:
                raise ValueError(f"the KV cache has {name}={getattr(kv_cache, name)!r}; the model "
                                 f"needs {expected!r}")
        if kv_cache.tensors is None or kv_cache.tensors.backend.name != "torch":
            raise ValueError("the KV cache must hold its bytes in torch tensors (device='cpu', "
                             "'cuda', ...) on the model's device")
        self.model = model
        self.kv_cache = kv_cache
        # Before any forward: other threads may compile while this engine serves.
        make_kernel_funcs_per_thread()
        trace_inductors_dummy_once()
        self.device = torch.device(model.device)
        if torch.device(kv_cache.kv_cache.device) != self.device:
            raise ValueError(f"the KV cache is on {kv_cache.kv_cache.device}; the model on "
                             f"{self.device}")
        config = model.config.get_text_config()
        self.kernel = attention_kernel(attention_backend, self.device,
                                       config.num_attention_heads // tensor_parallel_size,
                                       kv_cache.num_kv_heads, kv_cache.head_dim,
                                       kv_cache.block_size, model.dtype, kv_cache.kv_cache_dtype)
        # A row: head_dim elements, or a quantized cache's head_dim codes and their scale.
        shape = (-1, kv_cache.num_kv_heads, kv_cache.kv_cache.shape[-1])
        self.layer_groups = layer_groups(self.layers, kv_cache)
        # A recurrent layer has no K/V: its mixer reads and writes its state blocks.
        self.layer_caches = [(None, None) if attention.is_recurrent else
                             (kv_cache.key_cache(layer).view(shape),
                              kv_cache.value_cache(layer).view(shape))
                             for layer, attention in enumerate(self.layers)]
        recurrent = any(attention.is_recurrent for attention in self.layers)
        # A quantized cache quantizes K/V only: states keep the model's dtype in its bytes.
        self.recurrent = RecurrentStates(model, kv_cache, self.layers) if recurrent else None
        # Only inside a step: outside, the user's model runs as transformers would.
        self.attention = AttentionSwitch(model, ATTN_IMPLEMENTATION, paged_attention_forward)
        # Compiled around the CPU kernel, one rank; recurrent layers' Python hooks stay eager.
        compiles = isinstance(self.kernel, CpuPagedAttention) and self.recurrent is None \
            and tensor_parallel_size == 1 and not enforce_eager
        self.forward = CompiledForward(model) if compiles else model
        if isinstance(self.forward, CompiledForward):  # compiles now, not in the first steps
            for plan in warm_up_plans(max(self.layer_groups) + 1):
                self.execute(cast("StepPlan", plan))

    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Runs the model over the plan's tokens; float32 logits ``[len(sample_seq_ids), V]``."""
        import torch

        if plan.num_batched_tokens == 0:
            return torch.empty((0, 0), dtype=torch.float32)
        input_ids = plan.input_ids
        if input_ids.size and input_ids.min() < 0:
            raise ValueError("the plan has tokens without ids: give requests their token ids")
        step = StepAttention.from_plan(plan, self.layer_caches, self.kv_cache.block_size,
                                       self.device, self.layers, self.layer_groups,
                                       self.kernel, self.kv_cache.kv_cache_dtype)

        def tensor(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array.astype(np.int64)).to(self.device)

        with torch.inference_mode(), paged_step(step), self.attention.active(), \
                recurrent_step(self.recurrent, plan):
            output = self.forward(input_ids=tensor(input_ids)[None],
                                position_ids=tensor(plan.positions)[None], use_cache=False,
                                logits_to_keep=tensor(plan.logits_indices))
        logits: torch.Tensor = output.logits[0].float()
        return logits

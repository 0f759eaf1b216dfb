"""One step's attention over the paged KV cache, the part every path shares: what a step's
layers need (``StepAttention``, built once per step from the scheduler's ``StepPlan``), the
step the attention serves while a forward runs (``paged_step``), and one layer's attention in
it (``attend_step``): the body of transformers' attention function here and of the compiled
graph's opaque operator (``compiled_forward``), which both import it from here.

A paged kernel (atb-mem's on the CPU, FlashInfer on CUDA) serves the layers it can; the rest
take the torch reference: a row whose K/V is all new attends over its own new keys (SDPA),
the others over their K/V gathered through the block tables. Over a quantized cache the
reference writes rows as the core does and reads them back dequantized, fresh rows included
(over what their rows will read back as), so that a prefix hit computes what a recompute does.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from atb_mem._types import KVCacheDtype
from atb_mem.integrations.cpu_attention import CpuPagedAttention, CpuPagedStep
from atb_mem.integrations.flashinfer import FlashInferAttention, FlashInferStep
from atb_mem.integrations.layer_attention import FULL_ATTENTION, LayerAttention
from atb_mem.integrations.reference_attention import PagedRows, attend_paged, sdpa_attention
from atb_mem.kv.quantized_rows import dequantize_tensor_rows, quantize_tensor_rows

if TYPE_CHECKING:
    import torch

    from atb_mem.scheduling.continuous import StepPlan

__all__ = ["ATTN_IMPLEMENTATION", "StepAttention", "attend_step", "paged_step"]

ATTN_IMPLEMENTATION = "atb_mem_paged"
"""The name the attention function is registered under in transformers' ``AttentionInterface``."""

_current_step: ContextVar[StepAttention | None] = ContextVar("atb_mem_step", default=None)


@dataclass(frozen=True)
class StepAttention:
    """What every layer's attention needs for one step, on the model's device, built once.

    Rows are split so no row pays for another's length: a row whose K/V is all new this step
    (a prefill without cached context) attends over its own new keys; decodes are batched;
    any other row (a later prefill chunk, a prefix hit) is gathered alone. Masks are built
    once per kind of layer (full, each window, each chunk size), when a layer of that kind
    first needs them (the CPU kernel's never do), and shared by its layers.
    """

    layer_caches: list[tuple[Any, Any]]
    """Per layer, the key and value caches flattened to ``[slots, kv_heads, head_dim]``."""
    layers: list[LayerAttention]
    layer_groups: list[int]
    """Per layer, its KV-cache group (all 0 without groups)."""
    slot_mappings: list[torch.Tensor]
    """Per KV-cache group, int64 ``[T]``: where each new token's K/V is written."""
    fresh: list[tuple[int, int]]
    """Token ranges of the rows whose K/V is all new."""
    plan: StepPlan
    row_sets: list[np.ndarray]
    """The plan's rows other than the fresh ones, as they are gathered together."""
    block_size: int
    device: Any
    kv_cache_dtype: KVCacheDtype = "auto"
    """How the caches store K/V: in the model's dtype, or as quantized rows (uint8)."""
    kernel: FlashInferStep | CpuPagedStep | None = None
    """The step of a paged kernel (FlashInfer, atb-mem's on the CPU) that serves the layers
    it can."""
    paged: dict[int, list[PagedRows]] = field(default_factory=dict)
    """Per KV-cache group, its ``row_sets`` gathered through the group's block tables: built
    on first use (a group whose layers all run on the kernel never needs them)."""
    masks: dict[LayerAttention, list[torch.Tensor | None]] = field(default_factory=dict)
    """Per kind of layer and fresh row, bool ``[1, 1, q, q]`` (None where causal is all):
    built on first use, as ``paged``."""

    def fresh_masks(self, kind: LayerAttention) -> list[torch.Tensor | None]:
        masks = self.masks.get(kind)
        if masks is None:
            masks = [_fresh_mask(kind, end - start, self.device) for start, end in self.fresh]
            self.masks[kind] = masks
        return masks

    def paged_rows(self, group: int) -> list[PagedRows]:
        rows = self.paged.get(group)
        if rows is None:
            kinds = {kind for kind, g in zip(self.layers, self.layer_groups, strict=True)
                     if g == group}
            tables = self.plan.block_tables.reshape(-1, *self.plan.block_tables.shape[-2:])
            rows = [PagedRows.build(self.plan, row_set, tables[group], self.block_size,
                                    self.device, kinds) for row_set in self.row_sets]
            self.paged[group] = rows
        return rows

    @classmethod
    def from_plan(cls, plan: StepPlan, layer_caches: list[tuple[Any, Any]], block_size: int,
                  device: Any, layers: list[LayerAttention] | None = None,
                  layer_groups: list[int] | None = None,
                  kernel: FlashInferAttention | CpuPagedAttention | None = None,
                  kv_cache_dtype: KVCacheDtype = "auto") -> StepAttention:
        import torch

        layers = layers or [FULL_ATTENTION] * len(layer_caches)
        layer_groups = layer_groups or [0] * len(layers)
        num_groups = max(layer_groups) + 1
        # One group: 1-D slots and 2-D tables; several: one row (plane) per group.
        slot_rows = plan.slot_mapping.reshape(num_groups, -1)
        table_planes = plan.block_tables.reshape(num_groups, *plan.block_tables.shape[-2:])
        query_lens, seq_lens = plan.query_lens, plan.seq_lens
        starts = plan.query_start_loc.tolist()
        is_fresh = query_lens == seq_lens
        decodes = np.flatnonzero((query_lens == 1) & ~is_fresh)
        alone = np.flatnonzero((query_lens > 1) & ~is_fresh)
        row_sets = ([decodes] if len(decodes) else []) + [alone[i:i + 1]
                                                           for i in range(len(alone))]
        fresh = [(starts[row], starts[row + 1]) for row in np.flatnonzero(is_fresh)]
        slots = [torch.from_numpy(row.astype(np.int64)).to(device) for row in slot_rows]
        return cls(layer_caches=layer_caches, layers=layers, layer_groups=layer_groups,
                   slot_mappings=slots, fresh=fresh, plan=plan, row_sets=row_sets,
                   block_size=block_size, device=device, kv_cache_dtype=kv_cache_dtype,
                   kernel=None if kernel is None else kernel.begin_step(
                       query_lens, seq_lens, table_planes, slot_rows))


@contextmanager
def paged_step(step: StepAttention) -> Iterator[StepAttention]:
    """Makes ``step`` the one the attention function serves while the block runs."""
    token = _current_step.set(step)
    try:
        yield step
    finally:
        _current_step.reset(token)


def attend_step(layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                scaling: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Layer ``layer_idx``'s attention in the current step, eagerly: writes the new K/V into
    the cache and returns ``[1, T, H, D]`` (the body of ``paged_attention_forward`` and of the
    compiled graph's operator). ``sinks`` (gpt-oss's ``s_aux``): a learned logit per head
    that takes a share of the softmax."""
    import torch

    step = _current_step.get()
    if step is None:  # only a model switched for good (use_paged_attention) gets here
        raise RuntimeError(f"the {ATTN_IMPLEMENTATION!r} attention runs inside a step: call the "
                           "model through atb_mem's ModelRunner (or within paged_step)")
    group = step.layer_groups[layer_idx]
    slot_mapping = step.slot_mappings[group]
    if query.shape[0] != 1 or query.shape[2] != slot_mapping.shape[0]:
        raise ValueError(f"expected the step's {slot_mapping.shape[0]} tokens as one batch "
                         f"row, got queries of shape {tuple(query.shape)}")
    key_cache, value_cache = step.layer_caches[layer_idx]
    kind = step.layers[layer_idx]
    new_keys, new_values = key[0].transpose(0, 1), value[0].transpose(0, 1)    # [T, kv, D]
    # A quantized cache (uint8 rows) takes the model's dtype: the kernel quantizes.
    stored = key_cache.dtype if key_cache.dtype.is_floating_point else query.dtype
    if new_keys.dtype != stored:
        new_keys, new_values = new_keys.to(stored), new_values.to(stored)
    kernel = step.kernel
    if kernel is not None and kernel.kernel.serves(kind, sinks):
        queries = query[0].transpose(0, 1)
        if isinstance(kernel, CpuPagedStep):  # writes the slots in the same call
            out = kernel.attend(group, kind, queries, key_cache, value_cache, scaling, sinks,
                                (new_keys, new_values))
        else:
            key_cache.index_copy_(0, slot_mapping, new_keys)
            value_cache.index_copy_(0, slot_mapping, new_values)
            out = kernel.attend(group, kind, queries, key_cache, value_cache, scaling)
        return out.unsqueeze(0)
    quantized = step.kv_cache_dtype != "auto"
    if quantized:
        new_keys = quantize_tensor_rows(new_keys, step.kv_cache_dtype)
        new_values = quantize_tensor_rows(new_values, step.kv_cache_dtype)
        # Fresh rows attend over what their rows read back as, as a later hit would.
        key, value = (dequantize_tensor_rows(rows, step.kv_cache_dtype).to(query.dtype)
                      .transpose(0, 1)[None] for rows in (new_keys, new_values))
    key_cache.index_copy_(0, slot_mapping, new_keys)
    value_cache.index_copy_(0, slot_mapping, new_values)
    out = torch.empty((query.shape[2], query.shape[1], query.shape[3]), dtype=query.dtype,
                      device=query.device)                                 # [T, H, D]
    _attend_fresh(step, kind, (query, key, value), scaling, sinks, out)
    queries_by_token = query[0].transpose(0, 1)                            # [T, H, D]
    for rows in step.paged_rows(group):
        out[rows.token_ids] = attend_paged(queries_by_token, key_cache, value_cache, rows,
                                            rows.masks[kind], scaling, sinks,
                                            step.kv_cache_dtype)
    return out.unsqueeze(0)


def _attend_fresh(step: StepAttention, kind: LayerAttention,
                  qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor], scaling: float | None,
                  sinks: torch.Tensor | None, out: torch.Tensor) -> None:
    """The rows whose K/V is all new, attending over their own new keys, into ``out``."""
    query, key, value = qkv
    for (start, end), mask in zip(step.fresh, step.fresh_masks(kind), strict=True):
        attended = sdpa_attention(query[:, :, start:end], key[:, :, start:end],
                                  value[:, :, start:end], mask, scaling, sinks)
        out[start:end] = attended[0].transpose(0, 1)


def _fresh_mask(kind: LayerAttention, length: int, device: Any) -> torch.Tensor | None:
    """Which of a fresh row's own ``length`` keys each of its queries sees under ``kind``."""
    import torch

    if length <= kind.unmasked_length:
        return None  # the window cuts nothing off: causal is all
    positions = np.arange(length)
    visible = kind.visible(positions[:, None], positions[None, :])
    return torch.from_numpy(visible[None, None]).to(device)

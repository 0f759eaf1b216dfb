"""Recurrent layers of transformers models over the state blocks of atb-mem's KV cache: the
Mamba2 mixers of IBM Granite 4.0-H (``decoder_layer.mamba``) and the gated delta-nets of
Qwen3-Next (``decoder_layer.linear_attn``), transformers' ``"linear_attention"`` layers.

Where a state lies. One layer's state for one sequence is ``state_bytes`` bytes laid out as
``atb_mem.kv.state_layout`` says: the conv state ``[channels, kernel]`` in the model's dtype
from byte 0, zeros up to the next multiple of 64 bytes, then the SSM / recurrent state in
float32, both C-contiguous. Recurrent layer ``l`` is slot ``s`` of state group ``g``
(``KVCachePool.state_of_layer``); a sequence holds ``k = state_groups[g].num_blocks`` blocks
for the group, columns ``[first_column, first_column + k)`` of ``state_table``, and the
state is the first ``state_bytes`` bytes of ``kv_cache[s][:, blocks]`` (``[2, k, block_size,
heads, head_dim]``) flattened in C order. The rest of those bytes is never read.

How a step runs. :class:`ModelRunner` wraps each mixer's ``forward``; inside the step
(:func:`recurrent_step`) the wrapper splits the step's flattened tokens into rows, because
the mixers' torch paths take one sequence per batch row (they ignore ``cu_seqlens``): a row of
several tokens, or one that starts its sequence, runs alone as ``[1, q, hidden]``; single
tokens that continue a state run together as ``[n, 1, hidden]``. Each call gets a
:class:`RowStates` cache, the part of transformers' ``DynamicCache`` the mixers call, holding
its rows' states gathered from the pool in one index op; afterwards they are scattered back in
one. A row whose first position is 0 starts from zeros, as transformers' cache does, and
never reads its blocks: they hold whatever their last owner left (NaN in the tests). The core
keeps the rest right: it copies a parent's state blocks into a fork's, swaps them with the
sequence, and frees them at its end; a recomputed sequence restarts at position 0.
Outside a step a wrapped mixer runs as transformers wrote it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from atb_mem.integrations.layer_attention import LayerAttention
from atb_mem.kv.state_layout import RecurrentStateLayout, recurrent_state_layout

if TYPE_CHECKING:
    import torch

    from atb_mem.kv.cache_pool import KVCachePool
    from atb_mem.scheduling.continuous import StepPlan

__all__ = ["MIXERS", "RecurrentStates", "RowStates", "model_state_layout", "recurrent_step",
           "state_arguments"]

MIXERS = {"granitemoehybrid": "mamba", "qwen3_next": "linear_attn"}
"""Per model type, the attribute of a decoder layer that holds its recurrent mixer."""

_ORIGINAL_FORWARD = "_atb_mem_original_forward"

_current_step: ContextVar[_StepStates | None] = ContextVar("atb_mem_recurrent_step",
                                                           default=None)


def model_state_layout(model: Any) -> RecurrentStateLayout:
    """The layout of one recurrent layer's state for ``model`` (in its dtype)."""
    text = model.config.get_text_config()
    return recurrent_state_layout(text.to_dict(), str(model.dtype).removeprefix("torch."))


def state_arguments(model: Any, layers: list[LayerAttention],
                    tensor_parallel_size: int = 1) -> dict[str, int]:
    """``{"state_bytes": ...}`` for a model with recurrent layers (the ``kv_cache_groups``
    argument), else nothing."""
    if not any(layer.is_recurrent for layer in layers):
        return {}
    if tensor_parallel_size != 1:  # a rank would keep the state of its share of the heads
        raise NotImplementedError("atb-mem serves recurrent (linear_attention) layers without "
                                  "tensor parallelism")
    return {"state_bytes": model_state_layout(model).state_bytes}


class RowStates:
    """The cache a recurrent mixer calls (``DynamicCache``'s linear-attention methods) for
    one call's ``n`` rows: ``conv`` ``[n, channels, kernel]`` and ``ssm`` ``[n, ...]``.

    Whether the rows continue a state is kept per call rather than read off the conv state:
    Granite updates its conv state before it asks for the recurrent one, which a fresh row
    must still be told it lacks."""

    def __init__(self, conv: torch.Tensor, ssm: torch.Tensor, previous: bool) -> None:
        self.conv = conv
        self.ssm = ssm
        self.conv_previous = previous
        self.ssm_previous = previous

    def has_previous_state(self, layer_idx: int | None = None,
                           state_idx: int | None = None) -> bool:
        return self.conv_previous

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.conv if self.conv_previous else None

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          **kwargs: Any) -> torch.Tensor:
        """Keeps the last ``kernel`` inputs; returns them with the new ones after (as
        transformers' ``LinearAttentionLayer``: a first chunk shorter than the kernel is
        padded with zeros in front)."""
        import torch
        import torch.nn.functional as F

        kernel = self.conv.shape[-1]
        if self.conv_previous:
            full = torch.cat([self.conv, conv_states], dim=-1)
        else:
            full = F.pad(conv_states, (max(0, kernel - conv_states.shape[-1]), 0))
            self.conv_previous = True
        self.conv.copy_(full[..., -kernel:])
        return full

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.ssm if self.ssm_previous else None

    def update_recurrent_state(self, recurrent_states: Any, layer_idx: int, state_idx: int = 0,
                               **kwargs: Any) -> torch.Tensor:
        """A list holds the states after each of the last tokens: the last one is kept."""
        import torch

        last = recurrent_states if isinstance(recurrent_states, torch.Tensor) \
            else recurrent_states[-1]
        self.ssm.copy_(last)
        self.ssm_previous = True
        return self.ssm

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        return 0

    def increase_count(self, layer_idx: int, state_idx: int) -> None:
        """transformers counts tokens here for its own cache's length; positions are the
        plan's."""


@dataclass(frozen=True)
class _MixerRows:
    """Rows of the step one mixer call runs, as ``[count, width, hidden]``."""

    rows: torch.Tensor
    """int64 ``[count]``: the plan's rows (into the step's state table)."""
    tokens: torch.Tensor
    """int64 ``[count × width]``: their step tokens, row by row."""
    count: int
    width: int
    fresh: bool
    """The row starts its sequence (position 0): its state starts from zeros."""


@dataclass(frozen=True)
class _Place:
    """Where a recurrent layer's states lie: ``kv_cache[slot]`` of the blocks in columns
    ``columns`` of the state table."""

    slot: int
    columns: slice


class RecurrentStates:
    """A model's recurrent layers over a ``KVCachePool``'s state blocks; building it wraps
    the model's mixers (once per model: a later runner takes them over)."""

    def __init__(self, model: Any, kv_cache: KVCachePool, layers: list[LayerAttention]) -> None:
        import torch

        self.layout = model_state_layout(model)
        self.kv_cache = kv_cache
        self.places: dict[int, _Place] = {}
        groups = kv_cache.state_groups
        for layer, attention in enumerate(layers):
            if not attention.is_recurrent:
                continue
            group, slot = kv_cache.state_of_layer(layer)
            spec = groups[group]
            if spec.state_bytes < self.layout.state_bytes:
                raise ValueError(f"the KV cache keeps {spec.state_bytes} bytes of state per "
                                 f"recurrent layer; the model needs {self.layout.state_bytes}")
            self.places[layer] = _Place(slot, slice(spec.first_column,
                                                    spec.first_column + spec.num_blocks))
        # Bytes of every plane: [layers_per_block, 2, num_blocks, block_size, heads, D × size].
        self.planes = kv_cache.kv_cache.view(torch.uint8)
        self.conv_dtype = getattr(torch, self.layout.conv_dtype)
        _wrap_mixers(model, sorted(self.places))

    def gather(self, layer: int, rows: _MixerRows, blocks: torch.Tensor) -> RowStates:
        """The rows' states (zeros for fresh rows, whose blocks are not read)."""
        import torch

        layout, count = self.layout, rows.count
        device = self.planes.device
        if rows.fresh:
            return RowStates(torch.zeros((count, *layout.conv_shape), dtype=self.conv_dtype,
                                         device=device),
                             torch.zeros((count, *layout.ssm_shape), dtype=torch.float32,
                                         device=device), previous=False)
        raw = self.planes[self.places[layer].slot][:, blocks].movedim(0, 1).reshape(count, -1)
        conv = raw[:, :layout.conv_bytes].contiguous().view(self.conv_dtype)
        ssm = raw[:, layout.ssm_offset:layout.state_bytes].contiguous().view(torch.float32)
        return RowStates(conv.view(count, *layout.conv_shape),
                         ssm.view(count, *layout.ssm_shape), previous=True)

    def scatter(self, layer: int, states: RowStates, blocks: torch.Tensor) -> None:
        import torch

        layout = self.layout
        plane = self.planes[self.places[layer].slot]          # [2, num_blocks, ...]
        count, width = blocks.shape
        raw = torch.zeros((count, 2, width, *plane.shape[2:]), dtype=torch.uint8,
                          device=plane.device)
        flat = raw.view(count, -1)
        flat[:, :layout.conv_bytes] = states.conv.to(self.conv_dtype).contiguous().view(
            torch.uint8).reshape(count, -1)
        flat[:, layout.ssm_offset:layout.state_bytes] = states.ssm.float().contiguous().view(
            torch.uint8).reshape(count, -1)
        plane[:, blocks] = raw.movedim(1, 0)

    def begin_step(self, plan: StepPlan) -> _StepStates:
        return _StepStates.build(self, plan)


@dataclass(frozen=True)
class _StepStates:
    """One step's rows, as the mixers run them, and their state blocks."""

    states: RecurrentStates
    row_sets: list[_MixerRows]
    table: torch.Tensor
    """int64 ``[rows, num_state_blocks]``: the state blocks of the plan's rows."""
    num_tokens: int

    @classmethod
    def build(cls, states: RecurrentStates, plan: StepPlan) -> _StepStates:
        import torch

        device = states.planes.device
        query_lens = plan.query_lens.astype(np.int64)
        first = plan.seq_lens.astype(np.int64) - query_lens
        starts = plan.query_start_loc.astype(np.int64)

        def tensor(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(device)

        continuing = (query_lens == 1) & (first > 0)
        decodes = np.flatnonzero(continuing)
        row_sets = [_MixerRows(tensor(decodes), tensor(starts[decodes]), len(decodes), 1,
                               fresh=False)] if len(decodes) else []
        for row in np.flatnonzero(~continuing & (query_lens > 0)).tolist():
            tokens = np.arange(starts[row], starts[row] + query_lens[row])
            row_sets.append(_MixerRows(tensor(np.array([row])), tensor(tokens), 1,
                                       int(query_lens[row]), fresh=bool(first[row] == 0)))
        # The plan's rows: its prefills, then its decodes.
        seq_ids = np.concatenate([plan.prefill_seq_ids, plan.decode_seq_ids])
        table = tensor(states.kv_cache.state_table(seq_ids))
        return cls(states, row_sets, table, int(plan.num_batched_tokens))

    def run(self, layer: int, forward: Callable[..., Any], hidden_states: torch.Tensor,
            kwargs: dict[str, Any]) -> torch.Tensor:
        """``hidden_states`` ``[1, T, hidden]``, the step's tokens, through the mixer of
        ``layer`` row set by row set."""
        if hidden_states.shape[0] != 1 or hidden_states.shape[1] != self.num_tokens:
            raise ValueError(f"expected the step's {self.num_tokens} tokens as one batch row, "
                             f"got hidden states of shape {tuple(hidden_states.shape)}")
        place = self.states.places[layer]
        tokens = hidden_states[0]
        out: torch.Tensor | None = None
        for rows in self.row_sets:
            blocks = self.table[rows.rows][:, place.columns]
            states = self.states.gather(layer, rows, blocks)
            mixed = forward(tokens[rows.tokens].view(rows.count, rows.width, -1),
                            cache=states, attention_mask=None, **kwargs)
            if out is None:
                out = mixed.new_empty((self.num_tokens, mixed.shape[-1]))
            out[rows.tokens] = mixed.reshape(-1, mixed.shape[-1])
            self.states.scatter(layer, states, blocks)
        assert out is not None  # a step has tokens, so a row set
        return out[None]


@contextmanager
def recurrent_step(states: RecurrentStates | None, plan: StepPlan) -> Iterator[None]:
    """The wrapped mixers serve ``plan``'s rows while the block runs (nothing without
    recurrent layers)."""
    if states is None:
        yield
        return
    token = _current_step.set(states.begin_step(plan))
    try:
        yield
    finally:
        _current_step.reset(token)


def _serve_step(layer: int, forward: Callable[..., Any], hidden_states: torch.Tensor,
                cache: Any = None, attention_mask: Any = None, **kwargs: Any) -> Any:
    step = _current_step.get()
    if step is None:
        return forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    return step.run(layer, forward, hidden_states, kwargs)


def _wrap_mixers(model: Any, layers: list[int]) -> None:
    """Wraps the mixer of each of ``layers``; refuses a model whose mixers are not found."""
    model_type = model.config.get_text_config().model_type
    attribute = MIXERS.get(model_type)
    if attribute is None:
        raise NotImplementedError(f"atb-mem serves the recurrent layers of "
                                  f"{' and '.join(MIXERS)} models, not of {model_type!r}")
    mixers = {}
    for module in model.modules():
        mixer = getattr(module, attribute, None)
        if mixer is not None and isinstance(getattr(mixer, "layer_idx", None), int):
            mixers[mixer.layer_idx] = mixer
    if sorted(mixers) != layers:
        raise ValueError(f"the config makes layers {layers} recurrent; the model has "
                         f"{attribute!r} mixers in layers {sorted(mixers)}")
    for layer, mixer in mixers.items():
        original = mixer.__dict__.get(_ORIGINAL_FORWARD) or mixer.forward
        setattr(mixer, _ORIGINAL_FORWARD, original)
        mixer.forward = functools.partial(_serve_step, layer, original)

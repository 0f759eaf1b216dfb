"""Which earlier positions each layer of a transformers model attends to, and the KV-cache
groups (``KVCachePool(layer_types=..., sliding_window=..., attention_chunk_size=...)``) that
keep only what those layers will read again. A recurrent layer (``"linear_attention"``: Mamba2,
gated delta-net) attends to nothing: it keeps a state per sequence (``state_bytes``) instead of
K/V (see ``atb_mem.integrations.recurrent_state``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from atb_mem.kv.cache_pool import KVCachePool

__all__ = ["FULL_ATTENTION", "NO_KV_GROUP", "RECURRENT", "LayerAttention", "kv_cache_groups",
           "layer_attention", "layer_groups"]

NO_KV_GROUP = -1
"""The KV-cache group of a recurrent layer in :func:`layer_groups`: it has none."""


@dataclass(frozen=True)
class LayerAttention:
    """Which earlier positions a layer's queries see: all (``"full_attention"``), the last
    ``window`` including their own (``"sliding_attention"``: ``q - window < k``), or those in
    their own chunk of ``window`` positions (``"chunked_attention"``); causal in every case.
    A ``"linear_attention"`` layer attends to none: it carries a recurrent state."""

    kind: str = "full_attention"
    window: int | None = None

    def visible(self, query: np.ndarray, key: np.ndarray) -> np.ndarray:
        """Whether positions ``query`` see positions ``key`` (broadcast)."""
        seen = key <= query
        if self.kind == "sliding_attention":
            seen &= key > query - self.window
        elif self.kind == "chunked_attention":
            seen &= key // self.window == query // self.window
        return np.asarray(seen)

    @property
    def is_full(self) -> bool:
        return self.kind == "full_attention"

    @property
    def unmasked_length(self) -> float:
        """The longest row starting at position 0 that sees as plain causal attention does
        (no mask needed): any for a full layer, the window or chunk for the others."""
        return float("inf") if self.is_full else float(self.window or 0)

    @property
    def is_recurrent(self) -> bool:
        return self.kind == "linear_attention"


FULL_ATTENTION = LayerAttention()
RECURRENT = LayerAttention("linear_attention")


def layer_attention(config: Any) -> list[LayerAttention]:
    """Each layer's attention, read from a transformers config the way its models read it
    (``layer_types`` with ``sliding_window`` / ``attention_chunk_size``, or ``sliding_window``
    for every layer in Mistral-style configs): :func:`atb_mem.kv.model_config.layer_types_of`."""
    from atb_mem.kv.model_config import layer_types_of

    text = config.get_text_config()
    fields = {name: getattr(text, name, None) for name in (
        "num_hidden_layers", "layer_types", "sliding_window", "attention_chunk_size",
        "model_type")}
    fields["use_sliding_window"] = getattr(text, "use_sliding_window", True)
    windows = {"full_attention": None, "sliding_attention": fields["sliding_window"],
               "chunked_attention": fields["attention_chunk_size"], "linear_attention": None}
    return [LayerAttention(kind, windows[kind]) for kind in layer_types_of(fields)]


def kv_cache_groups(layers: list[LayerAttention], state_bytes: int | None = None
                    ) -> dict[str, Any]:
    """The ``KVCachePool`` arguments that group these layers' K/V by kind: none when every
    layer attends fully (one group, today's cache); else ``layer_types`` and the window and
    chunk, which transformers configs give once for all their layers, and for recurrent
    layers ``state_bytes``, the state of one of them for one sequence."""
    if all(layer.is_full for layer in layers):
        return {}
    arguments: dict[str, Any] = {"layer_types": [layer.kind for layer in layers]}
    if any(layer.is_recurrent for layer in layers):
        if state_bytes is None:
            raise ValueError("recurrent (linear_attention) layers need state_bytes: "
                             "atb_mem.kv.state_layout.recurrent_state_layout")
        arguments["state_bytes"] = state_bytes
    for kind, name in (("sliding_attention", "sliding_window"),
                       ("chunked_attention", "attention_chunk_size")):
        windows = {layer.window for layer in layers if layer.kind == kind and layer.window}
        if len(windows) > 1:
            raise ValueError(f"layers have {kind} with different windows {sorted(windows)}: "
                             "one KV-cache group kind per window is not supported")
        if windows:
            arguments[name] = windows.pop()
    return arguments


def layer_groups(layers: list[LayerAttention], kv_cache: KVCachePool) -> list[int]:
    """Each layer's KV-cache group (:data:`NO_KV_GROUP` for a recurrent layer). A cache
    without groups serves any model (windows are applied in attention over blocks kept
    whole); a windowed group must match its layers."""
    groups = kv_cache.groups
    result = []
    for layer, attention in enumerate(layers):
        if attention.is_recurrent:
            try:
                kv_cache.state_of_layer(layer)
            except ValueError as error:
                raise ValueError(f"layer {layer} is recurrent: the KV cache must keep its state "
                                 "(KVCachePool(layer_types=..., state_bytes=...))") from error
            result.append(NO_KV_GROUP)
            continue
        group, _ = kv_cache.group_of_layer(layer)
        kind, window = groups[group].kind, groups[group].window
        if kind != "full_attention" and (kind, window) != (attention.kind, attention.window):
            raise ValueError(f"layer {layer} computes {attention.kind} (window "
                             f"{attention.window}); its KV-cache group keeps {kind} (window "
                             f"{window})")
        result.append(group)
    return result

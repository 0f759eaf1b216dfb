"""What a transformers ``config.json`` says about a model's KV cache, read without transformers:
layers, KV heads, head dim, dtype, each layer's attention (full, sliding window, chunked) or
recurrence (``"linear_attention"``: Mamba2, gated delta-net), and the bytes of a recurrent
layer's state (``atb_mem.kv.state_layout``).

Multimodal configs (Gemma 3, Llama 4, ...) keep the language model's figures under
``text_config``; that is what is read. Field names are transformers' own.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from atb_mem._core import KV_DTYPES
from atb_mem.kv.state_layout import recurrent_state_layout

__all__ = ["LAYER_TYPES", "ModelKVConfig", "layer_types_of", "read_model_config"]

LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "linear_attention")

# transformers' _LEGACY_LAYER_TYPE_REMAP: older configs name layers so (Granite 4.0-H's).
_LEGACY_LAYER_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}

_DTYPE_NAMES = {"float16": "float16", "half": "float16", "bfloat16": "bfloat16",
                "float32": "float32", "float": "float32"}


@dataclass(frozen=True)
class ModelKVConfig:
    """The KV-cache dimensions of a model; ``layer_types`` holds one of :data:`LAYER_TYPES`
    per layer, ``sliding_window`` / ``attention_chunk_size`` the window of those layers,
    ``state_bytes`` the state of each ``"linear_attention"`` layer for one sequence."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    layer_types: tuple[str, ...]
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    state_bytes: int | None = None

    def group_arguments(self) -> dict[str, Any]:
        """The ``KVCachePool`` / ``plan_kv_cache`` arguments that group this model's layers
        by attention kind; none when every layer attends fully."""
        if set(self.layer_types) == {"full_attention"}:
            return {}
        arguments: dict[str, Any] = {"layer_types": list(self.layer_types),
                                     "sliding_window": self.sliding_window,
                                     "attention_chunk_size": self.attention_chunk_size}
        if self.state_bytes is not None:
            arguments["state_bytes"] = self.state_bytes
        return arguments

    def window_of(self, layer: int) -> int | None:
        """Tokens a query of ``layer`` sees (sliding) or its chunk (chunked); None: all."""
        kind = self.layer_types[layer]
        if kind == "sliding_attention":
            return self.sliding_window
        if kind == "chunked_attention":
            return self.attention_chunk_size
        return None


def _positive(config: Mapping[str, Any], name: str) -> int | None:
    value = config.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"the model config's {name} must be a positive int, got {value!r}")
    return value


def layer_types_of(config: Mapping[str, Any]) -> list[str]:
    """Each layer's attention, as transformers' models read it: ``layer_types`` (Granite
    4.0-H's older ``layers_block_type``; legacy names ``"mamba"`` and ``"attention"`` renamed),
    or (configs without it) what the model's config class fills in: Mistral's
    ``sliding_window`` for every layer unless ``use_sliding_window`` is false, Granite 4.0-H's
    recurrent layers, Qwen3-Next's full attention every ``full_attention_interval`` layers.
    Validates the names and that windows are given."""
    count = _positive(config, "num_hidden_layers")
    if count is None:
        raise ValueError("the model config has no num_hidden_layers")
    types = config.get("layer_types")
    if types is None:
        types = config.get("layers_block_type")
    if types is None:
        types = _default_layer_types(config, count)
    if not isinstance(types, list) or len(types) != count:
        raise ValueError(f"the model config's layer_types must list {count} layer types, "
                         f"got {types!r}")
    types = [_LEGACY_LAYER_TYPES.get(kind, kind) for kind in types]
    for kind in types:
        if kind not in LAYER_TYPES:
            raise ValueError(f"layer type {kind!r} is not one of {list(LAYER_TYPES)}")
    for kind, field in (("sliding_attention", "sliding_window"),
                        ("chunked_attention", "attention_chunk_size")):
        if kind in types and _positive(config, field) is None:
            raise ValueError(f"{kind} layers need {field} in the model config")
    return list(types)


def _default_layer_types(config: Mapping[str, Any], count: int) -> list[str]:
    model_type = config.get("model_type")
    if model_type == "granitemoehybrid":
        return ["linear_attention"] * count
    if model_type == "qwen3_next":
        interval = _positive(config, "full_attention_interval") or 4
        return ["full_attention" if (layer + 1) % interval == 0 else "linear_attention"
                for layer in range(count)]
    sliding = _positive(config, "sliding_window") and config.get("use_sliding_window", True)
    return ["sliding_attention" if sliding else "full_attention"] * count


def read_model_config(path: str | Path) -> ModelKVConfig:
    """Reads ``path`` (a ``config.json``, or a checkpoint directory holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read the model config {str(path)!r}: {error}") from error
    if not isinstance(config, dict):
        raise ValueError(f"{str(path)!r} does not hold a JSON object")
    text = config.get("text_config")
    if isinstance(text, dict):
        config = {**text, "dtype": text.get("dtype") or config.get("dtype")
                  or config.get("torch_dtype")}
    types = layer_types_of(config)
    heads = _positive(config, "num_attention_heads")
    hidden = _positive(config, "hidden_size")
    if heads is None:
        raise ValueError("the model config has no num_attention_heads")
    head_dim = _positive(config, "head_dim")
    if head_dim is None:
        if hidden is None or hidden % heads:
            raise ValueError("the model config has no head_dim, and hidden_size is not a "
                             "multiple of num_attention_heads")
        head_dim = hidden // heads
    dtype_name = config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = _DTYPE_NAMES.get(str(dtype_name).removeprefix("torch."))
    if dtype is None or dtype not in KV_DTYPES:
        raise ValueError(f"the model's dtype {dtype_name!r} is not one of {sorted(KV_DTYPES)}")
    state_bytes = None
    if "linear_attention" in types:
        try:
            state_bytes = recurrent_state_layout(config, dtype).state_bytes
        except NotImplementedError as error:
            raise ValueError(str(error)) from None
    return ModelKVConfig(num_layers=len(types),
                         num_kv_heads=_positive(config, "num_key_value_heads") or heads,
                         head_dim=head_dim, dtype=dtype, layer_types=tuple(types),
                         sliding_window=_positive(config, "sliding_window")
                         if "sliding_attention" in types else None,
                         attention_chunk_size=_positive(config, "attention_chunk_size")
                         if "chunked_attention" in types else None,
                         state_bytes=state_bytes)

"""The bytes one recurrent layer keeps per sequence (``KVCachePool(state_bytes=...)``), read
from a model's config: transformers' ``"linear_attention"`` layers, the Mamba2 mixers of IBM
Granite 4.0-H (``granitemoehybrid``) and the gated delta-nets of Qwen3-Next (``qwen3_next``).

Such a layer carries two states from one token to the next, whatever the sequence's length: a
causal convolution's last ``kernel`` inputs and the recurrence's (SSM) state. Within the
``state_bytes`` of one layer and one sequence:

- bytes ``[0, conv_bytes)``: the conv state ``[channels, kernel]`` in the model's dtype,
  C-contiguous (the oldest input first, as transformers' caches keep it);
- zeros up to ``ssm_offset``, the next multiple of :data:`STATE_ALIGNMENT` bytes, so the
  float32 state starts aligned for any kernel that reads it in place;
- bytes ``[ssm_offset, state_bytes)``: the SSM / recurrent state in float32, C-contiguous.

The shapes, as transformers' models build them:

- Granite 4.0-H: conv ``[mamba_expand × hidden_size + 2 × mamba_n_groups × mamba_d_state,
  mamba_d_conv]``, SSM ``[mamba_n_heads, mamba_d_head, mamba_d_state]``;
- Qwen3-Next: conv ``[2 × linear_num_key_heads × linear_key_head_dim + linear_num_value_heads
  × linear_value_head_dim, linear_conv_kernel_dim]``, recurrent ``[linear_num_value_heads,
  linear_key_head_dim, linear_value_head_dim]``.

Nothing here needs torch: the config is a ``config.json`` dict or a transformers config's
``to_dict()``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["RECURRENT_MODEL_TYPES", "STATE_ALIGNMENT", "RecurrentStateLayout",
           "recurrent_state_layout"]

STATE_ALIGNMENT = 64

RECURRENT_MODEL_TYPES = ("granitemoehybrid", "qwen3_next")

_ITEMSIZES = {"float32": 4, "float16": 2, "bfloat16": 2}

# transformers' defaults for the fields a config.json may leave out.
_GRANITE_DEFAULTS = {"mamba_n_heads": 128, "mamba_n_groups": 1, "mamba_d_state": 256,
                     "mamba_d_conv": 4, "mamba_expand": 2}
_QWEN3_NEXT_DEFAULTS = {"linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
                        "linear_value_head_dim": 128, "linear_num_key_heads": 16,
                        "linear_num_value_heads": 32}


@dataclass(frozen=True)
class RecurrentStateLayout:
    """Where one recurrent layer's states lie in its ``state_bytes`` (see the module)."""

    conv_shape: tuple[int, int]
    conv_dtype: str
    """The model's dtype, by ``KV_DTYPES`` name."""
    ssm_shape: tuple[int, ...]

    @property
    def conv_bytes(self) -> int:
        return math.prod(self.conv_shape) * _ITEMSIZES[self.conv_dtype]

    @property
    def ssm_offset(self) -> int:
        return -(-self.conv_bytes // STATE_ALIGNMENT) * STATE_ALIGNMENT

    @property
    def ssm_bytes(self) -> int:
        return math.prod(self.ssm_shape) * 4

    @property
    def state_bytes(self) -> int:
        return self.ssm_offset + self.ssm_bytes


def _dimensions(config: Mapping[str, Any], names: tuple[str, ...],
                defaults: Mapping[str, Any]) -> list[int]:
    """The config's ``names``, transformers' defaults where it leaves them out."""
    values = []
    for name in names:
        value = config.get(name)
        value = defaults.get(name) if value is None else value
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"the model config's {name} must be a positive int, got {value!r}")
        values.append(value)
    return values


def recurrent_state_layout(config: Mapping[str, Any], dtype: str) -> RecurrentStateLayout:
    """The layout of one recurrent layer's state for a model of this config computing in
    ``dtype``. Refuses (``NotImplementedError``) a model type whose recurrent layers atb-mem
    does not serve: another mixer keeps other states."""
    if dtype not in _ITEMSIZES:
        raise ValueError(f"recurrent states are kept in the model's dtype, one of "
                         f"{sorted(_ITEMSIZES)}; got {dtype!r}")
    model_type = config.get("model_type")
    if model_type == "granitemoehybrid":
        hidden, expand, heads, groups, state, kernel = _dimensions(config, (
            "hidden_size", "mamba_expand", "mamba_n_heads", "mamba_n_groups", "mamba_d_state",
            "mamba_d_conv"), _GRANITE_DEFAULTS)
        # "auto" (transformers' default): the heads split the expanded width.
        head_dim, = _dimensions({**config, "mamba_d_head": None}
                                if config.get("mamba_d_head") == "auto" else config,
                                ("mamba_d_head",), {"mamba_d_head": expand * hidden // heads})
        return RecurrentStateLayout((expand * hidden + 2 * groups * state, kernel), dtype,
                                    (heads, head_dim, state))
    if model_type == "qwen3_next":
        key_heads, value_heads, key_dim, value_dim, kernel = _dimensions(config, (
            "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
            "linear_value_head_dim", "linear_conv_kernel_dim"), _QWEN3_NEXT_DEFAULTS)
        return RecurrentStateLayout((2 * key_heads * key_dim + value_heads * value_dim, kernel),
                                    dtype, (value_heads, key_dim, value_dim))
    raise NotImplementedError(f"atb-mem serves the recurrent (linear_attention) layers of "
                              f"{' and '.join(RECURRENT_MODEL_TYPES)} models, not of "
                              f"model_type {model_type!r}")

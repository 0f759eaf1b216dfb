"""Reading a transformers config.json for the KV cache's dimensions and layer types, against
transformers' own configs where it is installed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from atb_mem.kv.model_config import read_model_config

GEMMA3_LIKE = {"architectures": ["Gemma3ForConditionalGeneration"], "torch_dtype": "bfloat16",
               "text_config": {"num_hidden_layers": 6, "num_attention_heads": 8,
                               "num_key_value_heads": 4, "head_dim": 256, "hidden_size": 1152,
                               "sliding_window": 512, "layer_types": ["sliding_attention"] * 5
                               + ["full_attention"]}}


def write(tmp_path: Path, config: dict[str, Any]) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_a_multimodal_config_is_read_from_its_text_config(tmp_path: Path) -> None:
    model = read_model_config(write(tmp_path, GEMMA3_LIKE))
    assert (model.num_layers, model.num_kv_heads, model.head_dim, model.dtype) == (6, 4, 256,
                                                                                 "bfloat16")
    assert model.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert [model.window_of(layer) for layer in range(6)] == [512] * 5 + [None]
    assert read_model_config(tmp_path) == model  # the checkpoint directory works too


def test_defaults_follow_transformers(tmp_path: Path) -> None:
    """No head_dim: hidden / heads; no KV heads: the heads; no layer_types: a sliding window
    for every layer (Mistral) unless use_sliding_window is false (Qwen2)."""
    base = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64,
            "dtype": "float16"}
    mistral = read_model_config(write(tmp_path, {**base, "sliding_window": 32}))
    assert (mistral.head_dim, mistral.num_kv_heads) == (16, 4)
    assert mistral.layer_types == ("sliding_attention",) * 2 and mistral.sliding_window == 32
    qwen = read_model_config(write(tmp_path, {**base, "sliding_window": 32,
                                              "use_sliding_window": False}))
    assert qwen.layer_types == ("full_attention",) * 2 and qwen.sliding_window is None


@pytest.mark.parametrize(("change", "fragment"), [
    ({"layer_types": ["full_attention"]}, "must list 2"),
    ({"layer_types": ["full_attention", "cross_attention"]}, "'cross_attention'"),
    ({"layer_types": ["full_attention", "linear_attention"]}, "not of model_type None"),
    ({"layer_types": ["full_attention", "chunked_attention"]}, "attention_chunk_size"),
    ({"num_attention_heads": 0}, "positive int"),
    ({"hidden_size": 65}, "head_dim"),
    ({"dtype": "float8_e4m3fn"}, "dtype"),
])
def test_bad_configs_are_refused(tmp_path: Path, change: dict[str, Any], fragment: str) -> None:
    base = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}
    with pytest.raises(ValueError, match=fragment):
        read_model_config(write(tmp_path, {**base, **change}))


def test_unreadable_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        read_model_config(tmp_path / "missing.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        read_model_config(tmp_path)


@pytest.mark.parametrize("architecture", ["mistral", "gemma3", "gpt_oss", "llama4"])
def test_saved_transformers_configs_read_as_the_runner_reads_them(tmp_path: Path,
                                                                  architecture: str) -> None:
    from atb_mem.integrations.transformers import layer_attention
    from tests.support.models import tiny_model

    model = tiny_model(architecture)
    model.config.save_pretrained(tmp_path)
    read = read_model_config(tmp_path)
    assert [(kind, read.window_of(layer)) for layer, kind in enumerate(read.layer_types)] == \
        [(layer.kind, layer.window) for layer in layer_attention(model.config)]
    text = model.config.get_text_config()
    assert read.num_layers == text.num_hidden_layers
    assert read.num_kv_heads == text.num_key_value_heads
    assert read.dtype == "float32"

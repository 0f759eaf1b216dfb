"""What names a vLLM server's KV blocks in the tiers: the weights (a digest of a local
checkpoint's files, or the hub name and revision), the model's config, and the layout of the
bytes (dtype, block size, heads, backend, device, parallelism). Two servers share blocks
only where all of it is the same: their K/V bytes would be."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from atb_mem.kv.tiers import layout_identity

__all__ = ["kv_layout", "model_config_hash", "tensor_parallel_ranks", "weights_identity"]

_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth")


def weights_identity(model: str, revision: str | None) -> str:
    """What names the weights: a digest of a local checkpoint's weight files (so two
    checkpoints share blocks only when their bytes are the same), else the hub name and
    revision."""
    folder = Path(model)
    if not folder.is_dir():
        return f"{model}@{revision or 'main'}"
    import numpy as np

    from atb_mem._core import content_digests

    files = sorted(path for path in folder.iterdir() if path.suffix in _WEIGHT_FILES)
    if not files:
        raise ValueError(f"{model!r} holds no weight files to name its KV blocks by: set "
                         f"kv_connector_extra_config['kv_identity']")
    buffers = [np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size
               else np.zeros(0, np.uint8) for path in files]
    digest = hashlib.sha256()
    for path, piece in zip(files, content_digests(buffers), strict=True):
        digest.update(path.name.encode() + b"\0" + piece)
    return digest.hexdigest()


def model_config_hash(model_config: Any) -> str:
    """A digest of what changes a model's K/V beside its weights: its config (overrides
    applied) and its quantization, but not where it was loaded from, nor serving settings
    such as ``max_model_len`` (vLLM's own ``compute_hash`` has those: two servers of one
    model with different limits would share nothing)."""
    config = dict(model_config.hf_config.to_dict())
    for name in ("_name_or_path", "transformers_version", "_commit_hash"):
        config.pop(name, None)
    parts = (json.dumps(config, sort_keys=True, default=str),
             str(getattr(model_config, "quantization", None)))
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


# The attention caches whose blocks hold whole tokens' K/V, full or windowed: a block moves
# whole whatever its group keeps of it (vLLM frees a window's old blocks itself).
_ATTENTION_SPECS = ("FullAttentionSpec", "SlidingWindowSpec", "ChunkedLocalAttentionSpec")


def kv_layout(vllm_config: Any, kv_cache_config: Any, weights: str
              ) -> tuple[str, int, int, int]:
    """(layout identity, vLLM block size, bytes of a block across one rank's layers, KV-cache
    groups). With vLLM's hybrid manager a model's layers form groups (full attention, sliding
    windows), each with its own block ids; the layer caches are shared across groups, layer
    ``i`` of every group in cache ``i``, so a block of a group is that block of every cache,
    and the tiers keep one row per group for each block of a request."""
    groups = kv_cache_config.kv_cache_groups
    specs = [group.kv_cache_spec for group in groups]
    kinds = [type(spec).__name__ for spec in specs]
    if not groups or any(kind not in _ATTENTION_SPECS for kind in kinds):
        raise ValueError(f"AtbMemConnector serves attention layers (full, sliding-window or "
                         f"chunked); this model's KV-cache groups are {kinds}")
    if len({(spec.block_size, spec.page_size_bytes) for spec in specs}) != 1:
        raise ValueError(f"AtbMemConnector needs every KV-cache group's blocks alike; this "
                         f"model's are {[(s.block_size, s.page_size_bytes) for s in specs]}")
    spec = specs[0]
    caches = max(len(group.layer_names) for group in groups)
    parallel = vllm_config.parallel_config
    attention = getattr(vllm_config, "attention_config", None)
    windows = [getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size",
                                                                None) for spec in specs]
    identity = layout_identity(
        weights=weights, model_config=model_config_hash(vllm_config.model_config),
        dtype=str(spec.dtype), block_size=spec.block_size,
        kv_heads=spec.num_kv_heads, head_size=spec.head_size, layers=caches,
        spec=type(spec).__name__ if len(groups) == 1 else
        repr([(kind, window, len(group.layer_names))
              for kind, window, group in zip(kinds, windows, groups, strict=True)]),
        layout=getattr(kv_cache_config, "kv_cache_layout", None),
        backend=str(getattr(attention, "backend", None)),
        device=vllm_config.device_config.device_type,
        tensor_parallel=parallel.tensor_parallel_size)
    return identity, spec.block_size, spec.page_size_bytes * caches * len(groups), len(groups)


def tensor_parallel_ranks(vllm_config: Any) -> int:
    """The tensor-parallel ranks; pipeline stages would write different layers under one
    key, so they are refused."""
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise ValueError(f"AtbMemConnector does not support pipeline parallelism "
                         f"(pipeline_parallel_size={parallel.pipeline_parallel_size})")
    return int(parallel.tensor_parallel_size)

"""The KV cache a model needs: its shape (layers, heads, dtype, and the KV-cache groups its
sliding-window or chunked layers form), how many blocks fit the memory it may take, and the
host tier that ``kv_offload`` asks for."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from atb_mem._sizes import parse_size
from atb_mem._types import KVCacheDtype
from atb_mem.integrations.layer_attention import kv_cache_groups as groups_for_layers
from atb_mem.integrations.recurrent_state import state_arguments
from atb_mem.integrations.transformers import kv_cache_layout, supported_layers
from atb_mem.kv.planning import block_bytes, block_layout, plan_kv_cache

__all__ = ["OFFLOAD_TIERS", "host_tier", "kv_cache_shape", "lower_tiers", "num_kv_blocks",
           "tier_connector"]

# The tiers ``kv_offload`` names.
OFFLOAD_TIERS = ("host", "disk")

# Without num_blocks on the host, the cache takes at most this much (vLLM's CPU default).
HOST_KV_BUDGET = 4 << 30


def kv_cache_shape(model: Any, tensor_parallel_size: int = 1,
                   kv_cache_dtype: KVCacheDtype = "auto") -> dict[str, Any]:
    """``KVCachePool`` arguments for ``model``: ``num_layers``, ``num_kv_heads``, ``head_dim``,
    ``dtype``, and for a hybrid model ``layer_types`` with its window or chunk, or the
    ``state_bytes`` of its recurrent layers; a quantized ``kv_cache_dtype`` (so that the tiers'
    layout identity names it too)."""
    layers = supported_layers(model)
    quantized = {} if kv_cache_dtype == "auto" else {"kv_cache_dtype": kv_cache_dtype}
    return {**kv_cache_layout(model, tensor_parallel_size), **quantized,
            **groups_for_layers(layers, **state_arguments(model, layers, tensor_parallel_size))}


def num_kv_blocks(model: Any, shape: dict[str, Any], block_size: int, max_num_seqs: int,
                  max_model_len: int, gpu_memory_utilization: float,
                  kv_cache_memory_bytes: int | None) -> int:
    """Blocks for the cache: ``kv_cache_memory_bytes`` worth; on an accelerator what
    ``plan_kv_cache`` leaves of its memory; on the host what ``max_num_seqs`` sequences of
    ``max_model_len`` tokens take, at most ``HOST_KV_BUDGET``. A block holds
    ``layers_per_block`` layers, so a hybrid model's blocks are smaller and more of them fit."""
    bytes_per_block, groups, state_blocks = block_layout(block_size, **shape)
    if kv_cache_memory_bytes is not None:
        return int(kv_cache_memory_bytes) // bytes_per_block
    if model.device.type != "cpu":
        from atb_mem.kv.cache_pool import device_memory

        free, total = device_memory(str(model.device))
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        plan = plan_kv_cache(total, weights, gpu_memory_utilization=gpu_memory_utilization,
                             block_size=block_size, max_model_len=max_model_len, **shape)
        return min(plan.num_blocks, free // bytes_per_block)
    # Each group holds a block per block_size tokens of an admitted sequence, beside its
    # states' blocks.
    wanted = max_num_seqs * (math.ceil(max_model_len / block_size) * len(groups)
                             + state_blocks) + 1
    return min(wanted, HOST_KV_BUDGET // bytes_per_block)


def host_tier(kv_offload: Mapping[str, Any] | None, num_host_blocks: int | None,
              block_size: int, shape: dict[str, Any], enable_prefix_caching: bool
              ) -> dict[str, Any]:
    """The ``KVCachePool`` arguments of the host tier: ``num_host_blocks`` for swapping alone,
    or ``kv_offload={"host": SIZE}``, a host tier of that many bytes that also keeps the
    prefix blocks the device evicts (``host_prefix_cache``)."""
    if kv_offload is None:
        return {"num_host_blocks": num_host_blocks}
    if not isinstance(kv_offload, Mapping):
        raise TypeError(f"kv_offload must be a dict like {{'host': '8GiB'}}, got "
                        f"{type(kv_offload).__name__}")
    unknown = sorted(set(kv_offload) - set(OFFLOAD_TIERS))
    if unknown:
        raise ValueError(f"kv_offload names unknown tiers {unknown}; known: "
                         f"{list(OFFLOAD_TIERS)}")
    if "host" not in kv_offload:
        if not enable_prefix_caching:
            raise ValueError("kv_offload keeps prefix blocks: it needs prefix caching")
        return {"num_host_blocks": num_host_blocks}
    if num_host_blocks is not None:
        raise ValueError("give the host tier once: num_host_blocks or kv_offload['host']")
    if not enable_prefix_caching:
        raise ValueError("kv_offload keeps evicted prefix blocks: it needs prefix caching")
    size = parse_size(kv_offload["host"])
    bytes_per_block, _ = block_bytes(block_size, **shape)
    blocks = size // bytes_per_block
    if blocks < 1:
        raise ValueError(f"kv_offload host={kv_offload['host']!r} holds no block of "
                         f"{bytes_per_block} bytes")
    from atb_mem.kv.cache_pool import device_memory

    _, memory = device_memory("host")
    if size > memory:  # it is reserved whole at start-up
        raise ValueError(f"kv_offload host={kv_offload['host']!r} ({size} bytes) is more "
                         f"than this machine's memory ({memory} bytes)")
    return {"num_host_blocks": blocks, "host_prefix_cache": True}


def lower_tiers(kv_offload: Mapping[str, Any] | None, kv_store: str | None) -> list[Any]:
    """The stores below the host: the disk tier of ``kv_offload["disk"]`` (``(PATH, SIZE)``
    or ``"PATH:SIZE"``), then the shared store of the ``kv_store`` URL."""
    from atb_mem.kv.tiers import DiskStore, open_store

    stores: list[Any] = []
    disk = (kv_offload or {}).get("disk")
    if disk is not None:
        if isinstance(disk, str):
            path, colon, size = disk.rpartition(":")
            if not colon or not path:
                raise ValueError(f"kv_offload disk={disk!r} is not PATH:SIZE")
            disk = (path, size)
        if not isinstance(disk, (tuple, list)) or len(disk) != 2:
            raise ValueError(f"kv_offload disk must be (PATH, SIZE), got {disk!r}")
        stores.append(DiskStore(disk[0], parse_size(disk[1])))
    if kv_store is not None:
        stores.append(open_store(kv_store))
    return stores


def tier_connector(kv_cache: Any, model: Any, kv_offload: Mapping[str, Any] | None,
                   kv_store: str | None, shape: dict[str, Any],
                   tensor_parallel_size: int, kv_identity: object = None) -> Any:
    """The connector to the tiers below the host (None without any). Their blocks are keyed
    by the model (a digest of every byte of its weights, or the ``kv_identity`` its user
    names it by, and its config), the cache's layout and the rank's share of the heads, so
    engines share a block only when its bytes would be the same."""
    import json
    import os

    from atb_mem.kv.tiers import TierConnector, layout_identity
    from atb_mem.serving.model_identity import checked_kv_identity, weights_digest

    kv_identity = checked_kv_identity(kv_identity)
    below = (kv_offload or {}).get("disk") is not None or kv_store is not None
    if not below:
        return None
    if any(group.kind != "full_attention" for group in kv_cache.groups) \
            or kv_cache.num_state_blocks:
        raise ValueError("the disk tier and kv_store serve models whose layers are all "
                         "full-attention; this one has sliding-window, chunked or recurrent "
                         "layers (a recurrent layer's prefix resumes from a state checkpoint, "
                         "which only the device keeps)")
    if tensor_parallel_size != 1:  # the workers would not load their shards
        raise ValueError("the disk tier and kv_store serve engines without tensor parallelism")
    stores = lower_tiers(kv_offload, kv_store)
    # Where the checkpoint was loaded from says nothing of its bytes: engines that loaded
    # the same weights from different paths share blocks.
    config = {key: value for key, value in model.config.to_dict().items()
              if key != "_name_or_path"}
    weights = f"named:{kv_identity}" if kv_identity is not None else weights_digest(model)
    identity = layout_identity(
        config=json.dumps(config, sort_keys=True, default=str), weights=weights,
        block_size=kv_cache.block_size, shape=repr(sorted(shape.items())),
        rank=os.environ.get("RANK", "0"))
    return TierConnector(kv_cache, stores, identity)

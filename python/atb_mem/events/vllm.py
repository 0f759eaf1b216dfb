"""vLLM's KV-event wire format, which llm-d's KV-cache indexer and Dynamo's ZMQ listener read.

msgpack (via msgspec) of array-like structs: a batch ``[ts, events, data_parallel_rank,
schema_version]`` whose events are tagged ``["BlockStored", block_hashes, parent_block_hash,
token_ids, block_size, lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
kv_cache_spec_sliding_window]``, ``["BlockRemoved", block_hashes, medium, group_idx]`` or
``["AllBlocksCleared"]``, in vLLM's field order (nil group fields from a pool of one group;
``lora_id``, ``lora_name`` and ``extra_keys`` always nil). ``schema_version`` is ours, appended
where vLLM's decoder ignores extra trailing fields: a change to this format bumps it, and the
golden-bytes tests make that change deliberate. Media are vLLM's names: the device tier is
``"GPU"``, the host tier ``"CPU"``, the disk tier ``"DISK"`` and a shared store ``"STORE"``;
group kinds are vLLM's ``KVCacheSpecKind`` values.

Versions: 1 ended stores at ``medium``; 2 adds ``lora_name`` (which vLLM's decoder now
requires) and the group fields.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from atb_mem.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

__all__ = ["SCHEMA_VERSION", "encode_batch"]

SCHEMA_VERSION = 2

_MEDIUM = {"device": "GPU", "host": "CPU", "disk": "DISK", "store": "STORE"}
_SPEC_KIND = {"full_attention": "full_attention", "sliding_attention": "sliding_window",
              "chunked_attention": "chunked_local_attention"}


class _BlockStored(msgspec.Struct, array_like=True, omit_defaults=True, gc=False,
                   tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _BlockRemoved(msgspec.Struct, array_like=True, omit_defaults=True, gc=False,
                    tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class _AllBlocksCleared(msgspec.Struct, array_like=True, omit_defaults=True, gc=False,
                        tag="AllBlocksCleared"):
    pass


class _EventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_BlockStored | _BlockRemoved | _AllBlocksCleared]
    data_parallel_rank: int | None
    schema_version: int


_encoder = msgspec.msgpack.Encoder()


def _wire(event: KVCacheEvent) -> _BlockStored | _BlockRemoved | _AllBlocksCleared:
    if isinstance(event, BlockStored):
        group = event.kv_cache_group
        return _BlockStored(
            np.asarray(event.block_hashes).tolist(), event.parent_block_hash,
            np.asarray(event.token_ids).tolist(), event.block_size, None,
            _MEDIUM[event.medium], None, None, event.group,
            None if group is None else _SPEC_KIND[group.kind],
            group.window if group is not None and group.kind == "sliding_attention" else None)
    if isinstance(event, BlockRemoved):
        return _BlockRemoved(np.asarray(event.block_hashes).tolist(), _MEDIUM[event.medium],
                             event.group)
    if isinstance(event, AllBlocksCleared):
        return _AllBlocksCleared()
    raise TypeError(f"not a KV-cache event: {event!r}")


def encode_batch(events: Sequence[KVCacheEvent], *, timestamp: float | None = None,
                 data_parallel_rank: int | None = None) -> bytes:
    """One batch of events as the payload of a ZMQ message."""
    batch = _EventBatch(time.time() if timestamp is None else timestamp,
                        [_wire(event) for event in events], data_parallel_rank,
                        SCHEMA_VERSION)
    return _encoder.encode(batch)

"""NVIDIA Dynamo's own KV-event format, which its ``RadixTree`` indexer applies.

One JSON object per event: ``{"event_id": N, "data": {"stored": {"parent_hash": H | null,
"blocks": [{"block_hash": H, "tokens_hash": T}, ...]}}}``, ``{"removed": {"block_hashes":
[...]}}`` or ``"cleared"``. ``tokens_hash`` is what Dynamo's router computes for a request's
blocks (``dynamo._core.compute_block_hash_for_seq``): xxh3-64 with seed 1337 over the block's
token ids as little-endian uint32, so the router matches requests against our blocks by
their tokens while our ``block_hash`` keeps their identity for removals.

Dynamo's tree holds one tier: only device-medium events are translated; the host tier's
copies are not blocks a request can hit on this engine until they are swapped back in (and
then stored again as device blocks). It holds one KV-cache group too: from a pool of several,
only the events of ``group`` are translated — :func:`router_group`, the first full-attention
group, whose cached prefix bounds what the engine can serve (a hit also needs the windowed
groups' blocks at its end, which the engine's own lookup checks).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np
import xxhash

from atb_mem._types import KVCacheGroup
from atb_mem.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

__all__ = ["TOKENS_HASH_SEED", "encode_event", "router_group", "tokens_hashes"]

TOKENS_HASH_SEED = 1337


def tokens_hashes(token_ids: Sequence[int] | np.ndarray, block_size: int) -> list[int]:
    """Dynamo's hash of every full block of ``token_ids``."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    ids = np.asarray(token_ids, dtype="<u4")
    return [xxhash.xxh3_64_intdigest(ids[start:start + block_size].tobytes(),
                                     seed=TOKENS_HASH_SEED)
            for start in range(0, len(ids) - block_size + 1, block_size)]


def router_group(groups: Sequence[KVCacheGroup]) -> int:
    """The group whose events a one-group router follows: the first full-attention one (the
    first group when every layer is windowed)."""
    return next((index for index, group in enumerate(groups)
                 if group.kind == "full_attention"), 0)


def encode_event(event: KVCacheEvent, group: int = 0) -> bytes | None:
    """The event as ``RadixTree.apply_event`` reads it; None for a host-tier event, or one of
    another KV-cache group than ``group`` (see :func:`router_group`)."""
    data: object
    if getattr(event, "group", None) not in (None, group):
        return None
    if isinstance(event, BlockStored):
        if event.medium != "device":
            return None
        hashes = tokens_hashes(event.token_ids, event.block_size)
        blocks = np.asarray(event.block_hashes).tolist()
        data = {"stored": {"parent_hash": event.parent_block_hash, "blocks": [
            {"block_hash": block, "tokens_hash": tokens}
            for block, tokens in zip(blocks, hashes, strict=True)]}}
    elif isinstance(event, BlockRemoved):
        if event.medium != "device":
            return None
        data = {"removed": {"block_hashes": np.asarray(event.block_hashes).tolist()}}
    elif isinstance(event, AllBlocksCleared):
        data = "cleared"
    else:
        raise TypeError(f"not a KV-cache event: {event!r}")
    return json.dumps({"event_id": event.event_id, "data": data},
                      separators=(",", ":")).encode()

"""KV-cache events: what a KV-aware router (NVIDIA Dynamo's, llm-d's) replays to know which
blocks an engine holds.

A ``KVCachePool(..., enable_kv_events=True)`` records, in its core, every change of prefix-cache
membership: ``BlockStored`` when computed blocks join the cache (a chain of block hashes with
the hash of the block before them, and their token ids), ``BlockRemoved`` when blocks are
evicted or forgotten, ``AllBlocksCleared`` when a reset leaves nothing cached. ``medium`` says
where: ``"device"``; ``"host"`` for the copies a swap-out makes and the host prefix tier
keeps; ``"disk"`` and ``"store"`` for the tiers below the host, whose connector records
what it writes there (a shared store's own evictions are not seen). ``pool.take_events()``
drains them in order; ``event_id`` increases by one per event over the pool's life, so a gap
means a lost event.

A drain is a ``KVEventList``: one object over one buffer, whose events are typed when first
read — by a publisher, on its own thread (``ZmqEventPublisher`` queues the list as it is), so
draining every step costs the engine's thread little. Events are named tuples. Block hashes are the
first 64 bits of the core's 128-bit chained hash (a router keys blocks
by 64-bit integers); ``cache_salt_hash`` names the chain's root (0 without a cache salt).

A pool with several KV-cache groups (``layer_types``) reports each group's blocks apart:
``group`` is the group's index (None in a pool of one group) and a store carries the group's
``KVCacheGroup`` (kind, layers, window), as vLLM's ``group_idx`` and ``kv_cache_spec_kind``
do. The same tokens have the same hash in every group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple, Protocol, TypeAlias

import numpy as np

from atb_mem._core import KVEventList
from atb_mem._types import KVCacheGroup

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "KVCacheEvent", "KVEventList",
           "KVEventPublisher", "Medium", "events_from_buffer"]

Sequence.register(KVEventList)  # a list in all but storage: publishers may check for one

Medium: TypeAlias = Literal["device", "host", "disk", "store"]


class BlockStored(NamedTuple):
    """Blocks that joined the cache: ``block_hashes[i]`` holds
    ``token_ids[i * block_size:(i + 1) * block_size]``, child of ``block_hashes[i - 1]`` (of
    ``parent_block_hash`` for the first; None when it starts its sequence). The arrays
    (uint64 hashes, uint32 ids) are views of the drain's own buffers: the pool keeps no
    reference to them."""

    event_id: int
    block_hashes: np.ndarray
    parent_block_hash: int | None
    token_ids: np.ndarray
    block_size: int
    medium: Medium
    cache_salt_hash: int
    group: int | None = None
    kv_cache_group: KVCacheGroup | None = None


class BlockRemoved(NamedTuple):
    """Blocks of ``group`` that left the cache on ``medium`` (uint64 hashes)."""

    event_id: int
    block_hashes: np.ndarray
    medium: Medium
    group: int | None = None


class AllBlocksCleared(NamedTuple):
    """Nothing is cached any more, on any medium."""

    event_id: int


KVCacheEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventPublisher(Protocol):
    """Where an ``Engine(kv_events=...)`` sends each step's events (``ZmqEventPublisher``, or
    anything with this method). Called from the engine's thread; must not block for long."""

    def publish(self, events: Sequence[KVCacheEvent]) -> None: ...


_MEDIA: tuple[Medium, ...] = ("device", "host", "disk", "store")


def events_from_buffer(buffer: np.ndarray | None, block_size: int,
                       groups: Sequence[tuple[str, Sequence[int], int | None]] = ()
                       ) -> list[KVCacheEvent]:
    """Types one drain of the core (``KVEventList.buffer``): uint64 ``[E]``, the ``[E, 9]``
    table — event_id, kind, medium, has_parent, parent, root, end of its hashes, end of its
    token ids, group —, the hashes, then the token ids as uint32 pairs; ``groups``: the
    pool's KV-cache groups as (kind, layers, window) (more than one: events name theirs)."""
    if buffer is None:
        return []
    specs = [KVCacheGroup(kind, tuple(layers), window) for kind, layers, window in groups]
    count = int(buffer[0])
    table = buffer[1:1 + 9 * count].reshape(count, 9)
    num_hashes, num_tokens = (int(table[-1, 6]), int(table[-1, 7])) if count else (0, 0)
    hashes = buffer[1 + 9 * count:1 + 9 * count + num_hashes]
    token_ids = buffer[1 + 9 * count + num_hashes:].view(np.uint32)[:num_tokens]
    grouped = len(specs) > 1
    events: list[KVCacheEvent] = []
    hashes_from = tokens_from = 0
    for event_id, kind, medium, has_parent, parent, root, hashes_to, tokens_to, group in \
            table.tolist():
        if kind == 0:
            events.append(BlockStored(event_id, hashes[hashes_from:hashes_to],
                                      parent if has_parent else None,
                                      token_ids[tokens_from:tokens_to], block_size,
                                      _MEDIA[medium], root, group if grouped else None,
                                      specs[group] if grouped else None))
        elif kind == 1:
            events.append(BlockRemoved(event_id, hashes[hashes_from:hashes_to], _MEDIA[medium],
                                       group if grouped else None))
        else:
            events.append(AllBlocksCleared(event_id))
        hashes_from, tokens_from = hashes_to, tokens_to
    return events

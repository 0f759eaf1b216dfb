"""KV-cache events: what a KV-aware router (NVIDIA Dynamo's, llm-d's) replays to know which
blocks an engine holds.

A ``KVCachePool(..., enable_kv_events=True)`` records, in its core, every change of prefix-cache
membership: ``BlockStored`` when computed blocks join the cache (a chain of block hashes with
the hash of the block before them, and their token ids), ``BlockRemoved`` when blocks are
evicted or forgotten, ``AllBlocksCleared`` when a reset leaves nothing cached. ``medium`` says
where: ``"device"``, or ``"host"`` for the copies a swap-out makes. ``pool.take_kv_events()``
drains them in order; ``event_id`` increases by one per event over the pool's life, so a gap
means a lost event.

Block hashes are the first 64 bits of the core's 128-bit chained hash (a router keys blocks
by 64-bit integers); ``cache_salt_hash`` names the chain's root (0 without a cache salt).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeAlias

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "KVCacheEvent",
           "KVEventPublisher", "Medium", "events_from_records"]

Medium: TypeAlias = Literal["device", "host"]


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks that joined the cache: ``block_hashes[i]`` holds
    ``token_ids[i * block_size:(i + 1) * block_size]``, child of ``block_hashes[i - 1]`` (of
    ``parent_block_hash`` for the first; None when it starts its sequence)."""

    event_id: int
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: Medium
    cache_salt_hash: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks that left the cache on ``medium``."""

    event_id: int
    block_hashes: tuple[int, ...]
    medium: Medium


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Nothing is cached any more, on any medium."""

    event_id: int


KVCacheEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventPublisher(Protocol):
    """Where an ``Engine(kv_events=...)`` sends each step's events (``ZmqEventPublisher``, or
    anything with this method). Called from the engine's thread; must not block for long."""

    def publish(self, events: Sequence[KVCacheEvent]) -> None: ...


def events_from_records(records: Iterable[tuple[Any, ...]],
                        block_size: int) -> list[KVCacheEvent]:
    """Types the core's records (``_core.KVCachePool.take_kv_event_records()``)."""
    events: list[KVCacheEvent] = []
    for event_id, kind, medium, parent, hashes, token_ids, root in records:
        if kind == "stored":
            events.append(BlockStored(event_id, tuple(hashes), parent, tuple(token_ids),
                                      block_size, medium, root))
        elif kind == "removed":
            events.append(BlockRemoved(event_id, tuple(hashes), medium))
        else:
            events.append(AllBlocksCleared(event_id))
    return events

"""``AtbMemConnector``'s KV events, in vLLM's own stream (``BlockStored`` / ``BlockRemoved``
with their medium): the host tier's from its index on the scheduler side (medium ``CPU``),
the disk's and the store's (``DISK``, ``STORE``) as the workers' writes land. A worker knows
a block by its hash only: the scheduler side, which planned the write, adds its parent and
tokens. With several workers, a block counts once every rank's shard landed (vLLM's
``KVEventAggregator``). Blocks are named as atb-mem's own KV events name them, by the first
64 bits of the core's chain hash (not by vLLM's hashes): a router scores the tiers with them,
by the medium."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from vllm.distributed.kv_events import (
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
    KVEventAggregator,
)

__all__ = ["AtbMemKVEvents", "host_events", "tier_events", "worker_events"]

Name = Callable[[int], tuple[int | None, list[int]]]


class AtbMemKVEvents(KVConnectorKVEvents):  # type: ignore[misc]
    """The disk's and the store's events of the workers, counted across them."""

    def __init__(self, num_workers: int = 1) -> None:
        self._aggregator = KVEventAggregator(num_workers)

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._aggregator.add_events(events)

    def aggregate(self) -> AtbMemKVEvents:
        common = self._aggregator.get_common_events()
        self._aggregator.clear_events()
        self._aggregator.add_events(common)
        self._aggregator.reset_workers()
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._aggregator.increment_workers(count)

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._aggregator.get_all_events())

    def get_number_of_workers(self) -> int:
        return int(self._aggregator.get_number_of_workers())

    def clear_events(self) -> None:
        self._aggregator.clear_events()
        self._aggregator.reset_workers()


def worker_events(recorded: list[tuple[str, bool, int, int]], block_size: int
                  ) -> AtbMemKVEvents | None:
    """A worker's ``(medium, stored, hash words)`` records as vLLM events (no tokens yet)."""
    if not recorded:
        return None
    events: list[KVCacheEvent] = [
        BlockStored(block_hashes=[high], parent_block_hash=None, token_ids=[],
                    block_size=block_size, lora_id=None, medium=medium, lora_name=None)
        if stored else BlockRemoved(block_hashes=[high], medium=medium)
        for medium, stored, high, _ in recorded]
    batch = AtbMemKVEvents(1)
    batch.add_events(events)
    return batch


def tier_events(batch: AtbMemKVEvents, name: Name) -> list[KVCacheEvent]:
    """The events every worker reported, stored blocks named (parent, tokens)."""
    events: list[KVCacheEvent] = []
    for event in batch.aggregate().get_all_events():
        if isinstance(event, BlockStored):
            parent, tokens = name(event.block_hashes[0])
            event = BlockStored(
                block_hashes=event.block_hashes, parent_block_hash=parent,
                token_ids=tokens, block_size=event.block_size, lora_id=None,
                medium=event.medium, lora_name=None)
        events.append(event)
    return events


def host_events(recorded: Iterable[Any], block_size: int) -> list[KVCacheEvent]:
    """The host index's events (atb-mem's ``BlockStored`` / ``BlockRemoved``) as vLLM's,
    medium ``CPU``."""
    events: list[KVCacheEvent] = []
    for event in recorded:
        kind = type(event).__name__
        if kind not in ("BlockStored", "BlockRemoved"):
            continue
        hashes = [int(word) for word in event.block_hashes]
        if kind == "BlockRemoved":
            events.append(BlockRemoved(block_hashes=hashes, medium="CPU"))
            continue
        events.append(BlockStored(
            block_hashes=hashes, parent_block_hash=event.parent_block_hash,
            token_ids=event.token_ids.tolist(), block_size=block_size, lora_id=None,
            medium="CPU", lora_name=None))
    return events

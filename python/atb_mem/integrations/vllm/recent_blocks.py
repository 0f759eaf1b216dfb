"""What the connector's scheduler side remembers of blocks it planned writes for, each memory
bounded (the oldest forgotten beyond ``MAX_REMEMBERED``): how often the disk has seen a block
it lacks (``Sightings``), and what a block put to the stores holds (``BlockNames``), for the
KV events the workers report once a store took it."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

__all__ = ["MAX_REMEMBERED", "BlockNames", "Sightings"]

MAX_REMEMBERED = 1 << 14


class Sightings:
    """The disk takes a block on its ``min_seen``-th sighting (computed, or hit elsewhere):
    KVBM's rule, kept on the scheduler side so that no worker copies a block the disk would
    refuse."""

    def __init__(self, min_seen: int) -> None:
        self.min_seen = min_seen
        self._seen: OrderedDict[tuple[int, int], int] = OrderedDict()

    def sighted(self, words: Sequence[int]) -> bool:
        """Counts a sighting of the block (its chain-hash words); whether the disk takes it
        now."""
        key = (int(words[0]), int(words[1]))
        seen = self._seen.pop(key, 0) + 1
        if seen < self.min_seen:
            self._seen[key] = seen
            while len(self._seen) > MAX_REMEMBERED:
                self._seen.popitem(last=False)
            return False
        return True


class BlockNames:
    """(parent hash, token ids) of the blocks put to the stores, by the first 64 bits of
    their hash (what KV events name a block by)."""

    def __init__(self) -> None:
        self._names: OrderedDict[int, tuple[int | None, list[int]]] = OrderedDict()

    def add(self, hashes: Any, index: int, tokens: Sequence[int], block_size: int) -> None:
        """Block ``index`` of a request whose blocks' hashes are ``hashes`` (rows of two
        words) and whose tokens are ``tokens``."""
        parent = int(hashes[index - 1][0]) if index else None
        self._names[int(hashes[index][0])] = (
            parent, list(tokens[index * block_size:(index + 1) * block_size]))
        while len(self._names) > MAX_REMEMBERED:
            self._names.popitem(last=False)

    def name_of(self, block_hash: int) -> tuple[int | None, list[int]]:
        """``(None, [])`` once forgotten."""
        return self._names.get(block_hash, (None, []))

"""What the scheduler side asks the disk and the store: which blocks of a prompt they hold,
for every tensor-parallel rank's shard, leaving out for a while the blocks whose loads just
failed (vLLM looks a request whose load failed up again in the same pass: offered the same
block it would fail again, for ever — a file only another process can read, a store slower
than the load timeout)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np

from atb_mem.kv.tiers.block_io import held_by

__all__ = ["UNAVAILABLE_S", "StoreLookup", "StoreLookups"]

# Seconds a block whose load failed is not offered (a later save may write it anew).
UNAVAILABLE_S = 30.0
# Failed blocks remembered at most.
_MAX_FAILED = 1 << 14


class StoreLookup(Protocol):
    """What the scheduler side asks a disk or a store: which keys it holds now."""

    name: str

    def exists(self, keys: Sequence[str]) -> list[bool]: ...

    def close(self) -> None: ...


class StoreLookups:
    """``stores`` asked about blocks keyed per rank by ``identities``."""

    def __init__(self, stores: Sequence[StoreLookup], identities: Sequence[str]) -> None:
        self.stores = list(stores)
        self.identities = list(identities)
        # Disk and store loads in flight, per request: (hash words, vLLM block).
        self._loading: dict[str, list[tuple[tuple[int, int], int]]] = {}
        # Blocks whose load failed lately, until when they are not offered.
        self._unavailable: OrderedDict[tuple[int, int], float] = OrderedDict()

    def holders(self, hashes: np.ndarray) -> list[tuple[str, ...]]:
        """The stores holding every rank's shard of each block: one batched call each."""
        now = time.monotonic()
        return [() if self._unavailable.get((int(words[0]), int(words[1])), 0.0) > now
                else tuple(store.name for store in stores)
                for words, stores in zip(hashes, held_by(self.stores, self.identities, hashes),
                                         strict=True)]

    def loading(self, req_id: str, words: tuple[int, int], block: int) -> None:
        """A load of ``words`` into vLLM's ``block`` for ``req_id`` was planned."""
        self._loading.setdefault(req_id, []).append((words, block))

    def loads_ended(self, finished: Iterable[str], failed_blocks: Iterable[int]) -> None:
        """What the workers reported (vLLM's ``finished_recving`` and
        ``invalid_block_ids``): a block whose load failed is not offered for
        ``UNAVAILABLE_S``."""
        failed = set(failed_blocks)
        if failed:
            until = time.monotonic() + UNAVAILABLE_S
            for loads in self._loading.values():
                for words, block in loads:
                    if block in failed:
                        self._unavailable[words] = until
                        self._unavailable.move_to_end(words)
            while len(self._unavailable) > _MAX_FAILED:
                self._unavailable.popitem(last=False)
        for req_id in finished:
            self._loading.pop(req_id, None)

"""What the scheduler side asks the disk and the store: which blocks of a prompt they hold,
for every tensor-parallel rank's shard, leaving out for a while the blocks whose loads just
failed (vLLM looks a request whose load failed up again in the same pass: offered the same
block it would fail again, for ever — a file only another process can read, a store slower
than the load timeout)."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np

from atb_mem.integrations.vllm.moves import VllmBlock
from atb_mem.integrations.vllm.settings import ConnectorSettings
from atb_mem.kv.tiers import DiskStore, KVStore, MooncakeStore
from atb_mem.kv.tiers.block_io import held_by

log = logging.getLogger("atb_mem.vllm")

__all__ = ["UNAVAILABLE_S", "DiskLookup", "StoreLookup", "StoreLookups", "open_stores",
           "scheduler_lookups"]

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
        self._loading: dict[str, list[tuple[tuple[int, int], VllmBlock]]] = {}
        # Blocks whose load failed lately, until when they are not offered.
        self._unavailable: OrderedDict[tuple[int, int], float] = OrderedDict()

    def holders(self, hashes: np.ndarray) -> list[tuple[str, ...]]:
        """The stores holding every rank's shard of each block: one batched call each."""
        now = time.monotonic()
        return [() if self._unavailable.get((int(words[0]), int(words[1])), 0.0) > now
                else tuple(store.name for store in stores)
                for words, stores in zip(hashes, held_by(self.stores, self.identities, hashes),
                                         strict=True)]

    def loading(self, req_id: str, words: tuple[int, int], block: VllmBlock) -> None:
        """A load of ``words`` into vLLM's ``block`` for ``req_id`` was planned."""
        self._loading.setdefault(req_id, []).append((words, block))

    def loads_ended(self, finished: Iterable[str], failed_blocks: Iterable[VllmBlock]) -> None:
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


def open_stores(settings: ConnectorSettings, disk_identities: list[str], ranks: int,
                min_seen: int = 1) -> list[KVStore]:
    """The disk tier (a folder per rank identity in ``disk_identities``, each with its share
    of the capacity) and the store. The scheduler side asks for every rank's folder; a
    worker for its own, and writes what it is given (the scheduler side counts the
    sightings: ``min_seen`` 1)."""
    stores: list[KVStore] = []
    try:
        if settings.disk_path is not None:
            stores.extend(DiskStore(settings.disk_path, settings.disk_bytes // ranks,
                                    min_seen=min_seen) for _ in disk_identities)
        if settings.store_url is not None:
            stores.append(MooncakeStore(settings.store_url))
    except Exception:
        for store in stores:
            store.close()
        raise
    return stores


class DiskLookup:
    """The scheduler's view of the disk tier, which the workers (other processes) write:
    whether a block's file is in its rank's folder now."""

    name, medium = "DISK", "disk"

    def __init__(self, folders: dict[str, DiskStore]) -> None:
        self.folders = folders

        self.errors = 0

    def exists(self, keys: Sequence[str]) -> list[bool]:
        # A key is atb/IDENTITY/HASH (store.block_key). A folder that cannot be read (a
        # stale mount, permissions) holds nothing: the scheduler must not raise.
        try:
            return [self.folders[key.split("/")[1]].files_exist([key])[0] for key in keys]
        except OSError as error:
            self.errors += 1
            log.warning("atb-mem: looking blocks up on the disk tier failed: %s", error)
            return [False] * len(keys)

    def close(self) -> None:
        for store in self.folders.values():
            store.close()


def scheduler_lookups(stores: list[KVStore], identities: list[str], layout: str
                      ) -> list[StoreLookup]:
    """The scheduler side's view of ``stores`` (``open_stores`` for every rank's identity):
    the disk's folders as one ``DiskLookup``, first, then the store. Each registers its
    layout (the workers check the capacity against a block)."""
    disks = [store for store in stores if isinstance(store, DiskStore)]
    try:
        for store in stores:
            register = getattr(store, "register_layout", None)
            if register is not None:
                register(identities[disks.index(store)] if store in disks else layout, 1)
    except Exception:
        for store in stores:
            store.close()
        raise
    lookups: list[StoreLookup] = [store for store in stores if store not in disks]
    if disks:
        lookups.insert(0, DiskLookup(dict(zip(identities, disks, strict=True))))
    return lookups

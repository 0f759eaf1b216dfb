"""Moving blocks to and from the tiers below the host, written once for both users: the
Engine's ``TierConnector`` and vLLM's ``TierWorker`` (with its scheduler side's lookups).

- ``held_by``: which stores hold a prompt's blocks (one batched ``exists`` per store; under
  tensor parallelism a block counts only where every rank's shard is held).
- ``BlockFetch``: one load's blocks read on a fetch thread, in order, each from the first
  store with an intact copy (a damaged copy is discarded, so a later save writes it anew),
  stopping at the first block no store has intact, or once the load is cancelled as late.
- ``landing_chunks``: a fetch's intact blocks in chunks of at most ``LANDING_BYTES``, so a
  load lands in one copy per chunk, not one per block.
- ``BlockWriter``: the one thread that frames blocks and puts them to the stores, at most
  ``MAX_PENDING_PUTS`` queued (a tier slower than prefill must not grow host memory without
  bound); a store whose put raises does not keep the block from the others.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from atb_mem.kv.tiers.store import KVStore, block_key, frame, unframe

__all__ = ["LANDING_BYTES", "MAX_PENDING_PUTS", "QUEUED_TIMEOUTS", "BlockFetch",
           "BlockWriter", "held_by", "landing_chunks"]

log = logging.getLogger("atb_mem.tiers")

MAX_PENDING_PUTS = 256
"""Puts queued for the writer beyond which new ones are dropped (counted by the caller)."""
LANDING_BYTES = 64 << 20
"""The most bytes of blocks a load lands in one copy."""
QUEUED_TIMEOUTS = 4
"""A load still waiting for a fetch thread after this many load timeouts is late too."""


class _Lookup(Protocol):
    def exists(self, keys: Sequence[str]) -> list[bool]: ...


_Store = TypeVar("_Store", bound=_Lookup)


def held_by(stores: Sequence[_Store], identities: Sequence[str], hashes: Any
            ) -> list[list[_Store]]:
    """Per block of ``hashes`` (chain-hash words), the stores holding its key under every
    one of ``identities`` (a rank's each): one batched ``exists`` per store."""
    holders: list[list[_Store]] = [[] for _ in range(len(hashes))]
    if not stores or not holders:
        return holders
    keys = [block_key(identity, words) for words in hashes for identity in identities]
    ranks = len(identities)
    for store in stores:
        held = store.exists(keys)
        for at, holding in enumerate(holders):
            if all(held[at * ranks:(at + 1) * ranks]):
                holding.append(store)
    return holders


@dataclass
class BlockFetch:
    """The blocks of ``keys``, fetched in order on a thread (``start``)."""

    keys: list[str]
    fetched: list[tuple[bytes, str] | None] = field(default_factory=list)
    """Each key's payload and the store it came from, so far; None for the first that no
    store had intact (the fetch stopped there)."""
    started: list[float] = field(default_factory=list)
    """When the fetch thread began (empty while the load waits for one)."""
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)
    future: Future[None] | None = None

    def start(self, pool: ThreadPoolExecutor, stores: Sequence[KVStore], block_bytes: int,
              checksum: bool, on_damaged: Callable[[], None] | None = None) -> BlockFetch:
        self.future = pool.submit(self._run, stores, block_bytes, checksum, on_damaged)
        return self

    def fail_now(self) -> BlockFetch:
        """Ends the fetch at once, with nothing fetched (a load known to fail, no I/O)."""
        self.future = Future()
        self.future.set_result(None)
        return self

    def _run(self, stores: Sequence[KVStore], block_bytes: int, checksum: bool,
             on_damaged: Callable[[], None] | None) -> None:
        self.started.append(time.perf_counter())
        for key in self.keys:
            if self.cancelled.is_set():
                return
            found = None
            for store in stores:
                try:
                    value = store.get(key)
                except Exception as error:  # the next store may have it
                    log.warning("atb-mem: reading from the %s tier failed: %s", store.name,
                                error)
                    continue
                payload = unframe(value, block_bytes, checksum, key)
                if payload is not None:
                    found = (payload, store.name)
                    break
                if value is not None:
                    if hasattr(store, "discard"):
                        store.discard(key)  # damaged: a later save writes it anew
                    if on_damaged is not None:
                        on_damaged()
            self.fetched.append(found)
            if found is None:
                return

    @property
    def done(self) -> bool:
        return self.future is not None and self.future.done()

    def late(self, now: float, timeout_s: float) -> bool:
        """Whether the fetch ran past ``timeout_s`` (waiting in the queue is not late, but a
        queue that never moves is)."""
        begun = self.started[0] if self.started else now
        return now - begun > timeout_s or now - self.submitted > QUEUED_TIMEOUTS * timeout_s

    def wait(self, seconds: float) -> None:
        """Waits at most ``seconds`` for the fetch to end."""
        if self.future is not None:
            try:
                self.future.exception(timeout=seconds)
            except FutureTimeoutError:  # not the builtin TimeoutError before Python 3.11
                pass

    def intact(self) -> list[tuple[bytes, str]]:
        """The leading blocks fetched intact so far (a cancelled fetch's are the part that
        arrived in time)."""
        leading = []
        for found in list(self.fetched)[:len(self.keys)]:
            if found is None:
                break
            leading.append(found)
        return leading


def landing_chunks(intact: list[tuple[bytes, str]], block_bytes: int
                   ) -> Iterator[tuple[int, list[tuple[bytes, str]]]]:
    """``intact``'s blocks as (index of the first, blocks), at most ``LANDING_BYTES`` each."""
    per_copy = max(1, LANDING_BYTES // block_bytes)
    for start in range(0, len(intact), per_copy):
        yield start, intact[start:start + per_copy]


class BlockWriter:
    """Frames blocks and puts them to stores on one thread of its own, in order."""

    def __init__(self, on_raised: Callable[[KVStore, Exception], None],
                 thread_name: str = "atb-mem-tier-save") -> None:
        self._on_raised = on_raised
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=thread_name)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0

    def submit(self, key: str, payload: bytes, stores: list[KVStore], checksum: bool,
               then: Callable[[list[KVStore], int], None] | None = None) -> Future[None] | None:
        """Queues ``payload`` (a copy: the block may change after this call) for ``stores``;
        ``then(taken, framed bytes)`` runs on the writer with the stores that took it. None:
        dropped, ``MAX_PENDING_PUTS`` being queued already."""
        with self._lock:
            if self._pending >= MAX_PENDING_PUTS:
                return None
            self._pending += 1
        return self._pool.submit(self._put, key, payload, stores, checksum, then)

    def _put(self, key: str, payload: bytes, stores: list[KVStore], checksum: bool,
             then: Callable[[list[KVStore], int], None] | None) -> None:
        try:
            value = frame(payload, checksum, key)
            taken = [store for store in stores if self._put_into(store, key, value)]
        finally:
            with self._lock:
                self._pending -= 1
                if self._pending == 0:
                    self._idle.notify_all()
        if taken and then is not None:
            then(taken, len(value))

    def _put_into(self, store: KVStore, key: str, value: bytes) -> bool:
        try:
            return store.put(key, value)
        except Exception as error:
            self._on_raised(store, error)
            log.warning("atb-mem: writing a block to the %s tier failed: %s", store.name, error)
            return False

    def wait(self, timeout_s: float) -> bool:
        """Whether every queued put ended (landed or failed) within ``timeout_s``."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout_s)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=False)

"""The engine's side of the tiers below the host: what they hold of a new prompt, the loads a
step asks for, and the blocks each step computed, written through to them.

- ``offer``: a new request's full blocks are looked up in every store (one batched call
  each); the leading run that the device, the host or some store holds is offered to the
  scheduler, which loads what the device and the host do not hold when it admits the
  request (so a tail on disk is loaded after a head on the device).
- ``start_loads`` / ``poll``: each request's blocks are fetched on worker threads (the I/O
  overlaps the forward) and checked against their frames. At the start of the next step,
  ``poll`` copies what arrived into the request's device blocks, on the engine's thread, and
  reports the loads. A load with a block that is missing, truncated or corrupted, or that
  takes longer than ``load_timeout_s``, fails: the scheduler recomputes those blocks.
- ``save``: after each forward, the full blocks the step completed are copied to host memory
  at once (nothing may overwrite them before the next step), then put to every store by
  the workers. A prefill also puts the blocks its prompt hit on the device or the host to
  the stores that lacked them: a hit is a sighting, so a hot prompt reaches the
  disk (which writes on the second sighting) before its first eviction.

Stores are keyed by the chain hash plus the model's and the layout's identity
(``store.block_key``), so engines of different models never share a block.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from atb_mem.kv.tiers.block_io import BlockFetch, BlockWriter, held_by, landing_chunks
from atb_mem.kv.tiers.counters import LOAD_SECONDS_BUCKETS, TierCounters
from atb_mem.kv.tiers.saves import MAX_PENDING_SAVES, Prompt, WriteThrough
from atb_mem.kv.tiers.store import KVStore, block_key, framed_size

__all__ = ["LOAD_SECONDS_BUCKETS", "MAX_PENDING_SAVES", "TierConnector", "TierCounters"]

log = logging.getLogger("atb_mem.tiers")


@dataclass
class _Load:
    seq_id: int
    blocks: list[int]
    fetch: BlockFetch
    fills: str | None
    """The miss reason this load turns into a full hit, if it loads up to the last block the
    prompt can hit."""


class TierConnector(WriteThrough):
    """Lower tiers ``stores`` (first found, first served) under ``kv_cache``'s blocks."""

    def __init__(self, kv_cache: Any, stores: list[KVStore], identity: str, *,
                 checksum: bool = True, load_timeout_s: float = 30.0, workers: int = 2) -> None:
        tensors = kv_cache.tensors
        if tensors is None:
            raise ValueError("tiers below the host need a KV cache with bytes (a device)")
        try:  # a store that cannot hold a block refuses it now, not on every later put
            for store in stores:
                register = getattr(store, "register_layout", None)
                if register is not None:
                    register(identity, framed_size(kv_cache.bytes_per_block))
        except Exception:
            for store in stores:
                store.close()
            raise
        self.kv_cache, self.stores, self.identity = kv_cache, stores, identity
        self.checksum, self.load_timeout_s = checksum, load_timeout_s
        self._counters = TierCounters()
        self._tensors = tensors
        self._block_bytes = kv_cache.bytes_per_block
        self._block_shape = (tensors.kv.shape[0], tensors.kv.shape[1], 1, *tensors.kv.shape[3:])
        self._staging = tensors.backend.host_tensor(self._block_shape, tensors.kv.dtype)
        self._landing: Any = None
        # Loads never wait behind saves: one pool fetches, one thread writes.
        self._workers = ThreadPoolExecutor(workers, thread_name_prefix="atb-mem-tier-load")
        self._writer = BlockWriter(self._raised)
        self._prompts: dict[int, Prompt] = {}
        self._events = bool(kv_cache.enable_kv_events)
        self._loads: list[_Load] = []
        self._counting = threading.Lock()  # saves are counted on the writer

    @property
    def counters(self) -> TierCounters:
        """What the tiers did so far: a copy, taken now (the writer counts on its thread)."""
        with self._counting:
            counters = self._counters.copy()
        counters.store_errors = counters.raised_puts + sum(getattr(store, "errors", 0)
                                                           for store in self.stores)
        return counters

    # ---- a new request ---------------------------------------------------------------------

    def _holders(self, hashes: np.ndarray) -> list[list[KVStore]]:
        """The stores holding each of ``hashes``: one batched lookup per store."""
        return held_by(self.stores, [self.identity], hashes)

    def _hit_blocks(self, why: Any) -> int:
        """The whole blocks the device and the host serve, as ``explain_prefix`` gives them."""
        return int((why.hit_tokens - why.partial_tokens) // self.kv_cache.block_size)

    @staticmethod
    def _run(holders: Sequence[list[KVStore]]) -> int:
        """How many of ``holders`` lead with a store holding them."""
        return next((index for index, held_by in enumerate(holders) if not held_by),
                    len(holders))

    def offer(self, scheduler: Any, seq_id: int, token_ids: list[int]) -> int:
        """Looks ``token_ids``' full blocks up and offers the scheduler the leading run that
        the device, the host or some store holds (the admission loads the stores' part of
        it: what ``explain_prefix`` names). Returns how many blocks the stores add to the
        device's and the host's hit. Where the device evicts the head before the admission,
        the load fails at once and those blocks are recomputed."""
        hashes = self.kv_cache.block_hashes(token_ids)
        most = (len(token_ids) - 1) // self.kv_cache.block_size
        why = self.kv_cache.explain_prefix(token_ids)
        holders = self._holders(hashes[:most])
        prompt = Prompt(hashes, token_ids, holders, str(why.reason))
        self._prompts[seq_id] = prompt
        whole = self._hit_blocks(why)
        added = self._run(holders[whole:])
        if added:
            scheduler.offer_external_prefix(seq_id, whole + added)
            prompt.offered = whole + added
            self._counters.offered_blocks += added
        return added

    def explain_prefix(self, token_ids: list[int]) -> Any:
        """``kv_cache.explain_prefix`` with the tiers below the host too: past the device's
        and the host's hit, the blocks some store holds (as ``("disk" | "store", tokens)``
        runs in ``tiers``), which an admission now would load. ``hit_tokens`` is what the
        request would not compute; the reason stays the cache's own."""
        why = self.kv_cache.explain_prefix(token_ids)
        block_size = self.kv_cache.block_size
        hashes = self.kv_cache.block_hashes(token_ids)
        most = (len(token_ids) - 1) // block_size
        tiers = list(why.tiers)
        whole = self._hit_blocks(why)
        added = self._holders(hashes[whole:most])
        holders = [held_by[0] for held_by in added[:self._run(added)]]
        if holders and why.partial_tokens:  # a loaded block brings the copied pieces too
            medium, tokens = tiers.pop()
            if tokens > why.partial_tokens:
                tiers.append((medium, tokens - why.partial_tokens))
            why = why._replace(partial_tokens=0)
        for holder in holders:
            if tiers and tiers[-1][0] == holder.medium:
                tiers[-1] = (holder.medium, tiers[-1][1] + block_size)
            else:
                tiers.append((holder.medium, block_size))
        hit = sum(tokens for _, tokens in tiers)
        return why._replace(hit_tokens=hit, tiers=tiers)

    def forget(self, seq_ids: Any) -> None:
        for seq_id in np.asarray(seq_ids).tolist():
            self._prompts.pop(int(seq_id), None)

    # ---- loads -----------------------------------------------------------------------------

    def start_loads(self, plan: Any) -> None:
        """Starts fetching the blocks ``plan`` asks for, request by request."""
        if not len(plan.load_seq_ids):
            return
        seq_ids = plan.load_seq_ids.tolist()
        blocks = plan.load_blocks.tolist()
        keys = [block_key(self.identity, words) for words in plan.load_keys]
        start = 0
        while start < len(seq_ids):
            end = start
            while end < len(seq_ids) and seq_ids[end] == seq_ids[start]:
                end += 1
            self._loads.append(self._start_load(seq_ids[start], blocks[start:end],
                                                keys[start:end]))
            start = end

    def _start_load(self, seq_id: int, blocks: list[int], keys: list[str]) -> _Load:
        """A load of ``blocks`` (the offered run's tail past what the admission hit)."""
        fetch = BlockFetch(keys)
        prompt = self._prompts.get(seq_id)
        if prompt is None or not prompt.offered:  # not offered here: nothing to check
            return _Load(seq_id, blocks, self._fetch(fetch), None)
        fills = prompt.reason if prompt.offered == len(prompt.holders) else None
        if all(prompt.holders[prompt.offered - len(keys):prompt.offered]):
            return _Load(seq_id, blocks, self._fetch(fetch), fills)
        # The device evicted part of the head the offer counted on, which no store holds:
        # the load fails now, without I/O, and those blocks are recomputed.
        return _Load(seq_id, blocks, fetch.fail_now(), fills)

    def _fetch(self, fetch: BlockFetch) -> BlockFetch:
        return fetch.start(self._workers, self.stores, self._block_bytes, self.checksum)

    @property
    def num_loading(self) -> int:
        return len(self._loads)

    def poll(self, scheduler: Any, wait_s: float = 0.0) -> None:
        """Copies the loads that arrived into their blocks and reports them, with the loads
        that failed or timed out; with ``wait_s``, first waits that long for the oldest."""
        if not self._loads:
            return
        if wait_s > 0 and not any(load.fetch.done for load in self._loads):
            self._loads[0].fetch.wait(wait_s)
        now = time.perf_counter()
        ended = [load for load in self._loads
                 if load.fetch.done or load.fetch.late(now, self.load_timeout_s)]
        if not ended:
            return
        done = []
        for load in ended:
            if not load.fetch.done:  # late: recomputed, what arrives later is dropped
                load.fetch.cancelled.set()
                log.warning("atb-mem: a load took over %s s: its blocks are recomputed",
                            self.load_timeout_s)
            else:
                try:
                    landed = self._land(load)
                except Exception as error:  # a copy that failed: the blocks are recomputed
                    log.warning("atb-mem: landing a load failed: %s", error)
                else:
                    done.append(landed)
                    continue  # _land counted its own failure
            with self._counting:
                self._counters.load_failures += 1
            done.append(False)
        # Reported before they leave the list: every load the scheduler gave is reported.
        scheduler.finish_loads(np.asarray([load.seq_id for load in ended], dtype=np.uint64),
                               done)
        self._loads = [load for load in self._loads if load not in ended]

    def _land(self, load: _Load) -> bool:
        """Copies a whole load in (a load lands whole or not at all), as many blocks at a
        time as ``LANDING_BYTES`` allows."""
        try:
            assert load.fetch.future is not None
            load.fetch.future.result()
        except Exception as error:  # a fetch that raised: the load failed
            log.warning("atb-mem: a load failed: %s", error)
            intact, missing = [], 1
        else:  # the fetch stops at the first block no store had intact
            intact, missing = load.fetch.intact(), int(None in load.fetch.fetched)
        if len(intact) != len(load.blocks):
            with self._counting:
                self._counters.load_failures += 1
                self._counters.corrupt_blocks += missing
            return False
        backend = self._tensors.backend
        for start, chunk in landing_chunks(intact, self._block_bytes):
            # Rows of the whole buffer (a slice of it is no view of its bytes).
            landing = self._landing_blocks(len(chunk))
            rows = backend.bytes_of(landing).reshape(
                self._block_shape[0] * self._block_shape[1], landing.shape[2], -1)
            for row, (payload, _) in enumerate(chunk):
                rows[:, row] = np.frombuffer(payload, dtype=np.uint8).reshape(len(rows), -1)
            backend.copy_blocks(self._tensors.kv, np.asarray(load.blocks[start:][:len(chunk)]),
                                landing, np.arange(len(chunk)))
        self._count_landed(load, Counter(tier for _, tier in intact))
        return True

    def _landing_blocks(self, count: int) -> Any:
        """A host buffer of at least ``count`` blocks (the blocks' axis third, as the
        cache's), kept and grown as loads need."""
        if self._landing is None or self._landing.shape[2] < count:
            shape = (*self._block_shape[:2], count, *self._block_shape[3:])
            self._landing = self._tensors.backend.host_tensor(shape, self._tensors.kv.dtype)
        return self._landing

    def _count_landed(self, load: _Load, by_tier: Counter[str]) -> None:
        seconds = time.perf_counter() - load.fetch.submitted
        by_medium: Counter[str] = Counter()
        for store in self.stores:
            by_medium[store.medium] += by_tier[store.name]
        filled = load.fills
        for medium, blocks in by_medium.items():  # the cache's stats count them hits
            if blocks:
                self.kv_cache._record_tier_hits(medium, blocks, filled)
                filled = None
        counters = self._counters
        with self._counting:
            for tier, blocks in by_tier.items():
                counters.loaded_by_tier[tier] = counters.loaded_by_tier.get(tier, 0) + blocks
            counters.loaded_blocks += len(load.blocks)
            counters.loaded_bytes += len(load.blocks) * self._block_bytes
            counters.load_seconds_sum += seconds
            for bucket, bound in enumerate(LOAD_SECONDS_BUCKETS):
                counters.load_seconds_buckets[bucket] += int(seconds <= bound)

    def _raised(self, store: KVStore, error: Exception) -> None:
        """A store's put raised (on the writer): a failed call, counted."""
        with self._counting:
            self._counters.raised_puts += 1

    def close(self) -> None:
        self._workers.shutdown(wait=True, cancel_futures=False)
        self._writer.close()
        for store in self.stores:
            store.close()

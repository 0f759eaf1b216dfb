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
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass
from typing import Any

import numpy as np

from atb_mem.kv.tiers.counters import LOAD_SECONDS_BUCKETS, TierCounters
from atb_mem.kv.tiers.saves import MAX_PENDING_SAVES, Prompt, WriteThrough
from atb_mem.kv.tiers.store import KVStore, block_key, framed_size, unframe

__all__ = ["LOAD_SECONDS_BUCKETS", "MAX_PENDING_SAVES", "TierConnector", "TierCounters"]

log = logging.getLogger("atb_mem.tiers")


@dataclass
class _Load:
    seq_id: int
    blocks: list[int]
    future: Future[list[tuple[bytes, str] | None]]
    started: float
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
        # Loads never wait behind saves: one pool fetches, one thread writes.
        self._workers = ThreadPoolExecutor(workers, thread_name_prefix="atb-mem-tier-load")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="atb-mem-tier-save")
        self._pending_saves = 0
        self._prompts: dict[int, Prompt] = {}
        self._events = bool(kv_cache.enable_kv_events)
        self._loads: list[_Load] = []
        self._counting = threading.Lock()  # saves are counted on the workers
        self._saves_done = threading.Condition(self._counting)

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
        keys = [block_key(self.identity, words) for words in hashes]
        holders: list[list[KVStore]] = [[] for _ in keys]
        for store in self.stores:
            for held_by, held in zip(holders, store.exists(keys) if keys else [],
                                     strict=True):
                if held:
                    held_by.append(store)
        return holders

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
        prompt = self._prompts.get(seq_id)
        if prompt is None or not prompt.offered:  # not offered here: nothing to check
            return _Load(seq_id, blocks, self._workers.submit(self._fetch, keys),
                         time.perf_counter(), None)
        fills = prompt.reason if prompt.offered == len(prompt.holders) else None
        future: Future[list[tuple[bytes, str] | None]]
        if all(prompt.holders[prompt.offered - len(keys):prompt.offered]):
            future = self._workers.submit(self._fetch, keys)
        else:
            # The device evicted part of the head the offer counted on, which no store
            # holds: the load fails now, without I/O, and those blocks are recomputed.
            future = Future()
            future.set_result([])
        return _Load(seq_id, blocks, future, time.perf_counter(), fills)

    def _fetch(self, keys: list[str]) -> list[tuple[bytes, str] | None]:
        """Each key's checked payload and the tier it came from (None where no store has an
        intact one; the fetch stops there, as the load has failed)."""
        payloads: list[tuple[bytes, str] | None] = []
        for key in keys:
            found = None
            for store in self.stores:
                value = store.get(key)
                payload = unframe(value, self._block_bytes, self.checksum, key)
                if payload is not None:
                    found = (payload, store.name)
                    break
                if value is not None and hasattr(store, "discard"):
                    store.discard(key)  # damaged: a later save writes it anew
            payloads.append(found)
            if found is None:
                break
        return payloads

    @property
    def num_loading(self) -> int:
        return len(self._loads)

    def poll(self, scheduler: Any, wait_s: float = 0.0) -> None:
        """Copies the loads that arrived into their blocks and reports them, with the loads
        that failed or timed out; with ``wait_s``, first waits that long for the oldest."""
        if not self._loads:
            return
        if wait_s > 0 and not any(load.future.done() for load in self._loads):
            try:
                self._loads[0].future.exception(timeout=wait_s)
            except FutureTimeoutError:  # not the builtin TimeoutError before Python 3.11
                pass
        now = time.perf_counter()
        ended = [load for load in self._loads
                 if load.future.done() or now - load.started > self.load_timeout_s]
        if not ended:
            return
        done = []
        for load in ended:
            landed = False
            if not load.future.done():  # late: recomputed, what arrives later is dropped
                load.future.cancel()
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
        try:
            payloads = load.future.result()
        except Exception as error:  # a store that raised: the load failed
            log.warning("atb-mem: a load failed: %s", error)
            payloads = [None]
        if len(payloads) != len(load.blocks) or any(p is None for p in payloads):
            with self._counting:
                self._counters.load_failures += 1
                self._counters.corrupt_blocks += sum(p is None for p in payloads)
            return False
        backend, staging = self._tensors.backend, self._staging
        view = backend.bytes_of(staging)
        counters = self._counters
        for block, found in zip(load.blocks, payloads, strict=True):
            assert found is not None  # checked above
            payload, tier = found
            view[:] = np.frombuffer(payload, dtype=np.uint8)
            backend.copy_blocks(self._tensors.kv, np.array([block]), staging, np.array([0]))
        seconds = time.perf_counter() - load.started
        by_tier = Counter(tier for _, tier in payloads)  # type: ignore[misc]
        by_medium: Counter[str] = Counter()
        for store in self.stores:
            by_medium[store.medium] += by_tier[store.name]
        filled = load.fills
        for medium, blocks in by_medium.items():  # the cache's stats count them hits
            if blocks:
                self.kv_cache._record_tier_hits(medium, blocks, filled)
                filled = None
        with self._counting:
            for tier, blocks in by_tier.items():
                counters.loaded_by_tier[tier] = counters.loaded_by_tier.get(tier, 0) + blocks
            counters.loaded_blocks += len(load.blocks)
            counters.loaded_bytes += len(load.blocks) * self._block_bytes
            counters.load_seconds_sum += seconds
            for bucket, bound in enumerate(LOAD_SECONDS_BUCKETS):
                counters.load_seconds_buckets[bucket] += int(seconds <= bound)
        return True

    def close(self) -> None:
        self._workers.shutdown(wait=True, cancel_futures=False)
        self._writer.shutdown(wait=True, cancel_futures=False)
        for store in self.stores:
            store.close()

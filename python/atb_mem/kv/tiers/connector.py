"""The engine's side of the tiers below the host: what they hold of a new prompt, the loads a
step asks for, and the blocks each step computed, written through to them.

- ``offer``: a new request's full blocks are looked up in every store (one batched call
  each); the leading run some store holds is offered to the scheduler, which loads what the
  device and the host do not hold when it admits the request.
- ``start_loads`` / ``poll``: each request's blocks are fetched on worker threads (the I/O
  overlaps the forward) and checked against their frames. At the start of the next step,
  ``poll`` copies what arrived into the request's device blocks, on the engine's thread, and
  reports the loads. A load with a block that is missing, truncated or corrupted, or that
  takes longer than ``load_timeout_s``, fails: the scheduler recomputes those blocks.
- ``save``: after each forward, the full blocks the step completed are copied to host memory
  at once (nothing may overwrite them before the next step), then put to every store by
  the workers.

Stores are keyed by the chain hash plus the model's and the layout's identity
(``store.block_key``), so engines of different models never share a block.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from atb_mem.kv.tiers.store import KVStore, block_key, frame, framed_size, key_hash, unframe

__all__ = ["LOAD_SECONDS_BUCKETS", "TierConnector", "TierCounters"]

log = logging.getLogger("atb_mem.tiers")


# Saves queued for the writer beyond which new ones are dropped (counted): a tier slower than
# prefill must not grow host memory without bound.
MAX_PENDING_SAVES = 256

# Upper bounds (seconds) of the load-latency histogram's buckets, Prometheus-style.
LOAD_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, float("inf"))


@dataclass
class TierCounters:
    """What the tiers below the host did since the engine started. Per tier (a store's
    ``name``): blocks loaded from it and blocks written to it."""

    offered_blocks: int = 0
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    load_failures: int = 0
    corrupt_blocks: int = 0
    saved_blocks: int = 0
    saved_bytes: int = 0
    dropped_saves: int = 0
    """Saves dropped: the writer was ``MAX_PENDING_SAVES`` behind, or copying out failed."""
    store_errors: int = 0
    """Calls to the stores that failed (unreachable, refusing, a failed write)."""
    loaded_by_tier: dict[str, int] = field(default_factory=dict)
    saved_by_tier: dict[str, int] = field(default_factory=dict)
    load_seconds_buckets: list[int] = field(
        default_factory=lambda: [0] * len(LOAD_SECONDS_BUCKETS))
    """Loads (request admitted to blocks in place) by latency: cumulative, per bucket of
    ``LOAD_SECONDS_BUCKETS``."""
    load_seconds_sum: float = 0.0


@dataclass
class _Load:
    seq_id: int
    blocks: list[int]
    future: Future[list[tuple[bytes, str] | None]]
    started: float


class TierConnector:
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
        # seq -> (its prompt's block hashes, how many were saved, the prompt's token ids)
        self._hashes: dict[int, tuple[np.ndarray, int, list[int]]] = {}
        self._events = bool(kv_cache.enable_kv_events)
        self._loads: list[_Load] = []
        self._counting = threading.Lock()  # saves are counted on the workers
        self._saves_done = threading.Condition(self._counting)

    @property
    def counters(self) -> TierCounters:
        """What the tiers did so far: a copy, taken now (the writer counts on its thread)."""
        with self._counting:
            counters = dataclasses.replace(
                self._counters, loaded_by_tier=dict(self._counters.loaded_by_tier),
                saved_by_tier=dict(self._counters.saved_by_tier),
                load_seconds_buckets=list(self._counters.load_seconds_buckets))
        counters.store_errors = sum(getattr(store, "errors", 0) for store in self.stores)
        return counters

    # ---- a new request ---------------------------------------------------------------------

    def _leading_holders(self, hashes: np.ndarray) -> list[KVStore]:
        """For the leading run of ``hashes`` some store holds, the first store holding each:
        one batched lookup per store."""
        keys = [block_key(self.identity, words) for words in hashes]
        holders: list[KVStore | None] = [None] * len(keys)
        for store in self.stores:
            missing = [index for index, holder in enumerate(holders) if holder is None]
            if not missing:
                break
            for index, held in zip(missing, store.exists([keys[i] for i in missing]),
                                   strict=True):
                if held:
                    holders[index] = store
        leading = next((index for index, holder in enumerate(holders) if holder is None),
                       len(holders))
        return [holder for holder in holders[:leading] if holder is not None]

    def offer(self, scheduler: Any, seq_id: int, token_ids: list[int]) -> int:
        """Looks ``token_ids``' full blocks up and offers the scheduler the leading run some
        store holds; returns how many blocks that is."""
        hashes = self.kv_cache.block_hashes(token_ids)
        self._hashes[seq_id] = (hashes, 0, token_ids)
        most = (len(token_ids) - 1) // self.kv_cache.block_size
        leading = len(self._leading_holders(hashes[:most]))
        if leading:
            scheduler.offer_external_prefix(seq_id, leading)
            self._counters.offered_blocks += leading
        return leading

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
        whole = (why.hit_tokens - why.partial_tokens) // block_size
        holders = self._leading_holders(hashes[whole:most])
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
            self._hashes.pop(int(seq_id), None)

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
            future = self._workers.submit(self._fetch, keys[start:end])
            self._loads.append(_Load(seq_ids[start], blocks[start:end], future,
                                     time.perf_counter()))
            start = end

    def _fetch(self, keys: list[str]) -> list[tuple[bytes, str] | None]:
        """Each key's checked payload and the tier it came from (None where no store has an
        intact one; the fetch stops there, as the load has failed)."""
        payloads: list[tuple[bytes, str] | None] = []
        for key in keys:
            found = None
            for store in self.stores:
                value = store.get(key)
                payload = unframe(value, self._block_bytes, self.checksum)
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
            except TimeoutError:
                pass
        now = time.perf_counter()
        ended = [load for load in self._loads
                 if load.future.done() or now - load.started > self.load_timeout_s]
        if not ended:
            return
        done = []
        for load in ended:
            try:
                done.append(load.future.done() and self._land(load))
            except Exception as error:  # a copy that failed: the blocks are recomputed
                log.warning("atb-mem: landing a load failed: %s", error)
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
        with self._counting:
            for _, tier in payloads:  # type: ignore[misc]
                counters.loaded_by_tier[tier] = counters.loaded_by_tier.get(tier, 0) + 1
            counters.loaded_blocks += len(load.blocks)
            counters.loaded_bytes += len(load.blocks) * self._block_bytes
            counters.load_seconds_sum += seconds
            for bucket, bound in enumerate(LOAD_SECONDS_BUCKETS):
                counters.load_seconds_buckets[bucket] += int(seconds <= bound)
        return True

    # ---- saves -----------------------------------------------------------------------------

    def save(self, plan: Any) -> None:
        """Writes the full blocks this step's rows completed through to every store. A save
        that fails is dropped (counted, logged): serving never stops for a tier."""
        try:
            self._save_rows(plan)
        except Exception as error:
            with self._counting:
                self._counters.dropped_saves += 1
            log.warning("atb-mem: saving blocks to the tiers below the host failed: %s", error)

    def _save_rows(self, plan: Any) -> None:
        block_size = self.kv_cache.block_size
        # Only rows whose step filled a block: a decode mostly does not (one array op, no
        # Python loop over the batch).
        after = np.asarray(plan.context_lens) // block_size
        before = (np.asarray(plan.context_lens) - np.asarray(plan.query_lens)) // block_size
        seq_ids = plan.seq_ids
        for row in np.flatnonzero(after > before).tolist():
            seq_id = int(seq_ids[row])
            known = self._hashes.get(seq_id)
            if known is None:
                continue
            hashes, saved, token_ids = known
            full = min(int(plan.context_lens[row]) // block_size, len(hashes))
            if full <= saved:
                continue
            table = self.kv_cache.block_table(seq_id)
            for index in range(saved, full):
                name = (hashes[index].tolist(),
                        hashes[index - 1].tolist() if index else None,
                        token_ids[index * block_size:(index + 1) * block_size])
                self._save_block(int(table[index]), block_key(self.identity, hashes[index]), name)
            self._hashes[seq_id] = (hashes, full, token_ids)

    def _save_block(self, block: int, key: str, name: tuple[Any, ...]) -> None:
        backend, staging = self._tensors.backend, self._staging
        backend.copy_blocks(staging, np.array([0]), self._tensors.kv, np.array([block]))
        with self._counting:
            if self._pending_saves >= MAX_PENDING_SAVES:
                self._counters.dropped_saves += 1
                return
            self._pending_saves += 1
        value = frame(bytes(backend.bytes_of(staging)), self.checksum)
        self._writer.submit(self._put, key, value, name)

    def _put(self, key: str, value: bytes, name: tuple[Any, ...]) -> None:
        """Writes one block through to every store; with KV events, says where it went (and
        what the disk evicted for it), so routers can score the tiers."""
        try:
            taken = [store for store in self.stores if store.put(key, value)]
        finally:
            with self._counting:
                self._pending_saves -= 1
                if self._pending_saves == 0:
                    self._saves_done.notify_all()
        if not taken:
            return
        with self._counting:
            counters = self._counters
            counters.saved_blocks += 1
            counters.saved_bytes += len(value)
            for store in taken:
                counters.saved_by_tier[store.name] = counters.saved_by_tier.get(store.name, 0) + 1
        if not self._events:
            return
        hash_words, parent, token_ids = name
        for store in taken:
            evicted: list[str] = getattr(store, "take_evicted", list)()
            if evicted:
                self.kv_cache._record_tier_event(
                    store.medium, False, [key_hash(old) for old in evicted], None, [])
            self.kv_cache._record_tier_event(store.medium, True, [hash_words], parent,
                                             token_ids)

    def wait_for_saves(self, timeout_s: float) -> bool:
        """Waits, at most ``timeout_s`` seconds, until every save handed to the writer has
        landed in the stores (or failed); returns whether it did. Serving never needs this:
        a block saved late is only a later hit."""
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
                or not 0 <= timeout_s < float("inf"):
            raise ValueError(f"timeout_s must be a finite number of seconds >= 0, got "
                             f"{timeout_s!r}")
        with self._saves_done:
            return self._saves_done.wait_for(lambda: self._pending_saves == 0, timeout_s)

    def close(self) -> None:
        self._workers.shutdown(wait=True, cancel_futures=False)
        self._writer.shutdown(wait=True, cancel_futures=False)
        for store in self.stores:
            store.close()

"""The save side of the ``TierConnector``: after each forward, the full blocks the step
completed (and, on a prefill, the blocks its prompt hit that some store lacked) are
copied to host memory at once, then put to the stores by one writer thread."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from atb_mem.kv.tiers.block_io import MAX_PENDING_PUTS, BlockWriter
from atb_mem.kv.tiers.counters import TierCounters
from atb_mem.kv.tiers.store import KVStore, block_key, key_hash

__all__ = ["MAX_PENDING_SAVES", "Prompt", "WriteThrough"]

log = logging.getLogger("atb_mem.tiers")

MAX_PENDING_SAVES = MAX_PENDING_PUTS
"""Saves queued for the writer beyond which new ones are dropped (counted)."""


@dataclass
class Prompt:
    """What the connector knows of a request's prompt."""

    hashes: np.ndarray
    token_ids: list[int]
    holders: list[list[KVStore]]
    """Per full block before the last token, the stores that held it when the request came."""
    reason: str
    """Why the device's and the host's hit stopped then (the miss the admission counts)."""
    offered: int = 0
    """The leading blocks offered to the scheduler (0: none)."""
    saved: int = 0
    """Leading full blocks written through (or found held by every store)."""


class WriteThrough:
    """What ``TierConnector`` writes through to its stores (its attributes, set there)."""

    kv_cache: Any
    stores: list[KVStore]
    identity: str
    checksum: bool
    _counters: TierCounters
    _counting: threading.Lock
    _writer: BlockWriter
    _tensors: Any
    _staging: Any
    _events: bool
    _prompts: dict[int, Prompt]

    def save(self, plan: Any) -> None:
        """Writes the full blocks this step's rows completed through to every store, and the
        blocks a prefill hit (on the device, the host or one store) to the stores that lacked
        them. A save that fails is dropped (counted, logged): serving never stops for a
        tier."""
        try:
            self._save_rows(plan)
        except Exception as error:
            with self._counting:
                self._counters.dropped_saves += 1
            log.warning("atb-mem: saving blocks to the tiers below the host failed: %s", error)

    def _save_rows(self, plan: Any) -> None:
        block_size = self.kv_cache.block_size
        # Only rows whose step filled a block, or prefills (what a prompt hit is a sighting,
        # so a hot prompt reaches the disk): a decode mostly is neither (array ops, no Python
        # loop over the batch).
        after = np.asarray(plan.context_lens) // block_size
        before = (np.asarray(plan.context_lens) - np.asarray(plan.query_lens)) // block_size
        seq_ids = plan.seq_ids
        rows = (after > before) | np.isin(seq_ids, plan.prefill_seq_ids)
        for row in np.flatnonzero(rows).tolist():
            seq_id = int(seq_ids[row])
            prompt = self._prompts.get(seq_id)
            if prompt is None:
                continue
            full = min(int(after[row]), len(prompt.hashes))
            if full <= prompt.saved:
                continue
            table = self.kv_cache.core.block_table(seq_id)  # per row: no Python frame
            hashes, token_ids = prompt.hashes, prompt.token_ids
            for index in range(prompt.saved, full):
                # Computed this step: to every store. Hit (before this step, never saved: its
                # first prefill): to the writable stores that lacked it when the request came,
                # so a block every store holds costs no copy.
                stores = self.stores if index >= min(before[row], len(prompt.holders)) else [
                    store for store in self.stores if store not in prompt.holders[index]
                    and getattr(store, "writable", True)]
                if not stores:
                    continue
                name = (hashes[index].tolist(),
                        hashes[index - 1].tolist() if index else None,
                        token_ids[index * block_size:(index + 1) * block_size])
                self._save_block(int(table[index]), block_key(self.identity, hashes[index]),
                                 name, stores)
            prompt.saved = full

    def _save_block(self, block: int, key: str, name: tuple[Any, ...],
                    stores: list[KVStore] | None = None) -> None:
        """Copies ``block`` out now and hands it to the writer for ``stores`` (default:
        every store)."""
        backend, staging = self._tensors.backend, self._staging
        backend.copy_blocks(staging, np.array([0]), self._tensors.kv, np.array([block]))
        stores = self.stores if stores is None else stores

        def then(taken: list[KVStore], framed: int) -> None:
            self._saved(key, name, taken, framed)

        if self._writer.submit(key, bytes(backend.bytes_of(staging)), stores, self.checksum,
                               then) is None:
            with self._counting:
                self._counters.dropped_saves += 1

    def _saved(self, key: str, name: tuple[Any, ...], taken: list[KVStore],
               framed: int) -> None:
        """Counts a block ``taken`` stores took (on the writer); with KV events, says where
        it went (and what the disk evicted for it), so routers can score the tiers."""
        with self._counting:
            counters = self._counters
            counters.saved_blocks += 1
            counters.saved_bytes += framed
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
        return self._writer.wait(timeout_s)

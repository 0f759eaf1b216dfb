"""The scheduler side of ``AtbMemConnector``: which tokens of a request the tiers serve, and
the moves each step makes. No vLLM in here (the connector converts its objects), so it is
tested against recorded call sequences.

Where the index lives, and why it cannot drift from the bytes: the host tier's index is a
``KVCachePool`` in vLLM's scheduler process, whose block ids *are* the host blocks of every
worker (each worker holds a preallocated buffer of the same number of blocks, for its own
shard). Workers never choose a block: they execute, in step order, the moves this side put
in the step's metadata. A block joins the index (``mark_computed``) in the step whose
metadata carries its save; any later step's load of it runs after that save on every worker,
because workers run steps in order, and within one step every load runs before every save
(``start_load_kv`` precedes ``wait_for_save``), so a block the index evicts and hands to a
save is read by this step's loads first. A request pins the host blocks it hit until it
ends. The disk and the store are asked which keys they hold; what they lose in between is a
failed load, which vLLM recomputes.

A request's life here:

- ``lookup`` (vLLM's ``get_num_new_matched_tokens``): its tokens are allocated in the index
  (hits pinned, at ``hash_block_size`` granularity: a hit ending inside a block is served by
  copying the cached block whole), then the disk and the store are asked for the blocks
  after the host's hit. A repeated lookup (not scheduled, or preempted) starts over.
- ``allocated`` (``update_state_after_alloc``): the loads into the request's vLLM blocks:
  host blocks synchronously before the forward, and disk blocks too where the request's
  load is all from the disk and small (``sync_disk_blocks``: no step spent waiting for
  them); larger disk loads and store loads asynchronously.
- ``build`` (``build_connector_meta``): the full blocks each scheduled request completes this
  step are saved once: vLLM block → its host block after the forward (then cached in the
  index), and put to the stores that lacked them (a host hit is a sighting too, so a hot
  prompt reaches the disk, which writes on its second sighting).
- ``finished`` (``request_finished``): its host blocks are unpinned; what was saved stays
  cached. Its last, partly filled block is copied to the host in the next step, vLLM
  holding the request's blocks until then; full blocks' saves run within their step.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from atb_mem._core import KVCachePool, OutOfMemoryError
from atb_mem.integrations.vllm.moves import HOST, Scheduled, TierMoves, VllmBlock, whole
from atb_mem.integrations.vllm.recent_blocks import BlockNames, Sightings
from atb_mem.integrations.vllm.store_lookups import StoreLookup, StoreLookups
from atb_mem.integrations.vllm.tier_request import TierRequest
from atb_mem.kv.retention import DEFAULT_PRIORITY, MAX_PRIORITY

__all__ = ["HOST", "Scheduled", "StoreLookup", "TierMoves", "TierScheduler"]


class TierScheduler:
    """The tiers' index and planner for vLLM blocks of ``block_size`` tokens.

    ``stores`` are lookup handles (``exists``) of the disk and the store, keyed per worker
    rank by ``identities`` (a block is held only when every rank's shard is)."""

    def __init__(self, *, block_size: int, hash_block_size: int, num_host_blocks: int,
                 eviction_policy: str, stores: Sequence[StoreLookup], identities: Sequence[str],
                 enable_kv_events: bool = False, disk_min_seen: int = 1, loads: bool = True,
                 saves: bool = True, sync_disk_blocks: int = 0) -> None:
        self.block_size = block_size
        # A request's load of at most this many disk blocks, and nothing from the store, runs
        # before the forward that reads it: vLLM schedules the request at once.
        self.sync_disk_blocks = sync_disk_blocks
        # vLLM's kv_role: a prefill server (kv_producer) saves and never loads, a decode
        # server (kv_consumer) loads and never saves.
        self.loads, self.saves = loads, saves
        self._sightings = Sightings(disk_min_seen)
        self.stores = list(stores)
        # Stores a worker said stopped taking blocks (full, read-only): no puts planned.
        self._stopped: frozenset[str] = frozenset()
        self.host = num_host_blocks > 0
        # Block 0 is the index's null block; without a host tier it only hashes.
        self.index = KVCachePool(num_host_blocks + 1 if self.host else 2, block_size,
                                 hash_block_size=hash_block_size,
                                 eviction_policy=eviction_policy,  # type: ignore[arg-type]
                                 enable_kv_events=enable_kv_events)
        # The longest sequence the index can hold: it raises ValueError, not
        # OutOfMemoryError, for a longer one.
        self._max_tokens = num_host_blocks * block_size
        self._requests: dict[str, TierRequest] = {}
        self._seq_ids = itertools.count(1)
        self._pending = TierMoves()
        self._epoch = 0
        self.lookups = StoreLookups(stores, identities)
        self.enable_kv_events = enable_kv_events
        self.names = BlockNames()
        """What the blocks put to the stores hold, for the workers' KV events."""
        self.counters: dict[str, float] = {"lookups": 0, "host_full": 0, "hit_tokens": 0,
                                         "store_errors": 0}
        self._errors_seen = 0

    # ---- a request arrives (or comes back) --------------------------------------------------

    def lookup(self, req_id: str, tokens: Sequence[int], num_computed_tokens: int,
               salt: str | None = None, priority: int = 0) -> tuple[int, bool]:
        """Tokens past vLLM's ``num_computed_tokens`` (block aligned) the tiers serve, and
        whether any come from the disk or the store (an asynchronous load). Under the
        ``priority`` eviction policy, vLLM's request ``priority`` (lower runs first) sets
        how long its blocks stay in the host tier: retention 35 − ``priority``, in 0..100.

        vLLM asks again each step for a request it could not admit: while nothing changed,
        the answer is the last one, whose blocks the request still pins (any copy it
        needed ran in that step)."""
        asked = (len(tokens), num_computed_tokens, salt, priority)
        request = self._requests.get(req_id)
        if request is not None and not request.committed and request.asked[:4] == asked:
            answer: tuple[int, bool] = request.asked[4]
            return answer
        self._release(req_id)
        self.counters["lookups"] += 1
        if self._epoch:  # keys before the first reset are the engine's own
            salt = repr((self._epoch, salt))
        snapshot = list(tokens)
        block_size, count = self.block_size, len(snapshot)
        most = (count - 1) // block_size if count else 0
        hashes = self.index.block_hashes(snapshot, cache_salt=salt) if count else \
            np.zeros((0, 2), np.uint64)
        seq_id: int | None = None
        host_hit, table = 0, []
        if self.host and count:
            seq_id = next(self._seq_ids)
            try:
                host_hit = self._alloc_host(seq_id, snapshot, salt)
            except OutOfMemoryError:  # no room even for its hit: served by the stores only
                seq_id = None
            else:
                table = self.index.block_table(seq_id).tolist()
                if priority and self.index.eviction_policy == "priority":
                    retention = min(max(DEFAULT_PRIORITY - priority, 0), MAX_PRIORITY)
                    self.index.set_retention(seq_id, [], default_priority=retention)
                # Executed in this step before any save: the source, cached but not
                # pinned, keeps its bytes until then.
                self._pending.host_copies.extend(
                    (int(src), int(dst)) for src, dst in self.index.take_pending_copies())
        host_whole = host_hit // block_size
        holders = self.lookups.holders(hashes[:most])
        after = holders[host_whole:]
        run = next((at for at, held in enumerate(after) if not held), len(after))
        # A whole block from a store brings the pieces the host's copy has.
        total = (host_whole + run) * block_size if run else host_hit
        partial = not run and host_hit % block_size > 0
        self._requests[req_id] = TierRequest(
            tokens, salt, seq_id, hashes, num_computed_tokens, table, host_whole, partial,
            holders, run)
        external = max(0, total - num_computed_tokens) if self.loads else 0
        first = max(host_whole, num_computed_tokens // block_size)
        loads_stores = external > 0 and host_whole + run > first and run > 0
        request = self._requests[req_id]
        request.loads_now = loads_stores and host_whole + run - first <= self.sync_disk_blocks \
            and all(held[0] == "DISK" for held in holders[first:host_whole + run])
        answer = (external, loads_stores and not request.loads_now)
        request.asked = (*asked, answer)
        return answer

    def _alloc_host(self, seq_id: int, tokens: list[int], salt: str | None) -> int:
        """Allocates the request's sequence in the host index; returns the host's hit. The
        whole prompt where it fits (its blocks are saved to the host as they are computed);
        else (longer than the tier, or its blocks pinned) the hit and one token past it, so
        that the hit is still served and only the rest goes unsaved to the host. Raises
        OutOfMemoryError where not even that fits."""
        if len(tokens) <= self._max_tokens:
            try:
                return self.index.alloc_sequence(seq_id, tokens, cache_salt=salt)
            except OutOfMemoryError:
                pass
        self.counters["host_full"] += 1
        hit = self.index._explain_prefix(tokens, cache_salt=salt)[0]
        pinned = min(hit + 1, self._max_tokens)  # the sequence the tier can hold at most
        if not hit or pinned < 2:
            raise OutOfMemoryError("no host hit to pin")
        return self.index.alloc_sequence(seq_id, tokens[:pinned], cache_salt=salt)

    def allocated(self, req_id: str, block_ids: Sequence[VllmBlock], num_external_tokens: int
                  ) -> None:
        """vLLM gave the request ``block_ids`` and takes ``num_external_tokens`` from the tiers
        (which may be fewer than offered): plans their loads."""
        request = self._requests.get(req_id)
        if request is None:
            return
        request.vllm_blocks = list(block_ids)
        if request.committed:  # the second call, once an asynchronous load ended
            return
        request.committed = True
        if num_external_tokens <= 0:
            return
        block_size = self.block_size
        begin, end = request.num_computed, request.num_computed + num_external_tokens
        for index in range(begin // block_size, -(-end // block_size)):
            tokens = min(end, (index + 1) * block_size) - max(begin, index * block_size)
            target = request.vllm_blocks[index]
            if index < request.host_whole + request.partial:
                tier = HOST
                self._pending.host_loads.append((request.host_table[index], target))
            else:
                tier = request.holders[index][0]
                words = (int(request.hashes[index][0]), int(request.hashes[index][1]))
                loads = self._pending.disk_loads if request.loads_now else \
                    self._pending.store_loads
                loads.setdefault(req_id, []).append((*words, target))
                self.lookups.loading(req_id, words, target)
                request.loading.append((index, tier, tokens))
            request.hit_tokens[tier] = request.hit_tokens.get(tier, 0) + tokens
        if not request.loading:  # the host's copies land (with other loads: once they end)
            self.counters["hit_tokens"] += request.hit_tokens.get(HOST, 0)

    def hit_tokens(self, req_id: str) -> dict[str, int]:
        """The tokens each tier served the request (its last admission)."""
        request = self._requests.get(req_id)
        return dict(request.hit_tokens) if request is not None else {}

    # ---- each step --------------------------------------------------------------------------

    def build(self, scheduled: Iterable[Scheduled], idle: bool = False) -> TierMoves:
        """The step's moves: the loads planned since the last step, then the saves and puts
        of the full blocks the scheduled requests complete in it."""
        moves, self._pending = self._pending, TierMoves()
        moves.idle = idle
        for step in scheduled:
            request = self._requests.get(step.req_id)
            if request is None:
                continue
            if step.new_block_ids is not None:
                if step.resumed:
                    request.vllm_blocks = list(step.new_block_ids)
                else:
                    request.vllm_blocks.extend(step.new_block_ids)
            end = step.num_computed_tokens + step.num_scheduled_tokens
            full = min(end, len(request.tokens)) // self.block_size
            if request.saves_end is not None:
                full = min(full, request.saves_end)
            full = min(full, len(request.vllm_blocks))
            if full > request.saved:
                self._plan_saves(request, full, moves)
        return moves

    def _plan_saves(self, request: TierRequest, full: int, moves: TierMoves) -> None:
        if not self.saves:
            request.saved = full
            return
        block_size = self.block_size
        known = len(request.hashes)
        if known < full:  # a decode filled blocks: hashed on from the last known one
            after = request.tokens[known * block_size:full * block_size]
            more = self.index.block_hashes(
                list(after), cache_salt=None if known else request.salt,
                parent=[int(word) for word in request.hashes[-1]] if known else None)
            request.hashes = np.concatenate([request.hashes, more])
        if request.seq_id is not None:
            self._extend(request, full * block_size)
        host = request.seq_id is not None
        # A save reads vLLM's block (past the host's hit, or with no host tier): all of it.
        unsaved = next((index for index in range(request.saved, full)
                        if (not host or index >= request.host_whole)
                        and not whole(request.vllm_blocks[index])), None)
        if unsaved is not None:
            request.saves_end = full = unsaved
        for index in range(request.saved, full):
            if host and index >= request.host_whole:
                moves.saves.append((request.vllm_blocks[index], request.host_table[index]))
            held = request.holders[index] if index < len(request.holders) else ()
            lacking = tuple(store.name for store in self.stores if store.name not in held
                            and store.name not in self._stopped
                            and (store.name != "DISK"
                                 or self._sightings.sighted(request.hashes[index])))
            if lacking:
                words = request.hashes[index]
                block = request.host_table[index] if host else request.vllm_blocks[index]
                moves.puts.append((host, block, int(words[0]), int(words[1]), lacking))
                if self.enable_kv_events:
                    self.names.add(request.hashes, index, request.tokens, block_size)
        if host:
            self.index.mark_computed(request.seq_id, full * block_size)  # type: ignore[arg-type]
        request.saved = full

    def _extend(self, request: TierRequest, tokens: int) -> bool:
        """Grows the request's index sequence to ``tokens`` (its decoded blocks); where the
        index is full, the request stops saving to the host (what it saved stays): False."""
        seq_id = request.seq_id
        assert seq_id is not None
        length = self.index.seq_len(seq_id)
        if tokens <= length:
            return True
        try:
            if tokens > self._max_tokens:
                raise OutOfMemoryError("longer than the host tier")
            self.index.append_tokens([seq_id], tokens - length,
                                     token_ids=list(request.tokens[length:tokens]))
        except OutOfMemoryError:
            self.counters["host_full"] += 1
            self.index.free_sequence(seq_id)
            request.seq_id = None
            return False
        request.host_table = self.index.block_table(seq_id).tolist()
        return True

    # ---- a request ends ---------------------------------------------------------------------

    def finished(self, req_id: str, num_computed: int | None = None) -> bool:
        """The request ended: its host blocks unpinned, its last block's whole pieces saved
        to the host. Returns whether vLLM must keep its blocks until a worker says the tail
        was copied (``finished_sending``): vLLM may run the next step's forward, which could
        write a freed block, before that step's ``start_load_kv``. Full blocks' saves run
        within their step, so nothing else is held."""
        request = self._requests.get(req_id)
        tail = request is not None and num_computed is not None and \
            self._save_tail(req_id, request, num_computed)
        self._release(req_id)
        return tail

    def _save_tail(self, req_id: str, request: TierRequest, computed: int) -> bool:
        """The last block's copy into the host, where it holds a whole piece and every full
        block before it was saved (the index keeps its pieces once the sequence is freed);
        not while a load of the request is in flight (its blocks' bytes are not known yet)."""
        index, tail = divmod(computed, self.block_size)
        if not self.saves or request.seq_id is None or request.loading or \
                tail < self.index.hash_block_size or index != request.saved or \
                index >= len(request.vllm_blocks) or computed > len(request.tokens) or \
                computed > self._max_tokens or not whole(request.vllm_blocks[index]):
            return False
        if not self._extend(request, computed):  # the index is full
            return False
        self._pending.tail_saves.append((req_id, request.vllm_blocks[index],
                                         request.host_table[index]))
        self.index.mark_computed(request.seq_id, computed)
        return True

    def _release(self, req_id: str) -> None:
        request = self._requests.pop(req_id, None)
        if request is not None and request.seq_id is not None:
            # What stays cached is what the index counts computed: the hits, the copied
            # pieces and the blocks whose saves were planned, each in a step's moves.
            self.index.free_sequence(request.seq_id)

    def loads_ended(self, finished: Iterable[str], failed_blocks: Iterable[VllmBlock],
                    failed_requests: Iterable[str] = ()) -> None:
        """What the workers reported (see ``StoreLookups.loads_ended``). The tokens a
        request's loads served count now: vLLM recomputes from its first failed block on,
        so those and the ones after it were not served; from a request that failed (with
        several KV-cache groups), none."""
        finished, failed = set(finished), set(failed_blocks)
        failed_requests = set(failed_requests)
        for req_id in failed_requests:
            request = self._requests.get(req_id)
            if request is not None:
                failed.update(request.vllm_blocks[index] for index, _, _ in request.loading)
        self.lookups.loads_ended(finished, failed)
        for req_id in finished:
            request = self._requests.get(req_id)
            if request is None or not request.loading:
                continue
            if req_id in failed_requests:  # vLLM recomputes it whole: the host's part too
                request.hit_tokens.pop(HOST, None)
            else:
                self.counters["hit_tokens"] += request.hit_tokens.get(HOST, 0)
            served = True
            for index, tier, tokens in request.loading:
                served = served and request.vllm_blocks[index] not in failed
                if served:
                    self.counters["hit_tokens"] += tokens
                elif request.hit_tokens.get(tier, 0) > tokens:
                    request.hit_tokens[tier] -= tokens
                else:
                    request.hit_tokens.pop(tier, None)
            request.loading = []

    def stop_saving(self, stores: Iterable[str]) -> None:
        """No more puts to ``stores`` (their names): a worker said they stopped taking
        blocks. Their loads go on."""
        self._stopped |= frozenset(stores)

    def take_counters(self) -> dict[str, float]:
        """The counts since the last call (a store's failed lookups in ``store_errors``)."""
        errors = sum(getattr(store, "errors", 0) for store in self.stores)
        self.counters["store_errors"] += errors - self._errors_seen
        self._errors_seen = errors
        counters = {name: amount for name, amount in self.counters.items() if amount}
        self.counters = dict.fromkeys(self.counters, 0)
        return counters

    def reset(self) -> None:
        """Nothing cached so far is served again: every key from now on carries a new
        epoch (the stores' old blocks are never asked for; the host's age out)."""
        self._epoch += 1

    def close(self) -> None:
        for store in self.stores:
            store.close()

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def take_events(self) -> Any:
        """The host index's KV events since the last call."""
        return self.index.take_events()

"""Continuous batching over a ``KVCachePool`` (what Orca and vLLM's scheduler do).

The policy lives in the Rust core (deterministic: the time is an argument); ``step()`` is one
call into it that returns every decision and array the model runner needs.
"""

from __future__ import annotations

import time
from typing import Any, cast

import numpy as np

from atb_mem import _core
from atb_mem._types import ContinuousBatchSchedulerStats, ContinuousSchedulerConfig, Preemption
from atb_mem.kv.cache_pool import KVCachePool
from atb_mem.kv.retention import Retention
from atb_mem.scheduling._settings import merged_settings
from atb_mem.scheduling._times import SECOND_NS, to_ns

__all__ = ["ContinuousBatchScheduler", "StepPlan"]


# One step's decisions and a model runner's inputs (a frozen class of the extension):
# rows are the scheduled sequences, prefills first, then decodes; ``query_lens``,
# ``context_lens`` (= ``seq_lens``) and ``block_tables`` follow the rows; ``input_ids`` (-1
# where the request gave a token count), ``positions`` and ``slot_mapping`` follow the rows'
# tokens, and ``query_start_loc`` (``[rows + 1]``) says where each row's tokens start;
# ``logits_indices[i]`` is the flat index of the last token of ``sample_seq_ids[i]``.
# ``moves`` is int32 ``[k, 3]`` (kind, source, destination) in execution order, executed
# already when the cache holds bytes (``copies``, ``swap_out``, ``swap_in`` are the same as
# pairs by kind). ``block_tables`` is a read-only view of a buffer updated in place: valid
# until the next step. The contract: a plan is executed, every row, before the next
# ``step()`` or ``on_tokens()``.
StepPlan = _core.StepPlan


_SETTINGS = ("max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill", "preemption",
             "watermark")


class ContinuousBatchScheduler:
    """Decides, step by step, which sequences prefill (in chunks), which decode, and which are
    preempted, over ``kv_cache``'s blocks.

    Admission happens only when a request's blocks are there (free plus evictable, minus
    ``watermark`` of the cache). When a decode needs a block and none is free, the newest,
    lowest-priority running sequence is preempted: ``preemption="recompute"`` frees its blocks
    and requeues it at the front; ``"swap"`` moves it to the cache's host tier (falling back to
    recompute when the tier is full). Preempted sequences resume before anything new is
    admitted, so none starves. After the model ran, report the sampled tokens of
    ``plan.sample_seq_ids`` with ``on_tokens``; a sequence finishes at ``max_new_tokens`` (or
    ``eos_token_id``), or with ``finish``/``abort``.
    """

    def __init__(self, kv_cache: KVCachePool, *, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, enable_chunked_prefill: bool = True,
                 preemption: Preemption = "recompute", watermark: float = 0.01,
                 eos_token_id: int | None = None) -> None:
        self.kv_cache = kv_cache
        self.eos_token_id = eos_token_id
        # A KVCachePool's core; anything else is the core's to refuse (TypeError).
        core_cache: Any = getattr(kv_cache, "core", kv_cache)
        self._core = _core.ContinuousScheduler(core_cache, {
            "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
            "enable_chunked_prefill": bool(enable_chunked_prefill), "preemption": preemption,
            "watermark": watermark})
        self._new_settings: ContinuousSchedulerConfig | None = None
        self._finished = 0
        self._last_batch = (0, 0)  # (sequences, tokens) of the last step

    # ---- requests --------------------------------------------------------------------------

    def add_request(self, seq_id: int, prompt: Any, max_new_tokens: int, *, priority: int = 0,
                    arrival_time: float | None = None, num_samples: int = 1,
                    retention: Retention | None = None) -> None:
        """Queues a request. ``prompt`` is a token count or the token ids (prefix-cache hits
        then count as computed). Lower ``priority`` numbers go first (and, with the priority
        eviction policy, a priority ``p`` lowers the retention of its blocks by ``p``).
        ``arrival_time`` is in the clock ``step(now=...)`` uses; the request is not admitted
        before it (default: at once). ``num_samples`` sequences will be forked from it at its
        first token (``fork``): it is admitted when there are seats for all of them under
        ``max_num_seqs``. ``retention``: what it asks the prefix cache to keep.

        Refused (``ValueError``, nothing changed) if it could never be scheduled, under the
        settings in force or under a change ``reconfigure`` has not applied yet."""
        arrival_ns = 0 if arrival_time is None else to_ns("arrival_time", arrival_time,
                                                          SECOND_NS, "seconds")
        if self._new_settings is not None:
            self._core.check_request(self._new_settings, seq_id, prompt, max_new_tokens,
                                     num_samples)
        if retention is not None and not isinstance(retention, Retention):
            raise TypeError(f"retention must be a Retention, got {type(retention).__name__}")
        self._core.add_request(seq_id, prompt, max_new_tokens, priority, arrival_ns,
                               num_samples)
        if retention is not None:
            ranges, decode, default = retention.core_args()
            try:
                self._core.set_retention(seq_id, ranges, decode=decode, default_priority=default)
            except BaseException:
                self._core.abort(seq_id)  # all or nothing
                raise

    def step(self, now: float | None = None) -> StepPlan:
        """Plans the next step and, if the cache holds bytes, executes its block moves — one
        call into the core, holding the cache's lock throughout. All-or-nothing: if moving
        the bytes raises, nothing changed but the requests named by the ``BlockMoveError``
        (ended: their bytes were lost)."""
        # Checked before the pending settings apply: a refused step changes nothing.
        now_ns = to_ns("now", time.monotonic() if now is None else now, SECOND_NS, "seconds")
        pending = self._new_settings
        previous = self._apply_new_settings()
        try:
            plan = self._core.step(now_ns, self.kv_cache.executor)
        except BaseException:
            # All-or-nothing: the settings wait for the next step too.
            if previous is not None:
                self._core.set_config(previous)
                self._new_settings = pending
            raise
        self._last_batch = (len(plan), plan.num_batched_tokens)
        return plan

    def on_tokens(self, seq_ids: Any, new_token_ids: Any) -> np.ndarray:
        """Records the tokens sampled for ``seq_ids`` (``plan.sample_seq_ids``); returns the
        ids of the sequences that finished (their blocks are freed)."""
        finished = self._core.on_tokens(seq_ids, new_token_ids, self.eos_token_id)
        self._finished += len(finished)
        return finished

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        """Parallel sampling: after a step sampled ``parent_seq_id`` and before ``on_tokens``,
        ``child_seq_id`` becomes its copy, sharing its blocks copy-on-write; report a token
        for both. The prompt is prefilled once for every sample."""
        self._core.fork(parent_seq_id, child_seq_id)

    def finish(self, seq_id: int) -> None:
        """Ends a sequence now (a stop string, a client that has enough) and frees it."""
        self._core.abort(seq_id)
        self._finished += 1

    def abort(self, seq_id: int) -> None:
        """Cancels a request wherever it is and frees its blocks."""
        self._core.abort(seq_id)

    # ---- lower tiers (a disk tier, a store shared across engines) --------------------------

    def offer_external_prefix(self, seq_id: int, num_blocks: int) -> None:
        """Lower tiers hold the first ``num_blocks`` full blocks of waiting request
        ``seq_id`` (looked up by ``kv_cache.block_hashes``). Its admission loads the part the
        device and the host do not hold (``plan.load_seq_ids`` / ``load_blocks`` /
        ``load_keys``), and the request waits, holding its blocks, until ``finish_loads``."""
        self._core.offer_external_prefix(seq_id, num_blocks)

    def finish_loads(self, seq_ids: Any, done: Any) -> None:
        """Reports loads: where ``done[i]``, request ``seq_ids[i]``'s blocks count as
        computed; elsewhere they are recomputed. Every load a plan gave must be reported,
        failed or not (time it out if it never ends): its blocks come back only then."""
        self._core.finish_loads(seq_ids, [bool(flag) for flag in done])

    def progress(self, seq_id: int) -> tuple[int, int, int]:
        """(prompt length, tokens sampled so far, max_new_tokens)."""
        return self._core.progress(seq_id)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._core

    def stats(self) -> ContinuousBatchSchedulerStats:
        batch_size, batch_tokens = self._last_batch
        return {**self._core.counts(), "finished": self._finished,
                "last_batch_size": batch_size, "last_batch_tokens": batch_tokens}

    # ---- configuration ---------------------------------------------------------------------

    @property
    def config(self) -> ContinuousSchedulerConfig:
        return self._core.config()

    def reconfigure(self, **changes: Any) -> ContinuousSchedulerConfig:
        """Changes settings while requests flow: validated now (a bad value changes nothing
        and raises), applied at the next step. A change under which a request already in
        the scheduler could never run (a watermark that leaves it no room, a
        ``max_num_seqs`` below its samples) is refused. Returns the previous
        configuration."""
        new = self.check_settings(**changes)
        # What the next step would have run with: an earlier change not yet applied counts.
        previous = self._new_settings or self.config
        self._new_settings = new
        return previous

    def check_settings(self, **changes: Any) -> ContinuousSchedulerConfig:
        """The configuration ``changes`` would make, validated (``ValueError``/``TypeError``
        otherwise); changes nothing."""
        # Checked on the next line: the core refuses a missing, extra or ill-typed setting.
        new = cast(ContinuousSchedulerConfig,
                   merged_settings(_SETTINGS, self._new_settings or self.config, changes))
        self._core.check_config(new)  # against the requests queued and running, too
        return new

    def _apply_new_settings(self) -> ContinuousSchedulerConfig | None:
        """Applies the pending settings; returns the ones they replaced (None if none)."""
        if self._new_settings is None:
            return None
        new, self._new_settings = self._new_settings, None
        return self._core.set_config(new)

    def _check_invariants(self) -> None:
        self._core._check_invariants()



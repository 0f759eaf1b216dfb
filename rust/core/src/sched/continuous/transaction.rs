//! One step as one transaction: check, plan, execute the plan's block moves, commit — or
//! put everything back.
//!
//! Checking reads only, so a step that fails there has nothing to undo. Planning changes the
//! scheduler and the cache; a snapshot to undo it costs several steps (a clone of every
//! request and sequence), so it is taken only when the step may move blocks. Otherwise
//! planning cannot fail: every lookup it makes was checked, and the caller holds both for
//! the whole step. Debug builds assert that no step fails part-way without a snapshot, which
//! every test then checks.

use super::{ContinuousScheduler, Preemption, StepPlan};
use crate::error::{CoreError, CoreResult};
use crate::kv_cache::{BlockMove, KvCache, MoveFailure};

impl ContinuousScheduler {
    /// [`ContinuousScheduler::step_executing`] with the moves left in `plan.moves` for the
    /// caller, who executes them before the plan's kernels run.
    pub fn step(
        &mut self,
        cache: &mut KvCache,
        now_ns: u64,
        plan: &mut StepPlan,
    ) -> CoreResult<()> {
        self.step_executing(cache, now_ns, plan, |_| Ok(()))
    }

    /// Plans one step at time `now_ns` into `plan` (cleared first), executes its block moves
    /// with `execute`, in order, and commits: one transaction.
    ///
    /// Fails, changing nothing, if the cache no longer holds what the scheduler put there
    /// (see `check_cache`). If executing fails, the scheduler and the cache go back to where
    /// they were before the step, less the requests whose bytes were lost: those end (the
    /// next plan reports them finished) and [`CoreError::MovesFailed`] names them.
    pub fn step_executing<E>(
        &mut self,
        cache: &mut KvCache,
        now_ns: u64,
        plan: &mut StepPlan,
        mut execute: E,
    ) -> CoreResult<()>
    where
        E: FnMut(&[BlockMove]) -> Result<(), MoveFailure>,
    {
        self.check_cache(cache, now_ns)?;
        let before = self
            .step_may_move(cache)
            .then(|| (self.clone(), cache.clone()));
        // The last step's kernels have run: its blocks may be copied from now. (After the
        // snapshot: a step that fails and goes back leaves them deferred, and the clock, as
        // it found them.)
        cache.publish_sub_blocks();
        cache.advance_clock(now_ns);
        cache.defer_sub_blocks(true);
        let planned = self.plan_step(cache, now_ns, plan);
        cache.defer_sub_blocks(false);
        if let Err(error) = planned {
            debug_assert!(
                before.is_some(),
                "a step failed part-way with no snapshot to go back to: {error}"
            );
            if let Some((scheduler, cache_before)) = before {
                *self = scheduler;
                *cache = cache_before;
            }
            plan.clear();
            return Err(error);
        }
        if plan.moves.is_empty() {
            return Ok(());
        }
        // Checked whether or not executing fails, so that every test run catches it.
        let only_saves = self.saved_moves == plan.moves.len();
        debug_assert!(
            before.is_some() || only_saves,
            "a step moved blocks that step_may_move did not foresee: {:?}",
            plan.moves
        );
        let Err(MoveFailure { attempted }) = execute(&plan.moves) else {
            return Ok(());
        };
        if before.is_none() && only_saves {
            self.drop_failed_saves(cache, plan);
            return Ok(());
        }
        // Unforeseen moves would be a bug; recovering against the step's own state still
        // ends every request whose blocks they wrote.
        let before = before.unwrap_or_else(|| (self.clone(), cache.clone()));
        let attempted = attempted.min(plan.moves.len());
        let mut aborted = Vec::new();
        self.recover_from_failed_moves(cache, before, &plan.moves, attempted, &mut aborted);
        plan.clear();
        Err(CoreError::MovesFailed { attempted, aborted })
    }

    /// A step whose only moves save checkpoints of recurrent states, and whose executor
    /// failed, goes on without them: the checkpoints are forgotten (nothing else wrote or
    /// read their blocks), the step's plan stands, and no snapshot was needed — cloning the
    /// scheduler and a large cache at every step that keeps a checkpoint cost the decode
    /// step several times over (`benches/recurrent_checkpoints.py`).
    fn drop_failed_saves(&mut self, cache: &mut KvCache, plan: &mut StepPlan) {
        cache.forget_checkpoints(&plan.moves);
        plan.moves.clear();
        self.saved_moves = 0;
    }

    /// Whether the next step may decide block moves (and so needs a snapshot to roll back to
    /// if executing them fails): moves already pending, a swap-in, a swap preemption (some
    /// decode may find no free block), a copy-on-write (only after a fork), or, with a host
    /// prefix cache, a promotion (an admission while the host tier holds prefixes) or a
    /// demotion (an allocation that may evict a cached block).
    fn step_may_move(&self, cache: &KvCache) -> bool {
        // A decode may need a block and a copy in each group; a prefill chunk, blocks in each
        // windowed group: either may preempt by swapping out, beyond the blocks kept for
        // forks.
        let decode_need =
            self.running.len() * 2 * cache.num_groups() + self.blocks_for_forks(cache);
        let windowed = cache.groups().iter().any(|g| g.kind.is_windowed());
        if cache.host_prefix_cache() {
            // Admissions: waiting or swapped requests, or requests a lowered max_num_seqs
            // preempts. Cached blocks: the device's, the host's, or those the aborts left
            // to free at the step's start.
            let admits = !self.waiting.is_empty()
                || !self.swapped.is_empty()
                || self.running.len() + self.loading.len() > self.config.max_num_seqs;
            let chunk_need = match windowed {
                true => {
                    self.config
                        .max_num_batched_tokens
                        .div_ceil(cache.block_size())
                        * cache.num_groups()
                }
                false => 0,
            };
            let uncached_free = cache.num_free_blocks() - cache.block_pool().num_evictable();
            let evictable = cache.block_pool().num_evictable() > 0;
            // A windowed group releases the cached blocks its window leaves as the step
            // computes tokens: they can be evicted (and demoted) before the step ends, by
            // the request that released them too, admitted in this step or running.
            let has_ids = |id: &u64| self.requests.get(id).is_some_and(|request| request.has_ids);
            let windows_release = windowed
                && (self.running.iter().any(has_ids)
                    || self.waiting.iter().any(|(_, _, id)| has_ids(id)));
            let cached_anywhere = evictable
                || windows_release
                || cache.num_host_cached_blocks() > 0
                || !self.deferred_frees.is_empty();
            // Short of free blocks, a decode or a prefill evicts a cached block: one there
            // now, one an aborted request's deferred free leaves at the step's start, or one
            // a preempted request with token ids leaves behind.
            let may_evict =
                || evictable || !self.deferred_frees.is_empty() || self.running.iter().any(has_ids);
            if (admits && cached_anywhere)
                || (uncached_free < decode_need + chunk_need && may_evict())
            {
                return true;
            }
        }
        // Resuming from a checkpoint of recurrent states is a copy. Saving one needs no
        // snapshot (see `drop_failed_saves`), unless a host prefix cache demotes what the
        // save evicts, or what a decode evicts once the save took the uncached blocks.
        if cache.checkpoint_stride() > 0
            && ((!self.waiting.is_empty() && cache.block_pool().num_cached() > 0)
                || (cache.host_prefix_cache()
                    && self.running.iter().any(|&id| cache.checkpoint_due(id))))
        {
            return true;
        }
        // An admission whose prompt shares the first pieces of a cached block (a full one,
        // or an ended sequence's last block, cached by its pieces) copies them.
        let pool = cache.block_pool();
        let sub_block_hits = cache.hash_block_size() < cache.block_size()
            && !self.waiting.is_empty()
            && pool.num_cached() + pool.num_piece_blocks() > 0;
        if sub_block_hits {
            return true;
        }
        let prefilling = || {
            self.running.iter().any(|&id| {
                let computed = self.requests.get(&id).map_or(0, |r| r.num_computed);
                cache.seq_len(id).is_ok_and(|len| computed < len)
            })
        };
        cache.num_pending_moves() > 0
            || !self.swapped.is_empty()
            || cache.has_forked()
            || (self.config.preemption == Preemption::Swap
                && cache.num_free_host_blocks() > 0
                && (cache.num_free_blocks() < decode_need
                    || self.running.len() > self.config.max_num_seqs
                    || (windowed && prefilling())))
    }

    /// Puts the scheduler and `cache` back to `snapshot` (taken before a step) after
    /// executing the step's `moves` failed with the first `attempted` possibly run. Requests
    /// whose bytes the partial execution destroyed end; their ids go to `aborted`.
    fn recover_from_failed_moves(
        &mut self,
        cache: &mut KvCache,
        snapshot: (ContinuousScheduler, KvCache),
        moves: &[BlockMove],
        attempted: usize,
        aborted: &mut Vec<u64>,
    ) {
        let (scheduler, cache_snapshot) = snapshot;
        *self = scheduler;
        let first = aborted.len();
        cache.recover_from_failed_moves(cache_snapshot, moves, attempted, aborted);
        for &seq_id in &aborted[first..] {
            if self.forget(seq_id).is_some() {
                self.finished_since_plan.push(seq_id);
            }
        }
    }
}

//! One step as one transaction: check, plan, execute the plan's block moves, commit — or
//! put everything back.
//!
//! Checking reads only, so a step that fails there has nothing to undo. Planning changes the
//! scheduler and the cache, each of which records what it changes (see `crate::undo`): if
//! executing the step's moves fails, the records put back exactly that, at a cost that
//! follows what the step changed, not what the scheduler and the cache hold. No step has to
//! be foreseen as one that might move blocks.

use super::{ContinuousScheduler, StepPlan};
use crate::error::{CoreError, CoreResult};
use crate::kv_cache::{BlockMove, KvCache, MoveFailure};
use crate::undo::Undo;

impl ContinuousScheduler {
    /// Plans one step at time `now_ns` into `plan` (cleared first), its moves left in
    /// `plan.moves` for the caller, who executes them before the plan's kernels run.
    ///
    /// Fails, changing nothing, if the cache no longer holds what the scheduler put there
    /// (see `check_cache`). No failure of the moves reaches the scheduler (the caller runs
    /// them), so nothing is recorded to undo: a step costs its planning alone.
    pub fn step(
        &mut self,
        cache: &mut KvCache,
        now_ns: u64,
        plan: &mut StepPlan,
    ) -> CoreResult<()> {
        self.check_cache(cache, now_ns)?;
        let planned = self.plan_in(cache, now_ns, plan);
        debug_assert!(planned.is_ok(), "a checked step failed: {planned:?}");
        if planned.is_err() {
            plan.clear();
        }
        planned
    }

    /// Plans a checked step: the last step's kernels have run, so its blocks may be copied
    /// from now; the clock moves to `now_ns`; full blocks the plan completes get their
    /// sub-block keys once its kernels ran (the next step).
    fn plan_in(&mut self, cache: &mut KvCache, now_ns: u64, plan: &mut StepPlan) -> CoreResult<()> {
        cache.publish_sub_blocks();
        cache.advance_clock(now_ns);
        cache.defer_sub_blocks(true);
        let planned = self.plan_step(cache, now_ns, plan);
        cache.defer_sub_blocks(false);
        planned
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
        self.begin();
        cache.begin();
        // Inside the transaction: a step that fails leaves the deferred sub-block keys, and
        // the clock, as it found them.
        let planned = self.plan_in(cache, now_ns, plan);
        if let Err(error) = planned {
            // Checked lookups make this unreachable; the record makes it harmless.
            self.rollback();
            cache.rollback();
            plan.clear();
            return Err(error);
        }
        let failure = match plan.moves.is_empty() {
            true => Ok(()),
            false => execute(&plan.moves),
        };
        let Err(MoveFailure { attempted }) = failure else {
            self.commit();
            cache.commit();
            return Ok(());
        };
        if self.saved_moves == plan.moves.len() {
            self.commit();
            cache.commit();
            self.drop_failed_saves(cache, plan);
            return Ok(());
        }
        let attempted = attempted.min(plan.moves.len());
        let mut aborted = Vec::new();
        self.recover_from_failed_moves(cache, &plan.moves, attempted, &mut aborted);
        plan.clear();
        Err(CoreError::MovesFailed { attempted, aborted })
    }

    /// A step whose only moves save checkpoints of recurrent states, and whose executor
    /// failed, goes on without them: the checkpoints are forgotten (nothing else wrote or
    /// read their blocks) and the step's plan stands.
    fn drop_failed_saves(&mut self, cache: &mut KvCache, plan: &mut StepPlan) {
        cache.forget_checkpoints(&plan.moves);
        plan.moves.clear();
        self.saved_moves = 0;
    }

    /// Rolls the scheduler and `cache` back to where the step found them after executing
    /// the step's `moves` failed with the first `attempted` possibly run. Requests whose
    /// bytes the partial execution destroyed end; their ids go to `aborted`.
    fn recover_from_failed_moves(
        &mut self,
        cache: &mut KvCache,
        moves: &[BlockMove],
        attempted: usize,
        aborted: &mut Vec<u64>,
    ) {
        self.rollback();
        let first = aborted.len();
        cache.recover_from_failed_moves(moves, attempted, aborted);
        for &seq_id in &aborted[first..] {
            if self.forget(seq_id).is_some() {
                self.finished_since_plan.push(seq_id);
            }
        }
    }
}

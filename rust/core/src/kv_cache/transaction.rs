//! Plan → execute → commit: each compound operation that moves bytes is one transaction here,
//! with whoever owns the bytes passed in as the executor.
//!
//! The executor runs a list of [`BlockMove`]s in order, or reports how many of them may
//! have run ([`MoveFailure`]). A transaction plans (changing nothing if planning fails),
//! calls the executor, and commits; if the executor fails, the cache's undo record (see
//! `crate::undo`) puts back what the operation changed and the sequences whose bytes the
//! partial execution destroyed are ended ([`CoreError::MovesFailed`] names them). A call
//! that returns an error has therefore changed nothing but those endings.

use super::{BlockMove, KvCache, MoveKind};
use crate::error::{CoreError, CoreResult};
use crate::undo::Undo;

/// Executing block moves failed with the first `attempted` of them possibly run (the rest
/// certainly not). An executor that cannot tell reports all of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoveFailure {
    pub attempted: usize,
}

impl KvCache {
    /// Executes every pending move with `execute`, as one transaction; `executed` receives
    /// the moves (cleared first). Nothing pending: `execute` is not called.
    pub fn execute_pending_moves<E>(
        &mut self,
        execute: E,
        executed: &mut Vec<BlockMove>,
    ) -> CoreResult<()>
    where
        E: FnMut(&[BlockMove]) -> Result<(), MoveFailure>,
    {
        executed.clear();
        if self.tiers.pending_moves.is_empty() {
            return Ok(());
        }
        self.begin();
        self.execute_planned(execute, executed)
    }

    /// [`KvCache::swap_out`], then every pending move (earlier copies first) executed with
    /// `execute`, as one transaction; `executed` receives the moves.
    pub fn swap_out_executing<E>(
        &mut self,
        seq_ids: &[u64],
        execute: E,
        executed: &mut Vec<BlockMove>,
    ) -> CoreResult<()>
    where
        E: FnMut(&[BlockMove]) -> Result<(), MoveFailure>,
    {
        self.swap_executing(seq_ids, MoveKind::ToHost, execute, executed)
    }

    /// [`KvCache::swap_in`] as one transaction like [`KvCache::swap_out_executing`]; once
    /// the bytes are back, the sequences' full blocks may serve prefix hits again.
    pub fn swap_in_executing<E>(
        &mut self,
        seq_ids: &[u64],
        execute: E,
        executed: &mut Vec<BlockMove>,
    ) -> CoreResult<()>
    where
        E: FnMut(&[BlockMove]) -> Result<(), MoveFailure>,
    {
        self.swap_executing(seq_ids, MoveKind::ToDevice, execute, executed)?;
        for &seq_id in seq_ids {
            // Known swapped in: `swap_in` checked every id.
            let _ = self.mark_computed(seq_id, None);
        }
        Ok(())
    }

    fn swap_executing<E>(
        &mut self,
        seq_ids: &[u64],
        direction: MoveKind,
        execute: E,
        executed: &mut Vec<BlockMove>,
    ) -> CoreResult<()>
    where
        E: FnMut(&[BlockMove]) -> Result<(), MoveFailure>,
    {
        executed.clear();
        self.begin();
        let planned = self.swap(seq_ids, direction);
        if let Err(error) = planned {
            self.rollback();
            return Err(error);
        }
        self.execute_planned(execute, executed)
    }

    /// Readies a kernel's write into `slots`: checks that each lies in a block some sequence
    /// holds, then executes the pending moves (a copy-on-write copy must land before a write
    /// into its block, or the write is lost). The caller writes under the same lock.
    pub fn prepare_write<E>(&mut self, slots: &[i32], execute: E) -> CoreResult<()>
    where
        E: FnMut(&[BlockMove]) -> Result<(), MoveFailure>,
    {
        self.check_slots(slots)?;
        let mut executed = Vec::new();
        self.execute_pending_moves(execute, &mut executed)
    }

    /// In the transaction `begin` opened: takes the pending moves into `executed`, executes
    /// them and commits; on failure, rolls back less the damaged sequences.
    fn execute_planned<E>(
        &mut self,
        mut execute: E,
        executed: &mut Vec<BlockMove>,
    ) -> CoreResult<()>
    where
        E: FnMut(&[BlockMove]) -> Result<(), MoveFailure>,
    {
        self.take_moves(executed);
        let failure = match executed.is_empty() {
            true => Ok(()),
            false => execute(executed),
        };
        let Err(MoveFailure { attempted }) = failure else {
            self.commit();
            return Ok(());
        };
        let attempted = attempted.min(executed.len());
        let mut aborted = Vec::new();
        self.recover_from_failed_moves(executed, attempted, &mut aborted);
        Err(CoreError::MovesFailed { attempted, aborted })
    }
}

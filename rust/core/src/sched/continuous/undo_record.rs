//! The scheduler as one step's unit of undo (see `crate::undo`): its requests
//! (`request_table`) and queues (`queue`) record their own changes; its lists of ids (as
//! long as what runs) and its counters are kept here when the step begins.
//!
//! Debug builds also keep a whole copy at `begin` and check, at every rollback, that the
//! record put back exactly that.

use std::fmt;

use super::{ContinuousScheduler, LoadCounters};
use crate::undo::{Kept, Undo};

/// The scheduler's lists of ids and counters as the step found them.
#[derive(Clone, Default)]
pub(super) struct UndoRecord {
    /// Whether a step is open: a rollback outside one puts nothing back.
    open: bool,
    load_counters: LoadCounters,
    next_arrival: i64,
    next_front: i64,
    next_admission: u64,
    num_preemptions: u64,
    forked_since_step: usize,
    unforked_samples: usize,
    fork_reserve: usize,
    saved_moves: usize,
    running: Vec<u64>,
    loading: Vec<u64>,
    abandoned_loads: Vec<u64>,
    finished_since_plan: Vec<u64>,
    in_flight: Vec<u64>,
    deferred_frees: Vec<u64>,
    #[cfg(debug_assertions)]
    copy: Option<Box<ContinuousScheduler>>,
}

impl fmt::Debug for UndoRecord {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("_")
    }
}

impl ContinuousScheduler {
    /// What a step may change: the counters and lists, each kept in its place in the
    /// record, and the requests and queues, which record their own changes.
    fn undo_parts(&mut self) -> impl Undo + '_ {
        let record = &mut self.undo;
        let counters = (
            Kept(&mut self.load_counters, &mut record.load_counters),
            Kept(&mut self.next_arrival, &mut record.next_arrival),
            Kept(&mut self.next_front, &mut record.next_front),
            Kept(&mut self.next_admission, &mut record.next_admission),
            Kept(&mut self.num_preemptions, &mut record.num_preemptions),
            Kept(&mut self.forked_since_step, &mut record.forked_since_step),
            Kept(&mut self.unforked_samples, &mut record.unforked_samples),
            Kept(&mut self.fork_reserve, &mut record.fork_reserve),
            Kept(&mut self.saved_moves, &mut record.saved_moves),
        );
        let lists = (
            Kept(&mut self.running, &mut record.running),
            Kept(&mut self.loading, &mut record.loading),
            Kept(&mut self.abandoned_loads, &mut record.abandoned_loads),
            Kept(
                &mut self.finished_since_plan,
                &mut record.finished_since_plan,
            ),
            Kept(&mut self.in_flight, &mut record.in_flight),
            Kept(&mut self.deferred_frees, &mut record.deferred_frees),
        );
        let owners = (&mut self.requests, &mut self.waiting, &mut self.swapped);
        (counters, lists, owners)
    }

    /// The state a rollback must restore, as text (scratch buffers and the plan's block
    /// table, which describes the caller's buffer as the step left it, left out).
    #[cfg(debug_assertions)]
    fn state_text(&self) -> String {
        format!(
            "{:?}\n{:?}\n{:?}\n{:?}\n{:?}\n{:?}\n{:?}\n{:?}\n{:?}\n{:?}",
            self.config,
            self.requests,
            self.waiting,
            self.swapped,
            (&self.running, &self.loading, &self.abandoned_loads),
            self.load_counters,
            (self.next_arrival, self.next_front, self.next_admission),
            (
                self.num_preemptions,
                self.forked_since_step,
                self.unforked_samples
            ),
            (
                &self.finished_since_plan,
                &self.in_flight,
                &self.deferred_frees
            ),
            (self.fork_reserve, self.saved_moves),
        )
    }
}

impl Undo for ContinuousScheduler {
    fn begin(&mut self) {
        #[cfg(debug_assertions)]
        {
            self.undo.copy = Some(Box::new(self.clone()));
        }
        self.undo.open = true;
        self.undo_parts().begin();
    }

    fn commit(&mut self) {
        self.undo.open = false;
        #[cfg(debug_assertions)]
        {
            self.undo.copy = None;
        }
        self.undo_parts().commit();
    }

    fn rollback(&mut self) {
        if !std::mem::take(&mut self.undo.open) {
            return;
        }
        self.undo_parts().rollback();
        #[cfg(debug_assertions)]
        if let Some(copy) = self.undo.copy.take() {
            assert_eq!(
                self.state_text(),
                copy.state_text(),
                "the undo record did not restore the scheduler"
            );
        }
    }
}

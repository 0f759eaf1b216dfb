//! The scheduler as one step's unit of undo (see `crate::undo`): its requests
//! (`request_table`) and queues (`queue`) record their own changes; its lists of ids (as long as what runs) and its counters are
//! kept here when the step begins.
//!
//! Debug builds also keep a whole copy at `begin` and check, at every rollback, that the
//! record put back exactly that.

use std::fmt;

use super::{ContinuousScheduler, LoadCounters};
use crate::undo::{Saved, Undo};

/// The scheduler's lists of ids and counters as the step found them.
#[derive(Clone, Default)]
pub(super) struct UndoRecord {
    saved: Saved<Counters>,
    running: Vec<u64>,
    loading: Vec<u64>,
    abandoned_loads: Vec<u64>,
    finished_since_plan: Vec<u64>,
    in_flight: Vec<u64>,
    deferred_frees: Vec<u64>,
    #[cfg(debug_assertions)]
    copy: Option<Box<ContinuousScheduler>>,
}

#[derive(Clone, Copy)]
struct Counters {
    load_counters: LoadCounters,
    next_arrival: i64,
    next_front: i64,
    next_admission: u64,
    num_preemptions: u64,
    forked_since_step: usize,
    unforked_samples: usize,
    fork_reserve: usize,
    saved_moves: usize,
}

impl fmt::Debug for UndoRecord {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("_")
    }
}

impl ContinuousScheduler {
    fn counters(&self) -> Counters {
        Counters {
            load_counters: self.load_counters,
            next_arrival: self.next_arrival,
            next_front: self.next_front,
            next_admission: self.next_admission,
            num_preemptions: self.num_preemptions,
            forked_since_step: self.forked_since_step,
            unforked_samples: self.unforked_samples,
            fork_reserve: self.fork_reserve,
            saved_moves: self.saved_moves,
        }
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
        let counters = self.counters();
        let record = &mut self.undo;
        record.saved.save(counters);
        record.running.clone_from(&self.running);
        record.loading.clone_from(&self.loading);
        record.abandoned_loads.clone_from(&self.abandoned_loads);
        record
            .finished_since_plan
            .clone_from(&self.finished_since_plan);
        record.in_flight.clone_from(&self.in_flight);
        record.deferred_frees.clone_from(&self.deferred_frees);
        self.requests.begin();
        self.waiting.begin();
        self.swapped.begin();
    }

    fn commit(&mut self) {
        self.undo.saved.forget();
        #[cfg(debug_assertions)]
        {
            self.undo.copy = None;
        }
        self.requests.commit();
        self.waiting.commit();
        self.swapped.commit();
    }

    fn rollback(&mut self) {
        let Some(counters) = self.undo.saved.take() else {
            return;
        };
        let Counters {
            load_counters,
            next_arrival,
            next_front,
            next_admission,
            num_preemptions,
            forked_since_step,
            unforked_samples,
            fork_reserve,
            saved_moves,
        } = counters;
        self.load_counters = load_counters;
        (self.next_arrival, self.next_front) = (next_arrival, next_front);
        (self.next_admission, self.num_preemptions) = (next_admission, num_preemptions);
        (self.forked_since_step, self.unforked_samples) = (forked_since_step, unforked_samples);
        (self.fork_reserve, self.saved_moves) = (fork_reserve, saved_moves);
        let record = &mut self.undo;
        std::mem::swap(&mut self.running, &mut record.running);
        std::mem::swap(&mut self.loading, &mut record.loading);
        std::mem::swap(&mut self.abandoned_loads, &mut record.abandoned_loads);
        std::mem::swap(
            &mut self.finished_since_plan,
            &mut record.finished_since_plan,
        );
        std::mem::swap(&mut self.in_flight, &mut record.in_flight);
        std::mem::swap(&mut self.deferred_frees, &mut record.deferred_frees);
        self.requests.rollback();
        self.waiting.rollback();
        self.swapped.rollback();
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

//! Continuous batching over a [`KvCache`] (what Orca and vLLM's scheduler do), as a
//! deterministic policy: the caller passes the time and the cache; every decision of a step
//! comes back as one [`StepPlan`].
//!
//! Each step serves, in this order and within `max_num_batched_tokens` and `max_num_seqs`:
//! 1. running sequences: a decode token each, or the next chunk of an unfinished prefill. A
//!    decode that needs a block when none is free preempts the newest, lowest-priority running
//!    sequence (possibly itself): `Recompute` frees its blocks and puts it at the front of the
//!    queue, `Swap` moves it to the cache's host tier;
//! 2. swapped-out sequences, swapped back in while blocks (beyond the watermark) allow;
//! 3. waiting requests, admitted by priority then arrival while their whole prompt's blocks
//!    (beyond the watermark) are there; prefix-cache hits count as computed.
//!
//! Nothing new is admitted while anything waits to resume, so a preempted sequence always
//! comes back before later arrivals: none starves. A sequence whose last token was computed
//! waits for its sampled token (`on_tokens`) before it is scheduled again.
//!
//! **The contract.** A plan returned by `step()` is executed — every row, even of requests
//! aborted in the meantime — before the next `step()` or `on_tokens()`. Its block moves come
//! first, in their order (the Python binding executes them inside `step()`, under the cache's
//! lock). Scheduled tokens therefore count as computed when planned, and the full blocks they
//! complete join the prefix cache then. Requests admitted later in the same step may hit those
//! blocks (vLLM's rule): safe only because a batched forward writes every token's K/V, layer
//! by layer, before any attention of that layer reads. Sampled tokens extend a request's
//! token history, so its output blocks are reusable by a follow-up request.
//!
//! One file per part: [`config`](self) (what an operator sets), requests (arrive, sample,
//! abort), step (the three phases and the plan), transaction (check, plan, execute, commit or
//! roll back), recovery (what a step relies on, and the invariants), and the plan's
//! persistent block table.

mod block_tables;
mod config;
mod fork_reserve;
mod loads;
mod queue;
mod recovery;
mod request_table;
mod requests;
mod step;
mod step_plan;
mod transaction;
mod undo_record;

pub use block_tables::BlockTableWriter;
pub use config::{Preemption, SchedulerConfig, MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS};
pub use loads::{BlockLoad, LoadCounters};
use queue::Queue;
use request_table::RequestTable;
use requests::{check_request, Request};
use step::ScheduledRow;
pub use step_plan::StepPlan;
use undo_record::UndoRecord;

use crate::error::{CoreError, CoreResult};
use crate::kv_cache::KvCache;

/// Queue key: priority, then arrival order (preempted requests get keys ahead of every
/// arrival), then id.
type QueueKey = (u32, i64, u64);

#[derive(Debug, Clone)]
pub struct ContinuousScheduler {
    config: SchedulerConfig,
    requests: RequestTable,
    waiting: Queue,
    swapped: Queue,
    running: Vec<u64>,
    /// Admitted requests waiting for their lower-tier loads (see `loads`).
    loading: Vec<u64>,
    /// Requests aborted while loading: freed once their loads are reported.
    abandoned_loads: Vec<u64>,
    load_counters: LoadCounters,
    next_arrival: i64,
    next_front: i64,
    next_admission: u64,
    num_preemptions: u64,
    /// Requests ended since the last plan (reported in the next one).
    finished_since_plan: Vec<u64>,
    /// Rows of the last plan, until it is known to have run (the next `step`/`on_tokens`).
    in_flight: Vec<u64>,
    /// Aborted requests with rows in flight: their blocks are freed once the plan ran, so
    /// the runner can still write every row, and no block it writes was handed out again.
    deferred_frees: Vec<u64>,
    /// Requests forked since the last step: they may run beyond `max_num_seqs` until the
    /// next step preempts the extra ones.
    forked_since_step: usize,
    /// `samples_to_fork` summed over every request: while 0 (no request of several
    /// samples), seats are the running sequences and need no walk over them.
    unforked_samples: usize,
    /// State blocks kept free for the forks of admitted requests (see `fork_reserve`).
    fork_reserve: usize,
    scratch_slots: Vec<i32>,
    /// The slots of this step's decodes in every group (`[decodes, groups]`), as their
    /// tokens were appended.
    decode_slots: Vec<i32>,
    scratch_ids: Vec<u64>,
    /// Running sequences by (priority, admission), then id.
    scratch_order: Vec<((u32, u64), u64)>,
    block_tables: BlockTableWriter,
    scratch_scheduled: Vec<ScheduledRow>,
    /// Of the step's moves, the leading ones that save checkpoints (see `save_checkpoints`).
    saved_moves: usize,
    /// What an open step puts back if its moves fail (see `undo_record`).
    undo: UndoRecord,
}

impl ContinuousScheduler {
    pub fn new(config: SchedulerConfig, cache: &KvCache) -> CoreResult<Self> {
        config.validate_for(cache)?;
        Ok(ContinuousScheduler {
            config,
            requests: RequestTable::default(),
            waiting: Queue::default(),
            swapped: Queue::default(),
            running: Vec::new(),
            loading: Vec::new(),
            abandoned_loads: Vec::new(),
            load_counters: LoadCounters::default(),
            next_arrival: 0,
            next_front: -1,
            next_admission: 0,
            num_preemptions: 0,
            finished_since_plan: Vec::new(),
            in_flight: Vec::new(),
            deferred_frees: Vec::new(),
            forked_since_step: 0,
            unforked_samples: 0,
            fork_reserve: 0,
            scratch_slots: Vec::new(),
            decode_slots: Vec::new(),
            scratch_ids: Vec::new(),
            scratch_order: Vec::new(),
            block_tables: BlockTableWriter::new(),
            scratch_scheduled: Vec::new(),
            saved_moves: 0,
            undo: UndoRecord::default(),
        })
    }

    pub fn config(&self) -> SchedulerConfig {
        self.config
    }

    /// Validated first; a bad configuration changes nothing. Returns the previous one.
    pub fn set_config(
        &mut self,
        config: SchedulerConfig,
        cache: &KvCache,
    ) -> CoreResult<SchedulerConfig> {
        self.check_config(config, cache)?;
        Ok(std::mem::replace(&mut self.config, config))
    }

    /// Whether a new request of `prompt_len` tokens, `max_new_tokens` and `num_samples`
    /// could ever be scheduled under `config` (one not in force yet, say). Changes nothing.
    pub fn check_new_request(
        config: SchedulerConfig,
        cache: &KvCache,
        seq_id: u64,
        prompt_len: usize,
        max_new_tokens: usize,
        num_samples: usize,
    ) -> CoreResult<()> {
        config.validate_for(cache)?;
        check_request(
            &config,
            cache,
            seq_id,
            (prompt_len, max_new_tokens),
            num_samples,
        )
    }

    /// Whether `config` could replace this one: valid with `cache`, and every request in
    /// the scheduler could still be scheduled under it (a change that would strand one
    /// forever is refused, naming it). Changes nothing.
    pub fn check_config(&self, config: SchedulerConfig, cache: &KvCache) -> CoreResult<()> {
        config.validate_for(cache)?;
        for (&seq_id, request) in &self.requests {
            check_request(
                &config,
                cache,
                seq_id,
                (request.prompt_len, request.max_new_tokens),
                1 + request.samples_to_fork,
            )?;
        }
        Ok(())
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_swapped(&self) -> usize {
        self.swapped.len()
    }

    pub fn num_preemptions(&self) -> u64 {
        self.num_preemptions
    }

    pub fn contains(&self, seq_id: u64) -> bool {
        self.requests.contains_key(&seq_id)
    }

    /// (prompt length, sampled so far, max_new_tokens) of a request.
    pub fn progress(&self, seq_id: u64) -> CoreResult<(usize, usize, usize)> {
        let request = self.request(seq_id)?;
        Ok((
            request.prompt_len,
            request.num_outputs,
            request.max_new_tokens,
        ))
    }

    fn request(&self, seq_id: u64) -> CoreResult<&Request> {
        self.requests
            .get(&seq_id)
            .ok_or_else(|| CoreError::unknown_sequence(seq_id))
    }

    fn request_mut(&mut self, seq_id: u64) -> CoreResult<&mut Request> {
        self.requests
            .get_mut(&seq_id)
            .ok_or_else(|| CoreError::unknown_sequence(seq_id))
    }

    fn watermark_blocks(&self, cache: &KvCache) -> usize {
        self.config.watermark_blocks(cache)
    }
}

//! Scheduling: which requests run when.
//!
//! - [`continuous`]: continuous batching over a KV cache (Orca / vLLM), one step plan per
//!   model forward, with chunked prefill, preemption and the persistent block table.
//! - [`request_batcher`]: whole requests grouped into batches of at most `max_batch_size`
//!   or after `timeout_ms` (ATB's DynamicBatchScheduler, Triton's dynamic batcher).

mod continuous;
mod request_batcher;

pub use continuous::{
    BlockLoad, BlockTableWriter, ContinuousScheduler, LoadCounters, Preemption, SchedulerConfig,
    StepPlan, MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS,
};
pub use request_batcher::{BatcherConfig, Poll, RequestBatcher, TimeoutAction};

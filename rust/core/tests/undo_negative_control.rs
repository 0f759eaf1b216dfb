//! A negative control for every test of a rollback: with one recorded change not put back,
//! a step whose moves fail no longer leaves the scheduler and the cache as it found them
//! (debug builds' own check panics first). So what those tests see restored, the undo
//! record restored — not a copy, and not an accident of the workload.
//!
//! One test in its own binary: the switch it flips is process-wide.

use std::panic::{catch_unwind, AssertUnwindSafe};

use atb_mem_core::{
    skip_one_undo, ContinuousScheduler, CoreError, KvCache, KvCacheConfig, KvLayout, MoveFailure,
    Preemption, SchedulerConfig, StepPlan, Tokens,
};

#[path = "support/state.rs"]
mod state;
use state::state;

/// A request of two samples, forked after its first token: the next step's decode of the
/// fork copies its shared, partly filled last block (a copy-on-write move).
fn forked() -> (ContinuousScheduler, KvCache) {
    let mut cache = KvCacheConfig::new(32, 4, KvLayout::default())
        .build()
        .unwrap();
    let config = SchedulerConfig {
        max_num_seqs: 4,
        max_num_batched_tokens: 64,
        enable_chunked_prefill: true,
        preemption: Preemption::Recompute,
        watermark: 0.0,
    };
    let mut scheduler = ContinuousScheduler::new(config, &cache).unwrap();
    let prompt: Vec<u32> = (1..=6).collect();
    scheduler
        .add_request(&mut cache, 1, Tokens::Ids(&prompt), 8, 2, 0, 0)
        .unwrap();
    let mut plan = StepPlan::default();
    scheduler.step(&mut cache, 0, &mut plan).unwrap();
    scheduler.fork(&mut cache, 1, 2).unwrap();
    scheduler
        .on_tokens(&mut cache, &[1, 2], &[7, 8], None, &mut Vec::new())
        .unwrap();
    (scheduler, cache)
}

/// Steps with an executor that fails before any move: the state after, as text, or the
/// panic of a debug build's check.
fn failed_step(scheduler: &mut ContinuousScheduler, cache: &mut KvCache) -> Result<String, String> {
    let mut plan = StepPlan::default();
    let stepped = catch_unwind(AssertUnwindSafe(|| {
        scheduler.step_executing(cache, 1, &mut plan, |moves| {
            assert!(!moves.is_empty(), "the step moves no block");
            Err(MoveFailure { attempted: 0 })
        })
    }));
    match stepped {
        Ok(result) => {
            assert!(
                matches!(result, Err(CoreError::MovesFailed { .. })),
                "{result:?}"
            );
            Ok(state(scheduler, cache))
        }
        Err(panic) => Err(panic.downcast_ref::<String>().cloned().unwrap_or_default()),
    }
}

#[test]
fn skipping_one_recorded_change_fails_the_rollback() {
    let (mut scheduler, mut cache) = forked();
    let before = state(&scheduler, &cache);
    // The record, whole: the failed step changed nothing.
    assert_eq!(failed_step(&mut scheduler, &mut cache), Ok(before.clone()));
    // One change left out: the state differs, or a debug build's check says so.
    skip_one_undo();
    match failed_step(&mut scheduler, &mut cache) {
        Ok(after) => assert_ne!(after, before, "a skipped undo went unnoticed"),
        Err(panic) => assert!(panic.contains("the undo record did not restore"), "{panic}"),
    }
}

//! A step that fails changes nothing: the scheduler and the cache are byte for byte (as
//! `Debug` prints them) what they were, whatever the cache lost behind the scheduler's back.

use atb_mem_core::{
    ContinuousScheduler, KvCache, KvCacheConfig, KvLayout, Preemption, SchedulerConfig, StepPlan,
    Tokens,
};

#[path = "support/state.rs"]
mod state;
use state::state;

fn scheduler_over(cache: &KvCache) -> ContinuousScheduler {
    let config = SchedulerConfig {
        max_num_seqs: 8,
        max_num_batched_tokens: 96,
        enable_chunked_prefill: true,
        preemption: Preemption::Recompute,
        watermark: 0.0,
    };
    ContinuousScheduler::new(config, cache).unwrap()
}

/// Three requests prefilled and sampled once: the next step decodes all three.
fn decoding() -> (ContinuousScheduler, KvCache) {
    let mut cache = KvCacheConfig::new(40, 3, KvLayout::default())
        .build()
        .unwrap();
    let mut scheduler = scheduler_over(&cache);
    for (seq_id, length) in [(86u64, 7usize), (87, 8), (88, 5)] {
        let tokens: Vec<u32> = (0..length as u32).map(|t| t + seq_id as u32).collect();
        scheduler
            .add_request(&mut cache, seq_id, Tokens::Ids(&tokens), 4, 1, 0, 0)
            .unwrap();
    }
    let mut plan = StepPlan::default();
    scheduler.step(&mut cache, 0, &mut plan).unwrap();
    assert_eq!(plan.sample_seq_ids.len(), 3);
    let tokens = vec![1; plan.sample_seq_ids.len()];
    let ids = plan.sample_seq_ids.clone();
    scheduler
        .on_tokens(&mut cache, &ids, &tokens, None, &mut Vec::new())
        .unwrap();
    (scheduler, cache)
}

#[test]
fn a_sequence_freed_behind_the_schedulers_back_fails_the_step_unchanged() {
    for lost in [86u64, 87, 88] {
        let (mut scheduler, mut cache) = decoding();
        cache.free_sequence(lost).unwrap();
        let before = state(&scheduler, &cache);
        let mut plan = StepPlan::default();
        let error = scheduler.step(&mut cache, 1, &mut plan).unwrap_err();
        assert!(error.to_string().contains(&lost.to_string()), "{error}");
        assert_eq!(state(&scheduler, &cache), before, "sequence {lost} lost");
    }
}

#[test]
fn a_sequence_allocated_behind_the_schedulers_back_fails_the_step_unchanged() {
    let (mut scheduler, mut cache) = decoding();
    scheduler
        .add_request(&mut cache, 90, Tokens::Count(4), 2, 1, 0, 0)
        .unwrap();
    cache.alloc_sequence(90, Tokens::Count(3), None).unwrap();
    let before = state(&scheduler, &cache);
    let mut plan = StepPlan::default();
    scheduler.step(&mut cache, 1, &mut plan).unwrap_err();
    assert_eq!(state(&scheduler, &cache), before);
}

#[test]
fn the_same_step_succeeds_when_nothing_was_lost() {
    let (mut scheduler, mut cache) = decoding();
    let mut plan = StepPlan::default();
    scheduler.step(&mut cache, 1, &mut plan).unwrap();
    assert_eq!(plan.decode_seq_ids.len(), 3);
    scheduler.check_invariants(&cache).unwrap();
}

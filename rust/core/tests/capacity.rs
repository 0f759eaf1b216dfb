//! What one request may hold, and what a configuration may ask: a window wider than the pool
//! still serves sequences that fit, admission and appends agree on the limit, a request
//! waits for seats for all its samples, and a change that would strand a queued request (or
//! leave no room for any) is refused and changes nothing.

use atb_mem_core::{
    AttentionKind, ContinuousScheduler, KvCache, KvCacheConfig, KvLayout, Preemption,
    SchedulerConfig, StepPlan, Tokens, MAX_NUM_SEQS,
};
use proptest::prelude::*;

const FULL: AttentionKind = AttentionKind::Full;

fn sliding(window: usize) -> AttentionKind {
    AttentionKind::SlidingWindow { window }
}

fn cache(kinds: &[AttentionKind], num_blocks: usize, block_size: usize) -> KvCache {
    let layout = KvLayout {
        num_layers: kinds.len(),
        ..KvLayout::default()
    };
    KvCacheConfig::new(num_blocks, block_size, layout)
        .layer_kinds(kinds)
        .build()
        .unwrap()
}

fn config(max_num_seqs: usize, watermark: f64) -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs,
        max_num_batched_tokens: 256,
        enable_chunked_prefill: true,
        preemption: Preemption::Recompute,
        watermark,
    }
}

/// The most tokens whose blocks, group by group, fit `blocks` — by trying every length.
fn tokens_by_trial(cache: &KvCache, blocks: usize) -> usize {
    let block_size = cache.block_size();
    let held = |k: usize| -> usize {
        cache
            .groups()
            .iter()
            .map(|group| match group.kind.span() {
                Some(span) => k.min(span.div_ceil(block_size) + 1),
                None => k,
            })
            .sum()
    };
    let mut most = 0;
    for k in 0..=blocks + 1 {
        if held(k) <= blocks {
            most = k;
        }
    }
    most * block_size
}

#[test]
fn a_window_wider_than_the_pool_serves_what_fits() {
    // 64 blocks of 4: a 29-token sequence (8 blocks a group) is admitted and grows.
    let mut cache = cache(&[sliding(1 << 20), FULL], 64, 4);
    assert_eq!(cache.max_seq_tokens(), 31 * 4);
    cache.alloc_sequence(1, Tokens::Count(29), None).unwrap();
    let mut slots = Vec::new();
    for _ in 0..20 {
        cache.append_tokens(&[1], 1, None, &mut slots).unwrap();
    }
    assert_eq!(cache.seq_len(1).unwrap(), 49);
    cache.check_invariants().unwrap();
}

#[test]
fn a_window_only_model_holds_as_many_tokens_as_blocks_allow() {
    // Mistral's layers all slide: window 64 on 16 blocks of 4 (15 usable) needs 17 blocks
    // past the window, so a sequence may hold 60 tokens; it had been refused outright.
    let windows = cache(&[sliding(64)], 16, 4);
    assert_eq!(windows.max_seq_tokens(), 60);
    // A window that fits the pool serves any length.
    let small = cache(&[sliding(8)], 16, 4);
    assert_eq!(small.max_seq_tokens(), atb_mem_core::MAX_SLOTS - 1);
}

#[test]
fn admission_agrees_with_appends() {
    let mut cache = cache(&[sliding(64), FULL, sliding(64)], 40, 4);
    let mut scheduler = ContinuousScheduler::new(config(8, 0.0), &cache).unwrap();
    let most = cache.max_seq_tokens();
    assert!(most > 30, "{most}");
    scheduler
        .add_request(&mut cache, 1, Tokens::Count(most - 8), 8, 1, 0, 0)
        .unwrap();
    let error = scheduler
        .add_request(&mut cache, 2, Tokens::Count(most - 8), 9, 1, 0, 0)
        .unwrap_err();
    assert!(error.to_string().contains("the cache fits"), "{error}");
}

proptest! {
    #[test]
    fn tokens_in_blocks_is_the_longest_length_that_fits(
        spans in prop::collection::vec(prop::option::of(1usize..80), 1..5),
        block_size in 1usize..9,
        blocks in 0usize..60,
    ) {
        let kinds: Vec<AttentionKind> = spans
            .iter()
            .map(|span| span.map_or(FULL, sliding))
            .collect();
        let cache = cache(&kinds, 64, block_size);
        let only_windows = spans.iter().all(Option::is_some);
        let expected = tokens_by_trial(&cache, blocks);
        let found = cache.tokens_in_blocks(blocks);
        if only_windows && found == atb_mem_core::MAX_SLOTS - 1 {
            // Every window fits: the trial, bounded at `blocks + 1`, found that many.
            prop_assert_eq!(expected, (blocks + 1) * block_size);
        } else {
            prop_assert_eq!(found, expected);
        }
    }
}

fn step(scheduler: &mut ContinuousScheduler, cache: &mut KvCache) -> StepPlan {
    let mut plan = StepPlan::default();
    scheduler.step(cache, 0, &mut plan).unwrap();
    plan
}

#[test]
fn a_request_waits_for_seats_for_all_its_samples() {
    let mut cache = cache(&[FULL], 64, 4);
    let mut scheduler = ContinuousScheduler::new(config(4, 0.0), &cache).unwrap();
    let error = scheduler
        .add_request(&mut cache, 9, Tokens::Count(5), 3, 5, 0, 0)
        .unwrap_err();
    assert!(error.to_string().contains("max_num_seqs=4"), "{error}");
    scheduler
        .add_request(&mut cache, 1, Tokens::Count(5), 3, 1, 0, 0)
        .unwrap();
    scheduler
        .add_request(&mut cache, 2, Tokens::Count(5), 3, 4, 0, 0)
        .unwrap();
    let plan = step(&mut scheduler, &mut cache);
    // Request 2 needs four seats and one is taken: it waits.
    assert_eq!(plan.prefill_seq_ids, [1]);
    assert_eq!(scheduler.num_waiting(), 1);
    scheduler
        .on_tokens(&mut cache, &[1], &[7], None, &mut Vec::new())
        .unwrap();
    scheduler.abort(&mut cache, 1).unwrap();
    let plan = step(&mut scheduler, &mut cache);
    assert_eq!(plan.prefill_seq_ids, [2]);
    for child in [20, 21, 22] {
        scheduler.fork(&mut cache, 2, child).unwrap();
    }
    scheduler
        .on_tokens(
            &mut cache,
            &[2, 20, 21, 22],
            &[1, 2, 3, 4],
            None,
            &mut Vec::new(),
        )
        .unwrap();
    // Four running: a newcomer waits, and nobody was preempted for the forks.
    scheduler
        .add_request(&mut cache, 3, Tokens::Count(2), 3, 1, 0, 0)
        .unwrap();
    let plan = step(&mut scheduler, &mut cache);
    assert_eq!(plan.decode_seq_ids.len(), 4);
    assert!(plan.preempted_seq_ids.is_empty());
    assert_eq!(scheduler.num_waiting(), 1);
    scheduler.check_invariants(&cache).unwrap();
}

#[test]
fn a_change_that_strands_a_request_is_refused() {
    // 33 blocks of 4 and an 80-token request (20 blocks): half the cache as watermark
    // would leave it waiting forever.
    let mut cache = cache(&[FULL], 33, 4);
    let mut scheduler = ContinuousScheduler::new(config(8, 0.0), &cache).unwrap();
    scheduler
        .add_request(&mut cache, 1, Tokens::Count(80), 4, 3, 0, 0)
        .unwrap();
    let before = format!("{:?}", scheduler.config());
    let error = scheduler
        .set_config(config(8, 0.5), &cache)
        .unwrap_err()
        .to_string();
    assert!(error.contains("request 1 may hold 84 tokens"), "{error}");
    let error = scheduler
        .set_config(config(2, 0.0), &cache)
        .unwrap_err()
        .to_string();
    assert!(error.contains("request 1 runs 3 samples"), "{error}");
    assert_eq!(format!("{:?}", scheduler.config()), before);
    // What leaves it room is taken.
    scheduler.set_config(config(3, 0.1), &cache).unwrap();
    let plan = step(&mut scheduler, &mut cache);
    assert_eq!(plan.prefill_seq_ids, [1]);
}

#[test]
fn a_watermark_that_leaves_no_room_is_refused() {
    let cache = cache(&[FULL], 33, 4);
    for watermark in [0.999_999, 0.95] {
        let error = ContinuousScheduler::new(config(8, watermark), &cache)
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("no request could ever be admitted"),
            "{error}"
        );
    }
    // Two blocks left (ceil(0.9 × 33) = 30 kept free of 32) are room for 8 tokens.
    ContinuousScheduler::new(config(8, 0.9), &cache).unwrap();
}

#[test]
fn settings_have_bounds() {
    let cache = cache(&[FULL], 33, 4);
    for bad in [
        config(0, 0.0),
        config(MAX_NUM_SEQS + 1, 0.0),
        config(1_000_000_000, 0.0),
        config(4, f64::NAN),
        config(4, 1.0),
        SchedulerConfig {
            max_num_batched_tokens: 1 << 40,
            ..config(4, 0.0)
        },
    ] {
        assert!(ContinuousScheduler::new(bad, &cache).is_err(), "{bad:?}");
    }
}

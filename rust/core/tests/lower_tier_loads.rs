//! Requests whose prefix a lower tier holds: admitted into the loading state, holding their
//! blocks and a seat while others run, served as computed only once their load is reported
//! done, recomputed when it failed; bad reports change nothing.

use atb_mem_core::{
    AttentionKind, BlockHash, ContinuousScheduler, KvCache, KvCacheConfig, KvLayout, Preemption,
    SchedulerConfig, StepPlan, Tokens,
};

#[path = "support/chain.rs"]
mod chain;

#[path = "support/state.rs"]
mod state;
use state::state;

const BLOCK_SIZE: usize = 4;

fn config(max_num_seqs: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs,
        max_num_batched_tokens: 256,
        enable_chunked_prefill: true,
        preemption: Preemption::Recompute,
        watermark: 0.0,
    }
}

fn setup(max_num_seqs: usize) -> (ContinuousScheduler, KvCache) {
    let cache = KvCacheConfig::new(64, BLOCK_SIZE, KvLayout::default())
        .build()
        .unwrap();
    (
        ContinuousScheduler::new(config(max_num_seqs), &cache).unwrap(),
        cache,
    )
}

fn prompt(first: u32) -> Vec<u32> {
    (first..first + 13).collect() // 3 full blocks before the last token
}

fn step(scheduler: &mut ContinuousScheduler, cache: &mut KvCache) -> StepPlan {
    let mut plan = StepPlan::default();
    scheduler.step(cache, 0, &mut plan).unwrap();
    plan
}

fn chain(tokens: &[u32]) -> Vec<BlockHash> {
    chain::chain(tokens, BLOCK_SIZE)
}

#[test]
fn a_loading_request_waits_with_its_blocks_then_runs_from_the_loaded_prefix() {
    let (mut scheduler, mut cache) = setup(4);
    let ids = prompt(0);
    scheduler
        .add_request(&mut cache, 1, Tokens::Ids(&ids), 4, 1, 0, 0)
        .unwrap();
    scheduler.offer_external_prefix(&cache, 1, 2).unwrap();
    scheduler
        .add_request(&mut cache, 2, Tokens::Ids(&prompt(100)), 4, 1, 0, 0)
        .unwrap();
    let plan = step(&mut scheduler, &mut cache);
    // Request 1 loads blocks 0 and 1 (their hashes name the prompt's chain); 2 runs.
    assert_eq!(plan.loads.len(), 2);
    let table = cache.block_table(1).unwrap().to_vec();
    assert_eq!(plan.loads[0].block, table[0]);
    assert_eq!(
        plan.loads.iter().map(|load| load.key).collect::<Vec<_>>(),
        chain(&ids)[..2]
    );
    assert_eq!(plan.prefill_seq_ids, [2]);
    assert_eq!((scheduler.num_loading(), scheduler.num_running()), (1, 1));
    // Nothing may hit the blocks being loaded.
    assert_eq!(cache.explain_prefix(&ids, None).unwrap().hit_tokens, 0);
    scheduler.check_invariants(&cache).unwrap();
    // Not scheduled until reported.
    let plan = step(&mut scheduler, &mut cache);
    assert!(!plan.prefill_seq_ids.contains(&1));
    scheduler.finish_loads(&mut cache, &[1], &[true]).unwrap();
    assert_eq!(cache.num_computed(1).unwrap(), 2 * BLOCK_SIZE);
    assert_eq!(
        cache.explain_prefix(&ids, None).unwrap().hit_tokens,
        2 * BLOCK_SIZE
    );
    let plan = step(&mut scheduler, &mut cache);
    let row = plan.prefill_seq_ids.iter().position(|&id| id == 1).unwrap();
    assert_eq!(plan.query_lens[row] as usize, ids.len() - 2 * BLOCK_SIZE);
    assert_eq!(scheduler.load_counters().loaded_blocks, 2);
    scheduler.check_invariants(&cache).unwrap();
}

#[test]
fn a_failed_load_is_recomputed() {
    let (mut scheduler, mut cache) = setup(4);
    let ids = prompt(0);
    scheduler
        .add_request(&mut cache, 1, Tokens::Ids(&ids), 4, 1, 0, 0)
        .unwrap();
    scheduler.offer_external_prefix(&cache, 1, 3).unwrap();
    assert_eq!(step(&mut scheduler, &mut cache).loads.len(), 3);
    scheduler.finish_loads(&mut cache, &[1], &[false]).unwrap();
    assert_eq!(cache.num_computed(1).unwrap(), 0);
    let plan = step(&mut scheduler, &mut cache);
    assert_eq!(
        (plan.prefill_seq_ids[0], plan.query_lens[0]),
        (1, ids.len() as i32)
    );
    assert_eq!(scheduler.load_counters().failed, 1);
}

#[test]
fn loading_requests_hold_their_seats() {
    let (mut scheduler, mut cache) = setup(1);
    scheduler
        .add_request(&mut cache, 1, Tokens::Ids(&prompt(0)), 4, 1, 0, 0)
        .unwrap();
    scheduler.offer_external_prefix(&cache, 1, 1).unwrap();
    scheduler
        .add_request(&mut cache, 2, Tokens::Ids(&prompt(100)), 4, 1, 0, 0)
        .unwrap();
    let plan = step(&mut scheduler, &mut cache);
    assert!(
        plan.prefill_seq_ids.is_empty(),
        "the one seat is taken by the load"
    );
    assert_eq!(scheduler.num_waiting(), 1);
}

#[test]
fn an_abort_during_a_load_frees_its_blocks_once_reported() {
    let (mut scheduler, mut cache) = setup(4);
    scheduler
        .add_request(&mut cache, 1, Tokens::Ids(&prompt(0)), 4, 1, 0, 0)
        .unwrap();
    scheduler.offer_external_prefix(&cache, 1, 3).unwrap();
    step(&mut scheduler, &mut cache);
    let free = cache.num_free_blocks();
    scheduler.abort(&mut cache, 1).unwrap();
    assert!(cache.contains(1), "the load still writes its blocks");
    assert_eq!(cache.num_free_blocks(), free);
    scheduler.check_invariants(&cache).unwrap();
    scheduler.finish_loads(&mut cache, &[1], &[true]).unwrap();
    assert!(!cache.contains(1));
    assert_eq!(cache.num_computed(1).ok(), None);
    scheduler.check_invariants(&cache).unwrap();
}

#[test]
fn bad_offers_and_reports_change_nothing() {
    let (mut scheduler, mut cache) = setup(4);
    scheduler
        .add_request(&mut cache, 1, Tokens::Ids(&prompt(0)), 4, 1, 0, 0)
        .unwrap();
    scheduler
        .add_request(&mut cache, 2, Tokens::Count(13), 4, 1, 0, 0)
        .unwrap();
    let before = state(&scheduler, &cache);
    assert!(
        scheduler.offer_external_prefix(&cache, 1, 4).is_err(),
        "past the last token"
    );
    assert!(
        scheduler.offer_external_prefix(&cache, 2, 1).is_err(),
        "no token ids"
    );
    assert!(
        scheduler.offer_external_prefix(&cache, 9, 1).is_err(),
        "unknown"
    );
    assert_eq!(state(&scheduler, &cache), before);
    scheduler.offer_external_prefix(&cache, 1, 2).unwrap();
    step(&mut scheduler, &mut cache);
    let before = state(&scheduler, &cache);
    for (ids, done) in [
        (vec![2], vec![true]), // running, not loading
        (vec![1, 1], vec![true, true]),
        (vec![1], vec![]),
        (vec![1, 7], vec![true, true]), // the second is unknown
    ] {
        assert!(
            scheduler.finish_loads(&mut cache, &ids, &done).is_err(),
            "{ids:?}"
        );
        assert_eq!(state(&scheduler, &cache), before, "{ids:?}");
    }
    assert!(
        scheduler.offer_external_prefix(&cache, 1, 1).is_err(),
        "no longer waiting"
    );
}

#[test]
fn windowed_caches_do_not_load() {
    let kinds = [
        AttentionKind::SlidingWindow { window: 4 },
        AttentionKind::Full,
    ];
    let layout = KvLayout {
        num_layers: 2,
        ..KvLayout::default()
    };
    let mut cache = KvCacheConfig::new(64, BLOCK_SIZE, layout)
        .layer_kinds(&kinds)
        .build()
        .unwrap();
    let mut scheduler = ContinuousScheduler::new(config(4), &cache).unwrap();
    scheduler
        .add_request(&mut cache, 1, Tokens::Ids(&prompt(0)), 4, 1, 0, 0)
        .unwrap();
    let error = scheduler.offer_external_prefix(&cache, 1, 1).unwrap_err();
    assert!(error.to_string().contains("full-attention"), "{error}");
}

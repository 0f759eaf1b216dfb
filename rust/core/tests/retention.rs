//! Retention by priority (the `priority` eviction policy): a system prompt a request pinned
//! at 100 survives a flood of one-off prompts that plain LRU loses it to; a duration ends the
//! pin; a scheduler counts a request's priority at eviction; bad configs change nothing.

use atb_mem_core::{
    EvictionPolicy, KvCache, KvCacheConfig, KvLayout, RetentionConfig, StepPlan, TokenRetention,
    Tokens, MAX_PRIORITY,
};

#[path = "support/scheduler.rs"]
mod scheduler;
use scheduler::scheduler;

const BLOCK_SIZE: usize = 4;
const SYSTEM: usize = 4 * BLOCK_SIZE;
const SECOND: u64 = 1_000_000_000;

fn cache(policy: EvictionPolicy) -> KvCache {
    KvCacheConfig::new(24, BLOCK_SIZE, KvLayout::default())
        .eviction_policy(policy)
        .build()
        .unwrap()
}

fn system_prompt() -> Vec<u32> {
    (0..SYSTEM as u32).collect()
}

fn with_message(first: u32) -> Vec<u32> {
    let mut ids = system_prompt();
    ids.extend(first..first + 5);
    ids
}

fn pin(priority: u8, duration_ns: Option<u64>) -> RetentionConfig {
    RetentionConfig {
        ranges: vec![TokenRetention {
            start: 0,
            end: Some(SYSTEM),
            priority,
            duration_ns,
        }],
        ..RetentionConfig::default()
    }
}

/// Admits, computes and frees a prompt (with `config`, if any).
fn run_once(cache: &mut KvCache, seq_id: u64, ids: &[u32], config: Option<&RetentionConfig>) {
    cache
        .alloc_sequence(seq_id, Tokens::Ids(ids), None)
        .unwrap();
    if let Some(config) = config {
        cache.set_retention(seq_id, config).unwrap();
    }
    cache.mark_computed(seq_id, Some(ids.len())).unwrap();
    cache.free_sequence(seq_id).unwrap();
    cache.check_invariants().unwrap();
}

/// 60 one-off prompts of 5 blocks each: 300 blocks through a cache of 23.
fn flood(cache: &mut KvCache) {
    for seq_id in 100..160u64 {
        let ids: Vec<u32> = (0..20).map(|t| 10_000 + seq_id as u32 * 100 + t).collect();
        run_once(cache, seq_id, &ids, None);
    }
}

fn system_hit(cache: &mut KvCache) -> usize {
    cache
        .explain_prefix(&with_message(9_000), None)
        .unwrap()
        .hit_tokens
}

#[test]
fn a_pinned_system_prompt_survives_a_flood_that_lru_loses_it_to() {
    let mut pinned = cache(EvictionPolicy::Priority);
    run_once(
        &mut pinned,
        1,
        &with_message(5_000),
        Some(&pin(MAX_PRIORITY, None)),
    );
    flood(&mut pinned);
    assert_eq!(system_hit(&mut pinned), SYSTEM);
    // Negative controls: unpinned under the priority policy, and under LRU (which refuses
    // the pin: it keeps no priorities).
    for policy in [EvictionPolicy::Lru, EvictionPolicy::Priority] {
        let mut plain = cache(policy);
        run_once(&mut plain, 1, &with_message(5_000), None);
        flood(&mut plain);
        assert_eq!(system_hit(&mut plain), 0, "{policy:?}");
    }
}

#[test]
fn the_default_policy_keeps_a_pin_and_the_others_refuse_one() {
    let mut default = KvCacheConfig::new(24, BLOCK_SIZE, KvLayout::default())
        .build()
        .unwrap();
    assert_eq!(default.eviction_policy(), EvictionPolicy::Priority);
    run_once(
        &mut default,
        1,
        &with_message(5_000),
        Some(&pin(MAX_PRIORITY, None)),
    );
    flood(&mut default);
    assert_eq!(system_hit(&mut default), SYSTEM);
    for policy in [
        EvictionPolicy::Lru,
        EvictionPolicy::Lfu,
        EvictionPolicy::Slru,
    ] {
        let mut cache = cache(policy);
        cache
            .alloc_sequence(1, Tokens::Ids(&with_message(5_000)), None)
            .unwrap();
        let error = cache
            .set_retention(1, &pin(MAX_PRIORITY, None))
            .unwrap_err();
        assert!(error.to_string().contains("eviction_policy='priority'"));
        cache.set_retention(1, &RetentionConfig::default()).unwrap();
        cache.check_invariants().unwrap();
    }
}

#[test]
fn a_pin_ends_with_its_duration() {
    let mut cache = cache(EvictionPolicy::Priority);
    run_once(
        &mut cache,
        1,
        &with_message(5_000),
        Some(&pin(90, Some(SECOND))),
    );
    cache.advance_clock(SECOND / 2);
    flood(&mut cache);
    assert_eq!(
        system_hit(&mut cache),
        SYSTEM,
        "still pinned half a second on"
    );
    cache.advance_clock(2 * SECOND);
    flood(&mut cache);
    assert_eq!(
        system_hit(&mut cache),
        0,
        "back to the default, then flooded out"
    );
}

#[test]
fn a_hit_raises_a_cached_block_and_a_lower_priority_goes_first() {
    let mut cache = cache(EvictionPolicy::Priority);
    // Cached unpinned, then a request that hits it pins it.
    run_once(&mut cache, 1, &with_message(5_000), None);
    let ids = with_message(6_000);
    cache.alloc_sequence(2, Tokens::Ids(&ids), None).unwrap();
    cache.set_retention(2, &pin(MAX_PRIORITY, None)).unwrap();
    cache.free_sequence(2).unwrap();
    flood(&mut cache);
    assert_eq!(system_hit(&mut cache), SYSTEM);
    // Blocks given 10 go before default ones: of two cached prompts, the low one is lost.
    let mut cache = self::cache(EvictionPolicy::Priority);
    let low: Vec<u32> = (500..520).collect();
    let default: Vec<u32> = (700..720).collect();
    let below = RetentionConfig {
        default_priority: 10,
        ..RetentionConfig::default()
    };
    run_once(&mut cache, 1, &low, Some(&below));
    run_once(&mut cache, 2, &default, None);
    // 23 blocks, 10 cached (5 per prompt): 18 fresh ones evict 5, the low prompt's.
    let fresh: Vec<u32> = (900..972).collect();
    run_once(&mut cache, 3, &fresh, None);
    assert_eq!(cache.explain_prefix(&low, None).unwrap().hit_tokens, 0);
    assert_eq!(cache.explain_prefix(&default, None).unwrap().hit_tokens, 16);
}

#[test]
fn a_schedulers_request_priority_counts_at_eviction() {
    let mut cache = cache(EvictionPolicy::Priority);
    let mut scheduler = scheduler(&cache, 1, 64, 0.0);
    let (urgent, background): (Vec<u32>, Vec<u32>) = ((500..520).collect(), (700..720).collect());
    // Request 1 runs at priority 0, request 2 at 30 (lower numbers go first); LRU alone would
    // evict request 1's blocks first, as the older.
    for (seq_id, ids, priority) in [(1u64, &urgent, 0u32), (2, &background, 30)] {
        scheduler
            .add_request(&mut cache, seq_id, Tokens::Ids(ids), 1, 1, priority, 0)
            .unwrap();
    }
    assert!(scheduler
        .set_retention(&mut cache, 9, pin(80, None))
        .is_err());
    assert!(scheduler
        .set_retention(&mut cache, 2, pin(MAX_PRIORITY + 1, None))
        .is_err());
    let too_many = RetentionConfig {
        ranges: vec![pin(50, None).ranges[0]; atb_mem_core::MAX_RETENTION_RANGES + 1],
        ..RetentionConfig::default()
    };
    assert!(scheduler.set_retention(&mut cache, 2, too_many).is_err());
    let mut plan = StepPlan::default();
    let mut finished = Vec::new();
    for _ in 0..8 {
        scheduler.step(&mut cache, 0, &mut plan).unwrap();
        let sampled = plan.sample_seq_ids.clone();
        let tokens = vec![1u32; sampled.len()];
        scheduler
            .on_tokens(&mut cache, &sampled, &tokens, None, &mut finished)
            .unwrap();
    }
    assert!(!cache.contains(1) && !cache.contains(2), "both finished");
    let hits = |cache: &mut KvCache| {
        let mut hit = |ids: &[u32]| cache.explain_prefix(ids, None).unwrap().hit_tokens;
        (hit(&urgent), hit(&background))
    };
    assert_eq!(hits(&mut cache), (16, 16));
    // 18 fresh blocks evict 5: the background request's (at 35 - 30 = 5), not the others.
    run_once(&mut cache, 3, &(900..972).collect::<Vec<u32>>(), None);
    assert_eq!(hits(&mut cache), (16, 0));
}

#[test]
fn bad_retention_is_refused_and_changes_nothing() {
    let mut cache = cache(EvictionPolicy::Priority);
    cache
        .alloc_sequence(1, Tokens::Ids(&with_message(5_000)), None)
        .unwrap();
    let before = format!("{:?}", cache.stats());
    let too_high = pin(MAX_PRIORITY + 1, None);
    let mut backwards = pin(50, None);
    backwards.ranges[0] = TokenRetention {
        start: 8,
        end: Some(8),
        priority: 50,
        duration_ns: None,
    };
    for config in [too_high, backwards] {
        assert!(cache.set_retention(1, &config).is_err(), "{config:?}");
    }
    assert!(
        cache.set_retention(7, &pin(50, None)).is_err(),
        "unknown sequence"
    );
    assert_eq!(before, format!("{:?}", cache.stats()));
    cache.check_invariants().unwrap();
}

/// Retention given to a request already admitted counts its scheduling priority as an
/// admission does.
#[test]
fn retention_after_admission_counts_the_request_priority() {
    let mut cache = cache(EvictionPolicy::Priority);
    let mut scheduler = scheduler(&cache, 1, 64, 0.0);
    let ids: Vec<u32> = (500..520).collect();
    scheduler
        .add_request(&mut cache, 1, Tokens::Ids(&ids), 4, 1, 30, 0)
        .unwrap();
    let mut plan = StepPlan::default();
    scheduler.step(&mut cache, 0, &mut plan).unwrap(); // admitted: its 5 blocks at 35 - 30
    let blocks = cache.block_table(1).unwrap()[..5].to_vec();
    let priorities = |cache: &KvCache| -> Vec<u8> {
        blocks
            .iter()
            .map(|&b| cache.block_pool().priority(b))
            .collect()
    };
    assert_eq!(priorities(&cache), [5; 5]);
    // Ranges given now: 60 where they say, and the rest still lowered by 30.
    let config = RetentionConfig {
        ranges: vec![TokenRetention {
            start: 0,
            end: Some(8),
            priority: 60,
            duration_ns: None,
        }],
        ..RetentionConfig::default()
    };
    scheduler.set_retention(&mut cache, 1, config).unwrap();
    assert_eq!(priorities(&cache), [60, 60, 5, 5, 5]);
}

#[test]
fn a_scheduling_priority_readies_the_priorities_when_the_request_is_added() {
    // The default policy keeps no priorities until a request asks: a request whose scheduling
    // priority lowers its retention asks when it is added, so its admission, inside a step,
    // allocates nothing (a failed allocation there would leave the step half done).
    let mut cache = KvCacheConfig::new(24, BLOCK_SIZE, KvLayout::default())
        .build()
        .unwrap();
    let mut scheduler = scheduler(&cache, 1, 64, 0.0);
    let ids: Vec<u32> = (500..520).collect();
    scheduler
        .add_request(&mut cache, 1, Tokens::Ids(&ids), 4, 1, 0, 0)
        .unwrap();
    let unprioritized = cache.heap_bytes().0;
    scheduler
        .add_request(&mut cache, 2, Tokens::Ids(&ids), 4, 1, 30, 0)
        .unwrap();
    let readied = cache.heap_bytes().0;
    assert!(readied > unprioritized, "nothing readied at add_request");
    let mut plan = StepPlan::default();
    scheduler.step(&mut cache, 0, &mut plan).unwrap();
    assert_eq!(cache.heap_bytes().0, readied, "the step allocated");
    // Under a policy that keeps none, a scheduling priority is only a scheduling one.
    let mut lru = KvCacheConfig::new(24, BLOCK_SIZE, KvLayout::default())
        .eviction_policy(EvictionPolicy::Lru)
        .build()
        .unwrap();
    let mut lru_scheduler = scheduler::scheduler(&lru, 1, 64, 0.0);
    lru_scheduler
        .add_request(&mut lru, 1, Tokens::Ids(&ids), 4, 1, 30, 0)
        .unwrap();
}

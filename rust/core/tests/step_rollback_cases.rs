//! A step whose moves fail, in each way a step moves blocks: a copy-on-write after a fork,
//! the copy of a hit that ends inside a block, a swap preemption, a demotion to the host
//! prefix tier and the promotion back, and recurrent states' checkpoints. Each workload runs
//! until a step moves blocks; that step then fails after every possible number of moves.
//!
//! - None ran: the scheduler and the cache are what they were (as `Debug` prints them).
//! - Some ran: the requests whose bytes they destroyed end; every other one keeps its
//!   length, its tier and its blocks, and both invariants hold.
//!
//! Debug builds also check, inside every rollback, that the undo record restored the whole
//! state exactly before the damaged requests were ended.

use atb_mem_core::{
    BlockMove, ContinuousScheduler, CoreError, KvCache, KvCacheConfig, KvLayout, MoveFailure,
    MoveKind, Preemption, SchedulerConfig, StepPlan, Tokens,
};

#[path = "support/recurrent.rs"]
mod recurrent;
use recurrent::hybrid;

#[path = "support/state.rs"]
mod state;
use state::state;

type Pair = (ContinuousScheduler, KvCache);

fn scheduler(cache: &KvCache, max_num_seqs: usize, preemption: Preemption) -> ContinuousScheduler {
    let config = SchedulerConfig {
        max_num_seqs,
        max_num_batched_tokens: 64,
        enable_chunked_prefill: true,
        preemption,
        watermark: 0.0,
    };
    ContinuousScheduler::new(config, cache).unwrap()
}

fn add(pair: &mut Pair, seq_id: u64, ids: &[u32], max_new_tokens: usize, samples: usize) {
    let (scheduler, cache) = pair;
    scheduler
        .add_request(
            cache,
            seq_id,
            Tokens::Ids(ids),
            max_new_tokens,
            samples,
            0,
            0,
        )
        .unwrap();
}

/// Requests of two samples: their first sample is forked into `seq_id + FORKED`.
const FORKS: [u64; 1] = [FORKED_PARENT];
const FORKED_PARENT: u64 = 1_000;
const FORKED: u64 = 100;

/// One step that succeeds, its sampled tokens reported (and forked, see `FORKS`).
fn advance(pair: &mut Pair) -> StepPlan {
    let (scheduler, cache) = pair;
    let mut plan = StepPlan::default();
    scheduler.step(cache, 0, &mut plan).unwrap();
    let mut sampled = plan.sample_seq_ids.clone();
    for &seq_id in &plan.sample_seq_ids {
        let child = seq_id + FORKED;
        if FORKS.contains(&seq_id) && !cache.contains(child) {
            scheduler.fork(cache, seq_id, child).unwrap();
            sampled.push(child);
        }
    }
    let tokens: Vec<u32> = sampled.iter().map(|&id| 7 + id as u32 % 5).collect();
    scheduler
        .on_tokens(cache, &sampled, &tokens, None, &mut Vec::new())
        .unwrap();
    plan
}

/// Runs `pair` until its next step would move blocks; that state, or `None` once nothing is
/// left to run.
fn until_a_step_moves(pair: &mut Pair) -> Option<Pair> {
    for _ in 0..200 {
        let mut ahead = pair.clone();
        let mut plan = StepPlan::default();
        ahead.0.step(&mut ahead.1, 0, &mut plan).unwrap();
        if !plan.moves.is_empty() {
            return Some(pair.clone());
        }
        if plan.decode_seq_ids.is_empty() && plan.prefill_seq_ids.is_empty() {
            return None;
        }
        advance(pair);
    }
    panic!("the workload never ends");
}

/// Fails the step `pair` is about to take after every possible number of its moves; the
/// moves it decides.
fn fail_at_every_move(pair: &Pair, what: &str) -> Vec<BlockMove> {
    let mut planned = Vec::new();
    let mut clean = pair.clone();
    clean
        .0
        .step_executing(&mut clean.1, 0, &mut StepPlan::default(), |moves| {
            planned = moves.to_vec();
            Ok(())
        })
        .unwrap();
    assert!(!planned.is_empty(), "{what}: the step moves no block");
    for attempted in 0..=planned.len() {
        let (mut scheduler, mut cache) = pair.clone();
        let before = state(&scheduler, &cache);
        let mut plan = StepPlan::default();
        let failed = MoveFailure { attempted };
        let result = scheduler.step_executing(&mut cache, 0, &mut plan, |_| Err(failed));
        let context = format!("{what}, {attempted} of {} moves", planned.len());
        match result {
            Err(CoreError::MovesFailed { aborted, .. }) => {
                if attempted == 0 {
                    assert!(aborted.is_empty(), "{context}: {aborted:?}");
                    assert_eq!(state(&scheduler, &cache), before, "{context}");
                }
                for seq_id in pair.1.seq_ids().filter(|id| !aborted.contains(id)) {
                    assert_eq!(
                        cache.seq_len_and_tier(seq_id).ok(),
                        pair.1.seq_len_and_tier(seq_id).ok()
                    );
                    for group in 0..cache.num_groups() {
                        assert_eq!(
                            cache.group_block_table(seq_id, group).ok(),
                            pair.1.group_block_table(seq_id, group).ok(),
                            "{context}: sequence {seq_id}, group {group}"
                        );
                    }
                }
            }
            // Only checkpoint saves failed: they are forgotten and the step stands.
            Ok(()) => assert!(plan.moves.is_empty(), "{context}"),
            Err(error) => panic!("{context}: {error}"),
        }
        cache.check_invariants().unwrap();
        scheduler.check_invariants(&cache).unwrap();
    }
    planned
}

/// Runs a workload, failing each of its first `steps` steps that move blocks; each of those
/// steps' moves.
fn fail_every_moving_step(mut pair: Pair, steps: usize, what: &str) -> Vec<Vec<BlockMove>> {
    let mut stepped = Vec::new();
    while stepped.len() < steps {
        let Some(state) = until_a_step_moves(&mut pair) else {
            break;
        };
        stepped.push(fail_at_every_move(&state, what));
        advance(&mut pair);
    }
    assert!(!stepped.is_empty(), "{what}: no step moved blocks");
    stepped
}

fn kinds(steps: &[Vec<BlockMove>]) -> Vec<MoveKind> {
    let mut kinds: Vec<MoveKind> = steps.iter().flatten().map(|planned| planned.kind).collect();
    kinds.sort_by_key(|&kind| kind as u8);
    kinds.dedup();
    kinds
}

fn ids(first: u32, len: usize) -> Vec<u32> {
    (first..first + len as u32).collect()
}

#[test]
fn a_copy_on_write_after_a_fork() {
    let cache = KvCacheConfig::new(32, 4, KvLayout::default())
        .build()
        .unwrap();
    let mut pair = (scheduler(&cache, 4, Preemption::Recompute), cache);
    add(&mut pair, FORKED_PARENT, &ids(1, 6), 6, 2);
    add(&mut pair, 2, &ids(50, 5), 6, 1);
    let steps = fail_every_moving_step(pair, 3, "fork");
    assert_eq!(kinds(&steps), [MoveKind::Copy]);
}

#[test]
fn the_copy_of_a_hit_that_ends_inside_a_block() {
    let cache = KvCacheConfig::new(32, 8, KvLayout::default())
        .hash_block_size(2)
        .build()
        .unwrap();
    let mut pair = (scheduler(&cache, 4, Preemption::Recompute), cache);
    add(&mut pair, 1, &ids(0, 12), 1, 1);
    for _ in 0..20 {
        advance(&mut pair);
        if pair.1.num_sequences() == 0 {
            break;
        }
    }
    assert_eq!(pair.1.num_sequences(), 0, "the first request ended");
    // The first block whole, then two of the four computed tokens of the ended one's last.
    let mut shared = ids(0, 10);
    shared.extend(ids(500, 5));
    let explained = pair.1.explain_prefix(&shared, None).unwrap();
    assert_eq!((explained.hit_tokens, explained.partial_tokens), (10, 2));
    add(&mut pair, 2, &shared, 2, 1);
    let steps = fail_every_moving_step(pair, 2, "partial hit");
    assert_eq!(kinds(&steps), [MoveKind::Copy]);
}

#[test]
fn a_swap_preemption_and_the_swap_back() {
    let cache = KvCacheConfig::new(9, 4, KvLayout::default())
        .host_blocks(16)
        .build()
        .unwrap();
    let mut pair = (scheduler(&cache, 4, Preemption::Swap), cache);
    add(&mut pair, 1, &ids(0, 10), 12, 1);
    add(&mut pair, 2, &ids(100, 10), 12, 1);
    let steps = fail_every_moving_step(pair, 4, "swap");
    assert_eq!(kinds(&steps), [MoveKind::ToHost, MoveKind::ToDevice]);
}

#[test]
fn a_demotion_to_the_host_tier_and_the_promotion_back() {
    let cache = KvCacheConfig::new(8, 4, KvLayout::default())
        .host_blocks(16)
        .host_prefix_cache(true)
        .build()
        .unwrap();
    let mut pair = (scheduler(&cache, 2, Preemption::Recompute), cache);
    let first = ids(0, 13);
    add(&mut pair, 1, &first, 1, 1);
    add(&mut pair, 2, &ids(300, 17), 1, 1);
    add(&mut pair, 3, &first, 1, 1);
    let steps = fail_every_moving_step(pair, 4, "host prefix tier");
    assert_eq!(kinds(&steps), [MoveKind::ToHost, MoveKind::ToDevice]);
}

#[test]
fn recurrent_states_resume_from_checkpoints_and_save_them() {
    // Checkpoints at every block, a host tier of 32 blocks.
    let cache = hybrid(96);
    let mut pair = (scheduler(&cache, 2, Preemption::Recompute), cache);
    let mut second = ids(0, 12);
    second.extend(ids(900, 6));
    add(&mut pair, 1, &ids(0, 13), 2, 1);
    add(&mut pair, 2, &second, 2, 1);
    let steps = fail_every_moving_step(pair, 6, "recurrent states");
    assert!(kinds(&steps).contains(&MoveKind::Copy), "{steps:?}");
}

/// A swap-in reads a host block; a demotion later in the same step writes into it (the host
/// tier handed it out again once the read was planned).
#[test]
fn a_demotion_into_a_host_block_a_swap_in_read() {
    let cache = KvCacheConfig::new(8, 4, KvLayout::default())
        .host_blocks(6)
        .host_prefix_cache(true)
        .build()
        .unwrap();
    let mut pair = (scheduler(&cache, 3, Preemption::Swap), cache);
    add(&mut pair, 1, &ids(0, 9), 10, 1);
    add(&mut pair, 2, &ids(100, 9), 10, 1);
    add(&mut pair, 3, &ids(200, 9), 10, 1);
    let steps = fail_every_moving_step(pair, 12, "swap over a host prefix tier");
    let read_then_written = steps.iter().any(|moves| {
        moves.iter().enumerate().any(|(at, read)| {
            read.kind == MoveKind::ToDevice
                && moves[at + 1..]
                    .iter()
                    .any(|write| write.kind == MoveKind::ToHost && write.dst == read.src)
        })
    });
    assert!(read_then_written, "{steps:?}");
}

//! A request of several samples on a model with recurrent states forks them at its first
//! token, each fork taking blocks for its own states: admission keeps those blocks, so the
//! fork never runs out of them however busy the cache is. The request waits until there is
//! room for them, and no other sequence takes them meanwhile.

use atb_mem_core::{ContinuousScheduler, CoreError, KvCache, StepPlan, Tokens};

#[path = "support/scheduler.rs"]
mod scheduler;
use scheduler::scheduler;

#[path = "support/recurrent.rs"]
mod recurrent;
use recurrent::{hybrid, BLOCK_SIZE};

const STATE_BLOCKS: usize = 6;

fn step(scheduler: &mut ContinuousScheduler, cache: &mut KvCache) -> StepPlan {
    let mut plan = StepPlan::default();
    scheduler.step(cache, 0, &mut plan).unwrap();
    scheduler.check_invariants(cache).unwrap();
    plan
}

fn sample(scheduler: &mut ContinuousScheduler, cache: &mut KvCache, plan: &StepPlan) {
    let tokens = vec![7; plan.sample_seq_ids.len()];
    scheduler
        .on_tokens(cache, &plan.sample_seq_ids, &tokens, None, &mut Vec::new())
        .unwrap();
}

fn prompt(first: u32, blocks: usize) -> Vec<u32> {
    (first..first + (blocks * BLOCK_SIZE) as u32).collect()
}

/// Two running requests of 9 blocks and their states leave 9 of 39 blocks free.
fn busy() -> (ContinuousScheduler, KvCache) {
    let mut cache = hybrid(40);
    let mut scheduler = scheduler(&cache, 8, 256, 0.0);
    for (seq_id, first) in [(1, 100), (2, 200)] {
        let ids = prompt(first, 9);
        scheduler
            .add_request(&mut cache, seq_id, Tokens::Ids(&ids), 64, 1, 0, 0)
            .unwrap();
    }
    let plan = step(&mut scheduler, &mut cache);
    sample(&mut scheduler, &mut cache, &plan);
    assert_eq!(cache.num_free_blocks(), 39 - 2 * (9 + STATE_BLOCKS));
    (scheduler, cache)
}

#[test]
fn a_request_waits_for_its_forks_states_then_forks() {
    let (mut scheduler, mut cache) = busy();
    // The two decodes take a block each, leaving 7: room for the prompt's block and its
    // states, not for its second sample's states.
    let ids = prompt(300, 1);
    scheduler
        .add_request(&mut cache, 3, Tokens::Ids(&ids), 8, 2, 0, 0)
        .unwrap();
    let plan = step(&mut scheduler, &mut cache);
    assert!(
        !plan.prefill_seq_ids.contains(&3),
        "admitted without its fork's states"
    );
    assert_eq!(scheduler.num_waiting(), 1);
    sample(&mut scheduler, &mut cache, &plan);
    scheduler.abort(&mut cache, 1).unwrap();
    let plan = step(&mut scheduler, &mut cache);
    assert_eq!(plan.prefill_seq_ids, [3]);
    scheduler.fork(&mut cache, 3, 30).unwrap();
    assert_eq!(cache.state_blocks(30).unwrap().len(), STATE_BLOCKS);
    sample(&mut scheduler, &mut cache, &plan);
    scheduler.check_invariants(&cache).unwrap();
}

#[test]
fn decodes_preempt_rather_than_take_the_blocks_kept_for_a_fork() {
    // 33 blocks; a budget of 4 tokens a step, so a prompt's prefill spans steps.
    let mut cache = hybrid(34);
    let mut scheduler = scheduler(&cache, 8, 4, 0.0);
    let ids = prompt(100, 9);
    scheduler
        .add_request(&mut cache, 1, Tokens::Ids(&ids), 12, 1, 0, 0)
        .unwrap();
    let mut plan = step(&mut scheduler, &mut cache);
    while plan.sample_seq_ids.is_empty() {
        plan = step(&mut scheduler, &mut cache);
    }
    sample(&mut scheduler, &mut cache, &plan);
    // Request 1's next decode takes a block, leaving 17: exactly request 3's 5 blocks, its
    // states and its second sample's. Its prefill (3 tokens a step beside the decode) ends
    // after request 1's decodes fill that block and need another: that decode must preempt
    // rather than take a block kept for the fork.
    let ids = prompt(300, 5);
    scheduler
        .add_request(&mut cache, 3, Tokens::Ids(&ids), 4, 2, 0, 0)
        .unwrap();
    let mut forked = false;
    for _ in 0..100 {
        let plan = step(&mut scheduler, &mut cache);
        let idle = plan.prefill_seq_ids.is_empty() && plan.decode_seq_ids.is_empty();
        if idle && scheduler.num_waiting() == 0 {
            break;
        }
        if !forked && plan.sample_seq_ids.contains(&3) {
            scheduler.fork(&mut cache, 3, 30).unwrap();
            forked = true;
        }
        sample(&mut scheduler, &mut cache, &plan);
    }
    assert!(forked);
    assert!(
        scheduler.num_preemptions() > 0,
        "the decode took the fork's blocks"
    );
    scheduler.check_invariants(&cache).unwrap();
}

#[test]
fn a_request_whose_forks_could_never_fit_is_refused() {
    // 39 usable blocks: a 4-block prompt's first token takes 5 and its states 6, and four
    // forks' states (24) fit beside them; five forks' (30) never would: it would wait for
    // ever.
    let mut cache = hybrid(40);
    let mut scheduler = scheduler(&cache, 8, 256, 0.0);
    let ids = prompt(100, 4);
    let error = scheduler
        .add_request(&mut cache, 1, Tokens::Ids(&ids), 8, 6, 0, 0)
        .unwrap_err();
    assert!(error.to_string().contains("recurrent states"), "{error}");
    assert_eq!(scheduler.num_waiting(), 0);
    scheduler
        .add_request(&mut cache, 1, Tokens::Ids(&ids), 8, 5, 0, 0)
        .unwrap();
    scheduler.check_invariants(&cache).unwrap();
}

#[test]
fn a_fork_beyond_a_requests_samples_leaves_the_blocks_kept_for_planned_ones() {
    let mut cache = hybrid(60);
    let mut scheduler = scheduler(&cache, 16, 256, 0.0);
    let ids = prompt(100, 9);
    scheduler
        .add_request(&mut cache, 1, Tokens::Ids(&ids), 64, 1, 0, 0)
        .unwrap();
    let plan = step(&mut scheduler, &mut cache);
    sample(&mut scheduler, &mut cache, &plan);
    // Request 3's second sample has its states' blocks kept from its admission on.
    let ids = prompt(300, 1);
    scheduler
        .add_request(&mut cache, 3, Tokens::Ids(&ids), 8, 2, 0, 0)
        .unwrap();
    let plan = step(&mut scheduler, &mut cache);
    assert_eq!(plan.sample_seq_ids, [1, 3]);
    // Request 1 asked for one sample: forks beyond it take free blocks, never those kept.
    let mut child = 100;
    let refused = loop {
        match scheduler.fork(&mut cache, 1, child) {
            Ok(()) => child += 1,
            Err(refused) => break refused,
        }
        assert!(child < 120, "forks never ran out of blocks");
    };
    assert!(child > 100, "no fork beyond the samples fitted at all");
    assert!(
        matches!(refused, CoreError::OutOfBlocks { needed: STATE_BLOCKS, available }
            if available < STATE_BLOCKS && cache.num_free_blocks() >= STATE_BLOCKS),
        "{refused:?} with {} free",
        cache.num_free_blocks()
    );
    scheduler.fork(&mut cache, 3, 50).unwrap();
    scheduler.check_invariants(&cache).unwrap();
    cache.check_invariants().unwrap();
}

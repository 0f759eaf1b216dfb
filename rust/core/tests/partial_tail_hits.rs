//! The computed pieces of an ended sequence's last, partly filled block serve later prompts
//! (`hash_block_size`), as the pieces of a cached full block do: the longest cached prefix
//! at a piece boundary. Such a block is known by its sub-keys only: no KV event names it,
//! the host tier never takes it for a full block, and it is evicted like any cached block.
//!
//! Issue 39 item 7 measured 128-token blocks with pieces of 16: a cached 250-token prompt
//! served 128 tokens to a prompt sharing 200 with it. Here blocks hold 8 tokens and pieces
//! 2, so that prompt is 15 tokens long and the other shares 12.

use atb_mem_core::{BlockMove, EvictionPolicy, KvCache, KvEventKind, Medium, MoveKind, Tokens};

#[path = "support/run_once.rs"]
mod run_once;
use run_once::run_once;
#[path = "support/scheduler.rs"]
mod scheduler;

#[path = "support/pieces.rs"]
mod pieces;
use pieces::{cache, cache_config, BLOCK_SIZE, PIECE};

fn first_prompt() -> Vec<u32> {
    (0..15).collect() // one full block, 7 tokens (3 whole pieces) in the second
}

/// `shared` leading tokens of the first prompt, then tokens it never had.
fn sharing(shared: usize, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|t| if (t as usize) < shared { t } else { 1000 + t })
        .collect()
}

#[test]
fn an_ended_prompts_last_block_serves_its_computed_pieces() {
    for (shared, expected) in [(12, 12), (13, 12), (15, 14), (9, 8)] {
        let mut cache = cache(16, PIECE);
        run_once(&mut cache, 1, &first_prompt());
        let tail = 2; // the first prompt's second block (blocks go out in order)
        let ids = sharing(shared, 24);
        let explained = cache.explain_prefix(&ids, None).unwrap();
        assert_eq!(explained.hit_tokens, expected, "sharing {shared}");
        assert_eq!(explained.partial_tokens, expected - BLOCK_SIZE);
        assert_eq!(explained.tiers, [(Medium::Device, expected)]);
        let hit = cache.alloc_sequence(2, Tokens::Ids(&ids), None).unwrap();
        assert_eq!(hit, expected, "sharing {shared}");
        let table = cache.block_table(2).unwrap().to_vec();
        let mut moves = Vec::new();
        cache.take_moves(&mut moves);
        let copy = BlockMove::new(MoveKind::Copy, tail, table[1]);
        assert_eq!(moves, [copy][..usize::from(expected > BLOCK_SIZE)]);
        cache.check_invariants().unwrap();
        // Ended with nothing computed past its hit, its own last block holds a prefix of
        // the first prompt's pieces and takes over their keys: the longer run stays.
        cache.free_sequence(2).unwrap();
        cache.check_invariants().unwrap();
        let again = cache.explain_prefix(&sharing(15, 24), None).unwrap();
        assert_eq!(again.hit_tokens, 14, "after sharing {shared}");
    }
    // The same prompt, whole: its last token is computed, the pieces before it are not.
    let mut cache = cache(16, PIECE);
    run_once(&mut cache, 1, &first_prompt());
    assert_eq!(run_once(&mut cache, 2, &first_prompt()).0, 14);
}

/// An engine's request: a 12-token prompt (200 at 128) and 4 sampled tokens, of which the
/// last is never computed. A prompt sharing 10 of its tokens (160 at 128) gets all 10.
#[test]
fn an_ended_request_leaves_the_pieces_its_decode_computed() {
    let mut cache = cache(16, PIECE);
    let prompt: Vec<u32> = (0..12).collect();
    cache.alloc_sequence(1, Tokens::Ids(&prompt), None).unwrap();
    cache.mark_computed(1, Some(12)).unwrap();
    let mut slots = Vec::new();
    for token in 12..15 {
        cache
            .append_tokens(&[1], 1, Some(&[token]), &mut slots)
            .unwrap();
        cache.mark_computed(1, Some(token as usize + 1)).unwrap();
    }
    cache.free_sequence(1).unwrap();
    cache.check_invariants().unwrap();
    let explained = cache.explain_prefix(&sharing(10, 24), None).unwrap();
    assert_eq!((explained.hit_tokens, explained.partial_tokens), (10, 2));
    // Tokens appended but never computed serve nothing.
    let mut cache = self::cache(16, PIECE);
    cache.alloc_sequence(1, Tokens::Ids(&prompt), None).unwrap();
    cache.mark_computed(1, Some(10)).unwrap();
    cache.free_sequence(1).unwrap();
    let explained = cache.explain_prefix(&sharing(12, 24), None).unwrap();
    assert_eq!(explained.hit_tokens, 10);
}

/// No KV event names a block known by pieces only (routers know full blocks), and the host
/// tier, which serves whole blocks, never takes it for one.
#[test]
fn a_block_of_pieces_makes_no_event_and_is_never_demoted() {
    let mut cache = cache_config(6, PIECE) // 5 usable
        .host_blocks(8)
        .host_prefix_cache(true)
        .kv_events(true)
        .build()
        .unwrap();
    run_once(&mut cache, 1, &first_prompt());
    let stored: Vec<(KvEventKind, usize)> = cache.take_kv_events(|log| {
        log.events()
            .iter()
            .map(|event| (event.kind, log.hashes(event).len()))
            .collect()
    });
    assert_eq!(stored, [(KvEventKind::BlockStored, 1)]);
    assert_eq!(cache.block_pool().num_cached(), 1);
    assert_eq!(
        cache.stats().blocks_cached,
        2,
        "the full block and the pieces"
    );
    // An unrelated prompt takes every block: both cached ones are evicted, one demoted.
    run_once(&mut cache, 2, &(500..540).collect::<Vec<u32>>());
    let counters = cache.host_prefix_counters();
    assert_eq!(counters.demoted, 1);
    let removed: usize = cache.take_kv_events(|log| {
        log.events()
            .iter()
            .filter(|event| event.kind == KvEventKind::BlockRemoved)
            .filter(|event| event.medium == Medium::Device)
            .map(|event| log.hashes(event).len())
            .sum()
    });
    assert_eq!(removed, 1);
    let explained = cache.explain_prefix(&sharing(12, 24), None).unwrap();
    assert_eq!(explained.tiers, [(Medium::Host, BLOCK_SIZE)]);
    assert_eq!(explained.partial_tokens, 0);
    cache.check_invariants().unwrap();
}

/// The pieces are released first, so they are evicted before the blocks they continue,
/// and once evicted (their block rewritten) they are found no more.
#[test]
fn the_pieces_are_evicted_first_and_then_found_no_more() {
    for policy in EvictionPolicy::ALL {
        let mut cache = cache_config(5, PIECE) // 4 usable: 2 cached, 2 free
            .eviction_policy(policy)
            .build()
            .unwrap();
        run_once(&mut cache, 1, &first_prompt());
        cache
            .alloc_sequence(2, Tokens::Count(3 * BLOCK_SIZE), None)
            .unwrap();
        let explained = cache.explain_prefix(&sharing(12, 24), None).unwrap();
        assert_eq!(
            (explained.hit_tokens, explained.partial_tokens),
            (BLOCK_SIZE, 0),
            "{policy:?}"
        );
        cache.check_invariants().unwrap();
    }
}

/// A last block a fork still shares is the fork's to write: it is cached when its last
/// holder ends, with that holder's computed pieces.
#[test]
fn a_shared_last_block_is_cached_by_its_last_holder() {
    let mut cache = cache(16, PIECE);
    let prompt: Vec<u32> = (0..12).collect();
    cache.alloc_sequence(1, Tokens::Ids(&prompt), None).unwrap();
    cache.mark_computed(1, Some(12)).unwrap();
    cache.fork(1, 2).unwrap();
    cache.free_sequence(1).unwrap();
    let hit = |cache: &mut KvCache| {
        let explained = cache.explain_prefix(&sharing(12, 24), None).unwrap();
        explained.hit_tokens
    };
    assert_eq!(hit(&mut cache), BLOCK_SIZE);
    // The fork writes the block in place now (it holds it alone), then ends.
    let mut slots = Vec::new();
    cache
        .append_tokens(&[2], 1, Some(&[12]), &mut slots)
        .unwrap();
    assert_eq!(cache.num_pending_moves(), 0);
    cache.mark_computed(2, Some(13)).unwrap();
    cache.free_sequence(2).unwrap();
    assert_eq!(hit(&mut cache), 12);
    cache.check_invariants().unwrap();
}

/// Without `hash_block_size` an ended sequence's last block is free, as before.
#[test]
fn without_hash_block_size_the_last_block_is_free() {
    let mut plain = cache(16, BLOCK_SIZE);
    run_once(&mut plain, 1, &first_prompt());
    assert_eq!(plain.stats().blocks_cached, 1);
    let explained = plain.explain_prefix(&sharing(12, 24), None).unwrap();
    assert_eq!((explained.hit_tokens, explained.partial_tokens), (8, 0));
}

/// A request whose next block a lower tier loads whole gives its partial hit up: the load
/// rewrites those pieces (a failed one with garbage), so they are not computed until it
/// lands, and a request that ends before then leaves none of them cached.
#[test]
fn a_loaded_block_is_not_computed_by_its_copied_pieces() {
    use atb_mem_core::StepPlan;
    let mut cache = cache(16, PIECE);
    run_once(&mut cache, 1, &first_prompt());
    let mut scheduler = scheduler::scheduler(&cache, 4, 64, 0.0);
    // The first prompt's tokens and more: its second block is full, and a store holds it.
    let ids: Vec<u32> = (0..20).collect();
    scheduler
        .add_request(&mut cache, 2, Tokens::Ids(&ids), 1, 1, 0, 0)
        .unwrap();
    scheduler.offer_external_prefix(&cache, 2, 2).unwrap();
    let mut plan = StepPlan::default();
    scheduler.step(&mut cache, 0, &mut plan).unwrap();
    assert_eq!(plan.loads.len(), 1, "its second block is loaded");
    assert_eq!(cache.num_computed(2).unwrap(), BLOCK_SIZE);
    // Aborted while loading, and the load fails: nothing of that block is cached.
    scheduler.abort(&mut cache, 2).unwrap();
    scheduler.finish_loads(&mut cache, &[2], &[false]).unwrap();
    cache.check_invariants().unwrap();
    let (hit, moves) = run_once(&mut cache, 3, &sharing(14, 24));
    assert_eq!(hit, 14);
    assert_eq!(
        moves[0].src, 2,
        "the first prompt's last block serves the pieces"
    );
}

//! The host prefix tier: cached blocks the device evicts are demoted to host blocks and a
//! later lookup promotes them back, with the moves in an order that is always correct.

use atb_mem_core::{
    BlockHash, BlockMove, KvCache, KvCacheConfig, KvEventKind, KvLayout, Medium, MoveKind, Tokens,
};

#[path = "support/chain.rs"]
mod chain;
#[path = "support/run_once.rs"]
mod run_once;
use run_once::run_once;

const BLOCK_SIZE: usize = 4;

fn cache(num_blocks: usize, host_blocks: usize) -> KvCache {
    KvCacheConfig::new(num_blocks, BLOCK_SIZE, KvLayout::default())
        .host_blocks(host_blocks)
        .host_prefix_cache(true)
        .build()
        .unwrap()
}

fn prompt(first: u32, blocks: usize) -> Vec<u32> {
    (0..(blocks * BLOCK_SIZE + 1) as u32)
        .map(|t| first + t)
        .collect()
}

#[test]
fn an_evicted_prefix_is_demoted_then_promoted_back() {
    // 2 full blocks + 1 partial per prompt: 3 blocks; the device has 4 usable.
    let mut cache = cache(5, 8);
    let (a, b) = (prompt(0, 2), prompt(1000, 2));
    assert_eq!(run_once(&mut cache, 1, &a).0, 0);
    let (_, moves) = run_once(&mut cache, 2, &b);
    // b's three blocks took the two free ones and evicted a's LRU cached block (its tail,
    // released first): demoted, not dropped.
    assert_eq!(
        moves,
        [BlockMove::new(MoveKind::ToHost, 2, 1)],
        "a demotion per eviction"
    );
    assert_eq!(cache.stats().host_blocks_cached, 1);
    let explained = cache.explain_prefix(&a, None).unwrap();
    assert_eq!(explained.hit_tokens, 2 * BLOCK_SIZE);
    assert_eq!(
        explained.tiers,
        [(Medium::Device, BLOCK_SIZE), (Medium::Host, BLOCK_SIZE)]
    );
    let (hit, moves) = run_once(&mut cache, 3, &a);
    assert_eq!(hit, 2 * BLOCK_SIZE);
    let promotions: Vec<_> = moves
        .iter()
        .filter(|planned| planned.kind == MoveKind::ToDevice)
        .collect();
    assert_eq!(promotions.len(), 1, "{moves:?}");
    assert_eq!(promotions[0].src, 1, "from the host copy");
    let stats = cache.stats();
    assert_eq!(stats.prefix_cache_host_hit_tokens as usize, BLOCK_SIZE);
    assert_eq!(stats.host_prefix.promoted, 1);
    assert_eq!(stats.host_prefix.demoted as usize, 1 + moves.len() - 1);
}

/// (kind, medium, hashes) of the events since the last call.
fn events(cache: &mut KvCache) -> Vec<(KvEventKind, Medium, Vec<BlockHash>)> {
    cache.take_kv_events(|log| {
        log.events()
            .iter()
            .map(|event| (event.kind, event.medium, log.hashes(event).to_vec()))
            .collect()
    })
}

fn chain(tokens: &[u32]) -> Vec<BlockHash> {
    chain::chain(tokens, BLOCK_SIZE)
}

#[test]
fn a_demotion_is_stored_on_the_host_and_its_eviction_removed() {
    let mut cache = KvCacheConfig::new(5, BLOCK_SIZE, KvLayout::default())
        .host_blocks(1)
        .host_prefix_cache(true)
        .kv_events(true)
        .build()
        .unwrap();
    let (a, b, c) = (prompt(0, 2), prompt(1000, 2), prompt(2000, 2));
    run_once(&mut cache, 1, &a);
    events(&mut cache);
    run_once(&mut cache, 2, &b);
    let seen = events(&mut cache);
    let a_tail = chain(&a[..2 * BLOCK_SIZE])[1];
    assert!(
        seen.contains(&(KvEventKind::BlockStored, Medium::Host, vec![a_tail])),
        "the demoted block is stored on the host: {seen:?}"
    );
    assert!(seen.contains(&(KvEventKind::BlockRemoved, Medium::Device, vec![a_tail])));
    // The one host block now takes b's demotion: a's copy leaves the host first.
    run_once(&mut cache, 3, &c);
    let seen = events(&mut cache);
    let removed = seen
        .iter()
        .position(|event| *event == (KvEventKind::BlockRemoved, Medium::Host, vec![a_tail]));
    let stored = seen
        .iter()
        .position(|(kind, medium, _)| (*kind, *medium) == (KvEventKind::BlockStored, Medium::Host));
    assert!(
        matches!((removed, stored), (Some(r), Some(s)) if r < s),
        "{seen:?}"
    );
}

#[test]
fn a_swap_out_that_evicts_a_host_copy_stores_its_own() {
    let mut cache = KvCacheConfig::new(5, BLOCK_SIZE, KvLayout::default())
        .host_blocks(1)
        .host_prefix_cache(true)
        .kv_events(true)
        .build()
        .unwrap();
    let (a, b) = (prompt(0, 2), prompt(1000, 2));
    run_once(&mut cache, 1, &a);
    run_once(&mut cache, 2, &b); // a's tail is the host's one copy
    events(&mut cache);
    // A one-block sequence swapped out takes the host's only block, evicting a's copy.
    let e: Vec<u32> = (4000..4000 + BLOCK_SIZE as u32).collect();
    cache.alloc_sequence(5, Tokens::Ids(&e), None).unwrap();
    cache.mark_computed(5, Some(e.len())).unwrap();
    events(&mut cache);
    cache.swap_out(&[5]).unwrap();
    let seen = events(&mut cache);
    let stored = (KvEventKind::BlockStored, Medium::Host, chain(&e));
    assert!(seen.contains(&stored), "the swap copy is stored: {seen:?}");
    cache.check_invariants().unwrap();
}

//! The host prefix tier: cached blocks the device evicts are demoted to host blocks and a
//! later lookup promotes them back, with the moves in an order that is always correct.

use atb_mem_core::{BlockMove, KvCache, KvLayout, Medium, MoveKind, Tokens};

const BLOCK_SIZE: usize = 4;

fn cache(num_blocks: usize, host_blocks: usize) -> KvCache {
    let mut cache = KvCache::new(num_blocks, BLOCK_SIZE, KvLayout::default(), true).unwrap();
    cache.enable_host_tier(host_blocks).unwrap();
    cache.enable_host_prefix_cache().unwrap();
    cache
}

fn prompt(first: u32, blocks: usize) -> Vec<u32> {
    (0..(blocks * BLOCK_SIZE + 1) as u32)
        .map(|t| first + t)
        .collect()
}

/// Admits, "computes" (marks) and frees a prompt, so its full blocks stay cached.
fn run_once(cache: &mut KvCache, seq_id: u64, ids: &[u32]) -> (usize, Vec<BlockMove>) {
    let hit = cache
        .alloc_sequence(seq_id, Tokens::Ids(ids), None)
        .unwrap();
    let mut moves = Vec::new();
    cache.take_moves(&mut moves);
    cache.mark_computed(seq_id, Some(ids.len())).unwrap();
    cache.free_sequence(seq_id).unwrap();
    cache.check_invariants().unwrap();
    (hit, moves)
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

//! KV-cache events in the scenarios a router sees: blocks stored as they are computed (one
//! event per chain), a prefix hit that stores only its new blocks, evictions, a swap's host
//! copies, a reset that clears everything, and no events at all unless asked for.

use atb_mem_core::{BlockHash, KvCache, KvCacheConfig, KvEventKind, KvLayout, Medium, Tokens};

#[path = "support/chain.rs"]
mod chain;

type Seen = Vec<(
    KvEventKind,
    Medium,
    Option<BlockHash>,
    Vec<BlockHash>,
    Vec<u32>,
)>;

fn take(cache: &mut KvCache) -> Seen {
    cache.take_kv_events(|log| {
        log.events()
            .iter()
            .map(|event| {
                (
                    event.kind,
                    event.medium,
                    event.parent_hash,
                    log.hashes(event).to_vec(),
                    log.token_ids(event).to_vec(),
                )
            })
            .collect()
    })
}

fn cache_with_events(num_blocks: usize) -> KvCache {
    KvCacheConfig::new(num_blocks, 2, KvLayout::default())
        .host_blocks(4)
        .kv_events(true)
        .build()
        .unwrap()
}

fn chain(tokens: &[u32]) -> Vec<BlockHash> {
    chain::chain(tokens, 2)
}

#[test]
fn stores_come_as_chains_and_a_hit_stores_only_its_new_blocks() {
    let mut cache = cache_with_events(8);
    cache
        .alloc_sequence(1, Tokens::Ids(&[1, 2, 3, 4, 5]), None)
        .unwrap();
    assert!(
        take(&mut cache).is_empty(),
        "nothing is stored before it is computed"
    );
    cache.mark_computed(1, Some(5)).unwrap();
    let hashes = chain(&[1, 2, 3, 4, 5, 6]);
    use KvEventKind::*;
    assert_eq!(
        take(&mut cache),
        [(
            BlockStored,
            Medium::Device,
            None,
            hashes[..2].to_vec(),
            vec![1, 2, 3, 4]
        )]
    );
    cache
        .alloc_sequence(2, Tokens::Ids(&[1, 2, 3, 4, 5, 6, 7]), None)
        .unwrap();
    cache.mark_computed(2, Some(7)).unwrap();
    assert_eq!(
        take(&mut cache),
        [(
            BlockStored,
            Medium::Device,
            Some(hashes[1]),
            vec![hashes[2]],
            vec![5, 6]
        )]
    );
}

#[test]
fn evictions_and_swaps_are_reported_per_medium() {
    use KvEventKind::*;
    let mut cache = cache_with_events(4); // 3 usable blocks
    cache
        .alloc_sequence(1, Tokens::Ids(&[1, 2, 3, 4]), None)
        .unwrap();
    cache.mark_computed(1, Some(4)).unwrap();
    let hashes = chain(&[1, 2, 3, 4]);
    cache.swap_out(&[1]).unwrap();
    let seen = take(&mut cache);
    assert_eq!(
        seen.last().unwrap(),
        &(
            BlockStored,
            Medium::Host,
            None,
            hashes.clone(),
            vec![1, 2, 3, 4]
        )
    );
    // A new sequence needs all three device blocks: the two cached ones are evicted, the
    // tail of the prefix first (it was released first).
    cache.alloc_sequence(2, Tokens::Count(6), None).unwrap();
    let tail_first = vec![hashes[1], hashes[0]];
    assert_eq!(
        take(&mut cache),
        [(
            BlockRemoved,
            Medium::Device,
            None,
            tail_first.clone(),
            vec![]
        )]
    );
    cache.free_sequence(2).unwrap();
    cache.swap_in(&[1]).unwrap();
    assert_eq!(
        take(&mut cache),
        [(BlockRemoved, Medium::Host, None, tail_first, vec![])]
    );
    cache.mark_computed(1, None).unwrap();
    assert_eq!(take(&mut cache)[0].3, hashes);
}

#[test]
fn a_reset_that_leaves_nothing_is_one_clear() {
    let mut cache = cache_with_events(8);
    cache
        .alloc_sequence(1, Tokens::Ids(&[1, 2, 3, 4]), None)
        .unwrap();
    cache.mark_computed(1, Some(4)).unwrap();
    take(&mut cache);
    assert_eq!(cache.reset_prefix_cache(), 0, "in use: nothing to drop");
    assert!(take(&mut cache).is_empty());
    cache.free_sequence(1).unwrap();
    assert_eq!(cache.reset_prefix_cache(), 2);
    let seen = take(&mut cache);
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].0, KvEventKind::AllBlocksCleared);
}

#[test]
fn event_ids_increase_across_drains() {
    let mut cache = cache_with_events(8);
    let mut ids = Vec::new();
    for seq in 0..3u64 {
        let tokens = [seq as u32 * 10, 1, 2];
        cache
            .alloc_sequence(seq, Tokens::Ids(&tokens), None)
            .unwrap();
        cache.mark_computed(seq, Some(3)).unwrap();
        ids.extend(
            cache.take_kv_events(|log| log.events().iter().map(|e| e.event_id).collect::<Vec<_>>()),
        );
    }
    assert_eq!(ids, [1, 2, 3]);
}

#[test]
fn without_events_nothing_is_recorded() {
    let mut cache = KvCacheConfig::new(8, 2, KvLayout::default())
        .build()
        .unwrap();
    cache
        .alloc_sequence(1, Tokens::Ids(&[1, 2, 3, 4]), None)
        .unwrap();
    cache.mark_computed(1, Some(4)).unwrap();
    cache.free_sequence(1).unwrap();
    cache.reset_prefix_cache();
    assert!(take(&mut cache).is_empty());
    assert!(!cache.kv_events_enabled());
    cache.alloc_sequence(2, Tokens::Count(1), None).unwrap();
    assert!(!cache.kv_events_enabled());
}

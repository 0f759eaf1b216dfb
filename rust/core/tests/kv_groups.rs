//! KV-cache groups: windows release blocks, prefix hits that every group can serve, and an
//! eviction order that keeps shorter hits whole.

use atb_mem_core::{
    AttentionKind, KvCache, KvCacheConfig, KvLayout, MissReason, Tokens, NULL_BLOCK,
};

const FULL: AttentionKind = AttentionKind::Full;

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

fn tables(cache: &KvCache, seq_id: u64) -> Vec<Vec<u32>> {
    (0..cache.num_groups())
        .map(|group| cache.group_block_table(seq_id, group).unwrap().to_vec())
        .collect()
}

#[test]
fn readmitted_prompt_hits_the_chunk_it_needs() {
    let mut cache = cache(&[AttentionKind::ChunkedLocal { chunk: 4 }, FULL], 16, 2);
    let prompt = [1, 3, 3, 0, 3, 2];
    cache.alloc_sequence(9, Tokens::Ids(&prompt), None).unwrap();
    cache.mark_computed(9, Some(6)).unwrap();
    println!("{:?}", tables(&cache, 9));
    cache.free_sequence(9).unwrap();
    let longer = [1, 3, 3, 0, 3, 2, 3];
    let cached = cache.alloc_sequence(9, Tokens::Ids(&longer), None).unwrap();
    println!("{cached} {:?}", tables(&cache, 9));
    cache.check_invariants().unwrap();
    let t = tables(&cache, 9);
    assert_eq!(t[0][..2], [NULL_BLOCK, NULL_BLOCK]);
    assert_ne!(t[0][2], t[0][3]);
}

/// Every group takes its hits before any group allocates: found by the scheduler model, where
/// the chunked group's fresh block was the full group's unused hit.
#[test]
fn fresh_blocks_never_take_another_groups_hit() {
    let mut cache = cache(&[AttentionKind::ChunkedLocal { chunk: 4 }, FULL], 9, 2);
    let prompt = [1, 3, 3, 0, 3, 2];
    cache.alloc_sequence(9, Tokens::Ids(&prompt), None).unwrap();
    cache.mark_computed(9, Some(6)).unwrap();
    cache.alloc_sequence(1, Tokens::Count(2), None).unwrap();
    cache.free_sequence(9).unwrap();
    // Only cached blocks are left, the full group's hits first in the queue: the fresh ones
    // must come from the chunked group's unneeded blocks.
    cache
        .alloc_sequence(9, Tokens::Ids(&[1, 3, 3, 0, 3, 2, 3]), None)
        .unwrap();
    cache.check_invariants().unwrap();
    let t = tables(&cache, 9);
    assert!(
        t[0].iter().all(|b| *b == NULL_BLOCK || !t[1].contains(b)),
        "{t:?}"
    );
}

const SLIDE4: AttentionKind = AttentionKind::SlidingWindow { window: 4 };

/// Computes a prompt the way the scheduler does: chunk by chunk, marked before the model runs.
fn compute_in_chunks(cache: &mut KvCache, seq_id: u64, len: usize, chunk: usize) {
    let mut done = cache.num_computed(seq_id).unwrap();
    while done < len {
        done = (done + chunk).min(len);
        cache.mark_computed(seq_id, Some(done)).unwrap();
    }
}

fn prompt(len: usize) -> Vec<u32> {
    (0..len as u32).map(|t| t * 7 % 11).collect()
}

#[test]
fn a_window_releases_behind_it_and_a_longer_prefix_still_hits() {
    let mut cache = cache(&[SLIDE4, FULL], 64, 2);
    let first = prompt(20);
    cache.admit_sequence(1, Tokens::Ids(&first), None).unwrap();
    // Admitted lazily: the sliding group holds nothing until computed.
    assert!(tables(&cache, 1)[0].iter().all(|&b| b == NULL_BLOCK));
    compute_in_chunks(&mut cache, 1, 20, 6);
    let sliding = &tables(&cache, 1)[0];
    // The last chunk started at 18: it reads from 15, block 7 on.
    assert!(sliding[..7].iter().all(|&b| b == NULL_BLOCK), "{sliding:?}");
    assert!(sliding[7..].iter().all(|&b| b != NULL_BLOCK), "{sliding:?}");
    // A longer prompt over the same 20 tokens hits all 10 blocks: the full group serves
    // them all, the sliding group the two its first computed token (20) reads (17..19).
    let mut second = first.clone();
    second.extend([1, 2, 3]);
    let cached = cache.admit_sequence(2, Tokens::Ids(&second), None).unwrap();
    assert_eq!(cached, 20);
    let t = tables(&cache, 2);
    assert!(t[0][..8].iter().all(|&b| b == NULL_BLOCK) && t[0][8] == sliding[8]);
    assert_eq!(t[1][..10], tables(&cache, 1)[1][..10]);
    cache.check_invariants().unwrap();
}

#[test]
fn explain_prefix_names_each_reason() {
    use atb_mem_core::MissReason::*;
    let mut cache = cache(&[SLIDE4, FULL], 41, 2);
    let long = prompt(20);
    // Nothing cached yet.
    let why = cache.explain_prefix(&long, None).unwrap();
    assert_eq!((why.hit_tokens, why.reason), (0, NotCached));
    // Shorter than two blocks: alignment allows no hit at all.
    assert_eq!(
        cache.explain_prefix(&long[..2], None).unwrap().reason,
        BlockAlignment
    );
    cache.admit_sequence(1, Tokens::Ids(&long), None).unwrap();
    compute_in_chunks(&mut cache, 1, 20, 4);
    // Everything before the last token is served: only alignment stops it.
    let why = cache.explain_prefix(&long, None).unwrap();
    assert_eq!((why.hit_tokens, why.reason), (18, BlockAlignment));
    // A prefix ending early needs sliding blocks the window released (still cached here).
    let why = cache.explain_prefix(&long[..9], None).unwrap();
    assert_eq!((why.hit_tokens, why.reason), (8, BlockAlignment));
    // Evict everything cached: the full group's misses are evictions now...
    cache.free_sequence(1).unwrap();
    let hog = cache.num_free_blocks() / 2 * 2; // tokens: a block per 2 in each group
    cache.alloc_sequence(9, Tokens::Count(hog), None).unwrap();
    let why = cache.explain_prefix(&long, None).unwrap();
    assert_eq!(
        (why.hit_tokens, why.reason, why.limited_by),
        (0, Evicted, Some(1))
    );
    assert_eq!(why.groups[1].reason, Evicted);
    cache.free_sequence(9).unwrap();
    // ...and with the full group's blocks back but the sliding ones gone, the window stops it.
    let mut cache = cache_with_window_gone();
    let why = cache.explain_prefix(&long, None).unwrap();
    assert_eq!(why.groups[1].cached_tokens, 18);
    assert_eq!(why.groups[0].reason, WindowGone);
    assert!(why.hit_tokens < 18 && why.reason == WindowGone && why.limited_by == Some(0));
    let stats = cache.stats();
    assert!(stats.prefix_cache_misses.iter().sum::<u64>() > 0);
    let layout = KvLayout::default();
    let mut off = KvCacheConfig::new(8, 2, layout)
        .prefix_caching(false)
        .build()
        .unwrap();
    assert_eq!(
        off.explain_prefix(&long, None).unwrap().reason,
        PrefixCachingOff
    );
}

/// `prompt(20)` computed and freed, then three cached blocks evicted: the tail's sliding
/// block, its full block, and the sliding block before (the order `free_sequence` leaves).
fn cache_with_window_gone() -> KvCache {
    let block_size = 2;
    let mut cache = cache(&[SLIDE4, FULL], 41, block_size);
    let long = prompt(20);
    cache.admit_sequence(1, Tokens::Ids(&long), None).unwrap();
    compute_in_chunks(&mut cache, 1, 20, 4);
    cache.free_sequence(1).unwrap();
    // Admitted by count, a sequence takes blocks in the full group only: one per 2 tokens.
    let plain_free = cache.stats().blocks_free;
    let tokens = (plain_free + 3) * block_size;
    cache
        .admit_sequence(9, Tokens::Count(tokens), None)
        .unwrap();
    cache
}

/// Evicting a freed hybrid prefix block by block keeps every shorter hit whole: the hit
/// shrinks a block at a time instead of collapsing (windowed blocks released while the
/// sequence ran are touched when it ends, so they are not evicted first).
#[test]
fn eviction_shortens_hybrid_hits_gracefully() {
    let block_size = 2;
    let mut cache = cache(&[SLIDE4, FULL], 1 + 2 * 10 + 4, block_size);
    let long = prompt(20);
    cache.admit_sequence(1, Tokens::Ids(&long), None).unwrap();
    compute_in_chunks(&mut cache, 1, 20, 4);
    cache.free_sequence(1).unwrap();
    let mut hits = vec![cache.explain_prefix(&long, None).unwrap().hit_tokens];
    let mut id = 100;
    while cache.num_free_blocks() >= 2 {
        // One fresh token per group: evicts (after the free blocks) one block per group.
        cache.alloc_sequence(id, Tokens::Count(1), None).unwrap();
        id += 1;
        hits.push(cache.explain_prefix(&long, None).unwrap().hit_tokens);
    }
    assert_eq!(hits[0], 18);
    println!("{hits:?}");
    for pair in hits.windows(2) {
        assert!(pair[1] + block_size >= pair[0], "a hit collapsed: {hits:?}");
    }
}

/// Windowed groups churn through blocks (a block leaves the window every few tokens), but
/// their misses are explained without the eviction history: their evictions must not push a
/// full group's out of it, or a prompt evicted a moment ago reads as never cached.
#[test]
fn window_churn_keeps_full_evictions_remembered() {
    let slide = AttentionKind::SlidingWindow { window: 1 };
    let mut cache = cache(&[slide, slide, slide, FULL], 64, 1);
    let full = 3;
    let evicted_prompt = [1, 2, 3];
    cache
        .alloc_sequence(1, Tokens::Ids(&evicted_prompt), None)
        .unwrap();
    cache.mark_computed(1, Some(3)).unwrap();
    cache.free_sequence(1).unwrap();
    // Fresh blocks in every group evict most of it.
    cache.alloc_sequence(2, Tokens::Count(15), None).unwrap();
    cache.free_sequence(2).unwrap();
    let reason = |cache: &mut KvCache| {
        let explained = cache.explain_prefix(&evicted_prompt, None).unwrap();
        explained.groups[full].reason
    };
    assert_eq!(reason(&mut cache), MissReason::Evicted);
    // One sequence decodes: each token's three windowed blocks leave the window at once and
    // are evicted by the next tokens' allocations, well over the history's 64 entries.
    cache.alloc_sequence(3, Tokens::Ids(&[7]), None).unwrap();
    cache.mark_computed(3, Some(1)).unwrap();
    let mut token = 10;
    let evictions_before = cache.stats().evictions;
    while cache.num_free_blocks() >= 4 {
        cache
            .append_tokens(&[3], 1, Some(&[token]), &mut Vec::new())
            .unwrap();
        token += 1;
        let len = cache.seq_len(3).unwrap();
        cache.mark_computed(3, Some(len)).unwrap();
    }
    assert!(cache.stats().evictions - evictions_before > 100);
    cache.check_invariants().unwrap();
    assert_eq!(reason(&mut cache), MissReason::Evicted);
}

//! KV-cache groups: windows release blocks, prefix hits that every group can serve, and an
//! eviction order that keeps shorter hits whole.

use atb_mem_core::{AttentionKind, KvCache, KvLayout, Tokens, NULL_BLOCK};

const FULL: AttentionKind = AttentionKind::Full;

fn cache(kinds: &[AttentionKind], num_blocks: usize, block_size: usize) -> KvCache {
    let layout = KvLayout {
        num_layers: kinds.len(),
        ..KvLayout::default()
    };
    KvCache::with_layer_kinds(num_blocks, block_size, layout, true, kinds).unwrap()
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

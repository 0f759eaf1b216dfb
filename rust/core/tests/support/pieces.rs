//! Caches with hits finer than a block, as the directed tests of pieces share them.

use atb_mem_core::{KvCache, KvLayout};

pub const BLOCK_SIZE: usize = 8;
pub const PIECE: usize = 2;

/// `num_blocks` blocks of `BLOCK_SIZE` tokens with prefix keys every `hash_block_size`.
pub fn cache(num_blocks: usize, hash_block_size: usize) -> KvCache {
    let mut cache = KvCache::new(num_blocks, BLOCK_SIZE, KvLayout::default(), true).unwrap();
    cache.set_hash_block_size(hash_block_size).unwrap();
    cache
}

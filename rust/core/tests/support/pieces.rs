//! Caches with hits finer than a block, as the directed tests of pieces share them.

use atb_mem_core::{KvCache, KvCacheConfig, KvLayout};

pub const BLOCK_SIZE: usize = 8;
pub const PIECE: usize = 2;

/// `num_blocks` blocks of `BLOCK_SIZE` tokens with prefix keys every `hash_block_size`.
pub fn cache(num_blocks: usize, hash_block_size: usize) -> KvCache {
    cache_config(num_blocks, hash_block_size).build().unwrap()
}

/// The config `cache` builds, to change a setting of it.
pub fn cache_config(num_blocks: usize, hash_block_size: usize) -> KvCacheConfig {
    KvCacheConfig::new(num_blocks, BLOCK_SIZE, KvLayout::default()).hash_block_size(hash_block_size)
}

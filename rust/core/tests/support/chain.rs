//! The prefix cache's chain hashes of a prompt's full blocks, computed here, apart from the
//! cache, so that tests check its hashing instead of repeating it.

use atb_mem_core::BlockHash;

pub fn chain(tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
    let mut parent = BlockHash::root(None);
    tokens
        .chunks_exact(block_size)
        .map(|block| {
            parent = parent.chain(block);
            parent
        })
        .collect()
}

//! The block pool's sub-block keys (see `sub_block_index`): turned on, registered with a
//! block that joins the cache, looked up, dropped with the block's cache entry.

use super::{BlockPool, Cached};
use crate::alloc::block_hash::BlockHash;
use crate::alloc::fallible::check_bookkeeping;
use crate::alloc::sub_block_index::SubBlockIndex;
use crate::error::CoreResult;

impl BlockPool {
    /// Indexes cached blocks by `per_block` leading sub-blocks too (see `sub_block_index`).
    /// Needs prefix caching.
    pub fn enable_sub_blocks(&mut self, per_block: usize) -> CoreResult<()> {
        ensure!(
            self.enable_prefix_caching,
            "sub-block prefix keys need prefix caching"
        );
        let num_blocks = self.num_blocks();
        let bytes = SubBlockIndex::bytes_for(num_blocks, per_block);
        check_bookkeeping(bytes, || format!("{per_block} sub-block keys per block"))?;
        let what = format!("the sub-block keys of {num_blocks} blocks");
        self.sub_blocks = Some(SubBlockIndex::new(num_blocks, per_block, &what)?);
        Ok(())
    }

    /// Sub-keys per block (0 without sub-block keys).
    pub fn sub_blocks_per_block(&self) -> usize {
        self.sub_blocks.as_ref().map_or(0, SubBlockIndex::per_block)
    }

    /// Indexes a block that just joined the prefix cache under its sub-block keys.
    pub fn register_sub_blocks(&mut self, block: u32, keys: &[BlockHash]) {
        if let Some(sub_blocks) = self.sub_blocks.as_mut() {
            debug_assert!(self.cached[block as usize] != Cached::No);
            sub_blocks.insert(block, keys);
        }
    }

    /// Whether `block` is indexed by its sub-block keys.
    pub fn has_sub_blocks(&self, block: u32) -> bool {
        self.sub_blocks
            .as_ref()
            .is_some_and(|sub_blocks| sub_blocks.is_indexed(block))
    }

    /// A cached block whose first `j` sub-blocks `key` names, and `j`.
    #[inline]
    pub fn lookup_sub_block(&self, key: BlockHash) -> Option<(u32, usize)> {
        self.sub_blocks.as_ref()?.find(key)
    }
}

//! The block pool's sub-block keys (see `sub_block_index`): turned on, registered with a
//! block that joins the cache, looked up, dropped with the block's cache entry; and blocks
//! cached by those keys alone (`keep_pieces`).

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

    /// Indexes a block that just joined the prefix cache under its sub-block keys (`keys`,
    /// one per leading piece: every piece but the last of a full block, the whole computed
    /// ones of a block of pieces). A block of pieces whose every key a newer block took
    /// over can be found no more: it becomes free.
    pub fn register_sub_blocks(&mut self, block: u32, keys: &[BlockHash]) {
        let Some(sub_blocks) = self.sub_blocks.as_mut() else {
            return;
        };
        debug_assert!(self.cached[block as usize] != Cached::No);
        sub_blocks.insert(block, keys);
        while let Some(older) = self
            .sub_blocks
            .as_mut()
            .and_then(SubBlockIndex::pop_keyless)
        {
            if self.is_pieces(older) {
                self.uncache(older);
            }
        }
    }

    /// Whether `keep_pieces` would take `block`: held by its last holder only, and not
    /// cached (a full block has its key; a block a fork shares is the fork's to write).
    pub fn can_keep_pieces(&self, block: u32) -> bool {
        self.sub_blocks.is_some()
            && self.ref_counts[block as usize] == 1
            && self.cached[block as usize] == Cached::No
    }

    /// Caches `block`, which its last holder is about to release, as a block known by the
    /// sub-keys of its computed leading pieces only (registered next, or deferred), under
    /// `identity` (its last piece's key), which `holds` checks: evicted like any cached
    /// block, named by no KV event, never demoted (see `kv_cache::partial_hits`).
    pub fn keep_pieces(&mut self, block: u32, identity: BlockHash) {
        debug_assert!(self.can_keep_pieces(block));
        self.block_hashes.set(block as usize, identity);
        self.cached.set(block as usize, Cached::Pieces);
        self.hits.set(block as usize, 0); // new contents, no history
        self.retention.reset(block);
        self.num_pieces += 1;
    }

    /// Whether `block` is still cached with the contents `key` names: its full key, or a
    /// block of pieces' identity.
    pub fn holds(&self, block: u32, key: BlockHash) -> bool {
        self.is_cached(block) && self.block_hashes[block as usize] == key
    }

    /// Whether `block` is cached by the sub-keys of its pieces only.
    #[inline]
    pub fn is_pieces(&self, block: u32) -> bool {
        self.cached.get(block as usize) == Some(&Cached::Pieces)
    }

    /// Blocks cached by the sub-keys of their pieces only.
    pub fn num_piece_blocks(&self) -> usize {
        self.num_pieces
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

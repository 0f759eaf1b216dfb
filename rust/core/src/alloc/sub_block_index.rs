//! Prefix keys finer than a block: where a cached block's first `j · hash_block_size`
//! tokens can be found.
//!
//! A cached block of `block_size` tokens is found by its full key (`BlockHash::chain` of its
//! tokens after its parent's key). With `hash_block_size = H` dividing `block_size = B`, it
//! is also found by `B / H - 1` sub-keys: `s_1 = parent.chain(tokens[..H])`,
//! `s_j = s_{j-1}.chain(tokens[(j-1)H..jH])`. A prompt that shares only the first `j · H`
//! tokens of a block computes the same `s_j`, and the block's first `j · H` slots serve it
//! (copied, since the block itself belongs to the prefix it completes).
//!
//! Entries are `block · per_block + (j - 1)`; the table holds ids only (its keys live in
//! `keys`), like the full-key table. Sub-keys live exactly as long as the block's full key:
//! the pool drops them when the block leaves the prefix cache.

use crate::alloc::block_hash::BlockHash;
use crate::alloc::fallible::{array_bytes, total_bytes, try_filled_vec};
use crate::alloc::index_table::IndexTable;
use crate::error::CoreResult;

#[derive(Debug, Clone)]
pub struct SubBlockIndex {
    /// Sub-keys per block: `block_size / hash_block_size - 1`.
    per_block: usize,
    keys: Vec<BlockHash>,
    /// Per block, whether its sub-keys are in `table`.
    indexed: Vec<bool>,
    table: IndexTable,
}

impl SubBlockIndex {
    /// Host bytes an index of `num_blocks` blocks with `per_block` sub-keys each takes.
    pub fn bytes_for(num_blocks: usize, per_block: usize) -> Option<u64> {
        let entries = num_blocks.checked_mul(per_block)?;
        total_bytes(&[
            array_bytes::<BlockHash>(entries),
            array_bytes::<bool>(num_blocks),
            IndexTable::bytes_for(entries),
        ])
    }

    pub fn new(num_blocks: usize, per_block: usize, what: &str) -> CoreResult<Self> {
        let entries = num_blocks
            .checked_mul(per_block)
            .filter(|&entries| entries < u32::MAX as usize)
            .ok_or_else(|| {
                invalid!("{num_blocks} blocks × {per_block} sub-block keys exceed 2**32 entries")
            })?;
        Ok(SubBlockIndex {
            per_block,
            keys: try_filled_vec(entries, BlockHash::default(), what)?,
            indexed: try_filled_vec(num_blocks, false, what)?,
            table: IndexTable::new(entries, what)?,
        })
    }

    pub fn per_block(&self) -> usize {
        self.per_block
    }

    /// Indexes `block` under `keys` (`s_1 ..`, `per_block` of them). Two blocks may share a
    /// sub-key (their first tokens agree, their last do not): both are indexed, and a lookup
    /// finds either.
    pub fn insert(&mut self, block: u32, keys: &[BlockHash]) {
        debug_assert_eq!(keys.len(), self.per_block);
        debug_assert!(!self.indexed[block as usize]);
        let first = block as usize * self.per_block;
        for (j, &key) in keys.iter().enumerate() {
            self.keys[first + j] = key;
            self.table.insert((first + j) as u32, key.0[0]);
        }
        self.indexed[block as usize] = true;
    }

    pub fn is_indexed(&self, block: u32) -> bool {
        self.indexed[block as usize]
    }

    /// Drops `block`'s sub-keys (nothing if it has none).
    pub fn remove(&mut self, block: u32) {
        if !std::mem::replace(&mut self.indexed[block as usize], false) {
            return;
        }
        let first = block as usize * self.per_block;
        let keys = &self.keys;
        for entry in first..first + self.per_block {
            self.table
                .remove(entry as u32, keys[entry].0[0], |id| keys[id as usize].0[0]);
        }
    }

    /// The block whose first `j · hash_block_size` tokens `key` names, and `j`.
    #[inline]
    pub fn find(&self, key: BlockHash) -> Option<(u32, usize)> {
        let keys = &self.keys;
        let entry = self.table.find(key.0[0], |id| keys[id as usize] == key)? as usize;
        Some(((entry / self.per_block) as u32, entry % self.per_block + 1))
    }

    pub fn heap_bytes(&self) -> usize {
        self.keys.capacity() * std::mem::size_of::<BlockHash>()
            + self.indexed.capacity()
            + self.table.heap_bytes()
    }

    /// Checks that every indexed block's entries are in the table, that nothing else is, and
    /// that only blocks `is_cached` accepts are indexed.
    pub fn check(&self, is_cached: impl Fn(u32) -> bool) -> Result<(), String> {
        let mut entries = 0;
        for (block, _) in self.indexed.iter().enumerate().filter(|(_, &on)| on) {
            if !is_cached(block as u32) {
                return Err(format!(
                    "block {block} has sub-block keys but is not cached"
                ));
            }
            let first = block * self.per_block;
            for entry in first..first + self.per_block {
                let key = self.keys[entry];
                if self
                    .table
                    .find(key.0[0], |id| id as usize == entry)
                    .is_none()
                {
                    let j = entry - first + 1;
                    return Err(format!("sub-block key {j} of block {block} is lost"));
                }
                entries += 1;
            }
        }
        if entries != self.table.len() {
            return Err(format!(
                "{entries} sub-block entries are indexed, the table holds {}",
                self.table.len()
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u64) -> BlockHash {
        BlockHash([n, n ^ 0xABCD])
    }

    #[test]
    fn finds_each_sub_key_until_its_block_is_removed() {
        let mut index = SubBlockIndex::new(8, 3, "test").unwrap();
        index.insert(2, &[key(1), key(2), key(3)]);
        index.insert(5, &[key(4), key(5), key(6)]);
        assert_eq!(index.find(key(2)), Some((2, 2)));
        assert_eq!(index.find(key(6)), Some((5, 3)));
        assert_eq!(index.find(key(7)), None);
        index.remove(2);
        assert_eq!(index.find(key(1)), None);
        assert_eq!(index.find(key(4)), Some((5, 1)));
        index.remove(2); // nothing left to remove
        index.check(|block| block == 5).unwrap();
    }

    #[test]
    fn a_shared_key_is_found_while_either_block_holds_it() {
        // Two blocks whose first sub-block has the same tokens after the same parent.
        let mut index = SubBlockIndex::new(8, 2, "test").unwrap();
        index.insert(1, &[key(1), key(2)]);
        index.insert(3, &[key(1), key(9)]);
        assert!(matches!(index.find(key(1)), Some((1 | 3, 1))));
        index.check(|_| true).unwrap();
        index.remove(1);
        assert_eq!(index.find(key(1)), Some((3, 1)));
        assert_eq!(index.find(key(2)), None);
        index.check(|block| block == 3).unwrap();
        assert!(index.check(|_| false).is_err());
    }
}

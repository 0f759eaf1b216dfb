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
//! `keys`), like the full-key table. Sub-keys live exactly as long as the block's cache
//! entry: the pool drops them when the block leaves the prefix cache. A block known by its
//! pieces only (an ended sequence's last, partly computed block) has fewer: one per whole
//! computed piece.

use crate::alloc::block_hash::BlockHash;
use crate::alloc::fallible::{array_bytes, total_bytes, try_filled_vec};
use crate::alloc::index_table::IndexTable;
use crate::error::CoreResult;
use crate::undo::{Undo, UndoVec};

#[derive(Debug, Clone)]
pub struct SubBlockIndex {
    /// Sub-keys per block: `block_size / hash_block_size - 1`.
    per_block: usize,
    keys: UndoVec<BlockHash>,
    /// Per block, whether its sub-keys are in `table`.
    indexed: UndoVec<bool>,
    table: IndexTable,
    /// Blocks the last `insert` took every held key from (see `pop_keyless`).
    keyless: Vec<u32>,
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
            keys: UndoVec::new(try_filled_vec(entries, BlockHash::default(), what)?),
            indexed: UndoVec::new(try_filled_vec(num_blocks, false, what)?),
            table: IndexTable::new(entries, what)?,
            keyless: Vec::new(),
        })
    }

    pub fn per_block(&self) -> usize {
        self.per_block
    }

    /// Indexes `block` under `keys` (`s_1 ..`, at most `per_block` of them). Blocks whose
    /// first pieces agree share those sub-keys (a system prompt that ends inside a block, and
    /// every request's block there): the newest holds each key, as the one evicted last,
    /// so equal keys never pile up in the table. Older blocks left holding no key are kept
    /// for `pop_keyless`: a block known only by its pieces is of no use any more then.
    pub fn insert(&mut self, block: u32, keys: &[BlockHash]) {
        debug_assert!(keys.len() <= self.per_block);
        debug_assert!(!self.indexed[block as usize]);
        self.keyless.clear();
        let first = block as usize * self.per_block;
        for (j, &key) in keys.iter().enumerate() {
            self.keys.set(first + j, key);
            if let Some(older) = self.find_entry(key) {
                let keys = &self.keys;
                self.table
                    .remove(older, key.0[0], |id| keys[id as usize].0[0]);
                self.keyless.push(older / self.per_block as u32);
            }
            self.table.insert((first + j) as u32, key.0[0]);
        }
        self.indexed.set(block as usize, true);
        self.keyless.sort_unstable();
        self.keyless.dedup();
        let mut keyless = std::mem::take(&mut self.keyless);
        keyless.retain(|&older| !self.holds_any(older));
        self.keyless = keyless;
    }

    /// A block the last `insert` took every held key from, once each.
    pub fn pop_keyless(&mut self) -> Option<u32> {
        self.keyless.pop()
    }

    fn holds_any(&self, block: u32) -> bool {
        let first = block as usize * self.per_block;
        (first..first + self.per_block)
            .any(|entry| self.find_entry(self.keys[entry]) == Some(entry as u32))
    }

    pub fn is_indexed(&self, block: u32) -> bool {
        self.indexed[block as usize]
    }

    /// Drops `block`'s sub-keys (nothing if it has none); a key a newer block took over
    /// stays with it.
    pub fn remove(&mut self, block: u32) {
        if !self.indexed[block as usize] {
            return;
        }
        self.indexed.set(block as usize, false);
        let first = block as usize * self.per_block;
        for entry in first..first + self.per_block {
            let key = self.keys[entry];
            if self.find_entry(key) == Some(entry as u32) {
                let keys = &self.keys;
                self.table
                    .remove(entry as u32, key.0[0], |id| keys[id as usize].0[0]);
            }
        }
    }

    #[inline]
    fn find_entry(&self, key: BlockHash) -> Option<u32> {
        let keys = &self.keys;
        self.table.find(key.0[0], |id| keys[id as usize] == key)
    }

    /// The block whose first `j · hash_block_size` tokens `key` names, and `j`.
    #[inline]
    pub fn find(&self, key: BlockHash) -> Option<(u32, usize)> {
        let entry = self.find_entry(key)? as usize;
        Some(((entry / self.per_block) as u32, entry % self.per_block + 1))
    }

    pub fn heap_bytes(&self) -> usize {
        self.keys.capacity() * std::mem::size_of::<BlockHash>()
            + self.indexed.capacity()
            + self.table.heap_bytes()
            + self.keyless.capacity() * 4
    }

    /// Checks that every table entry is an indexed block's own (none outlives its block)
    /// and that only blocks `is_cached` accepts are indexed. A key may be held by no block:
    /// its newest holder left, and the older ones had handed it over.
    pub fn check(&self, is_cached: impl Fn(u32) -> bool) -> Result<(), String> {
        let mut held = 0;
        for (block, _) in self.indexed.iter().enumerate().filter(|(_, &on)| on) {
            if !is_cached(block as u32) {
                return Err(format!(
                    "block {block} has sub-block keys but is not cached"
                ));
            }
            let first = block * self.per_block;
            held += (first..first + self.per_block)
                .filter(|&entry| self.find_entry(self.keys[entry]) == Some(entry as u32))
                .count();
        }
        if held != self.table.len() {
            return Err(format!(
                "indexed blocks hold {held} sub-block keys, the table {}",
                self.table.len()
            ));
        }
        Ok(())
    }
}

impl SubBlockIndex {
    /// The parts that record their own changes: all of it but `keyless`, which is no state
    /// (`insert` fills it for its caller, who empties it at once).
    fn undo_parts(&mut self) -> impl Undo + '_ {
        (&mut self.keys, &mut self.indexed, &mut self.table)
    }
}

impl Undo for SubBlockIndex {
    fn begin(&mut self) {
        self.undo_parts().begin();
    }

    fn commit(&mut self) {
        self.undo_parts().commit();
    }

    fn rollback(&mut self) {
        self.undo_parts().rollback();
        self.keyless.clear();
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
    fn a_shared_key_is_held_by_its_newest_block() {
        // Two blocks whose first sub-block has the same tokens after the same parent.
        let mut index = SubBlockIndex::new(8, 2, "test").unwrap();
        index.insert(1, &[key(1), key(2)]);
        index.insert(3, &[key(1), key(9)]);
        assert_eq!(index.find(key(1)), Some((3, 1)));
        assert_eq!(index.find(key(2)), Some((1, 2)));
        index.check(|_| true).unwrap();
        // The older block goes: the newer keeps the shared key.
        index.remove(1);
        assert_eq!(index.find(key(1)), Some((3, 1)));
        assert_eq!(index.find(key(2)), None);
        index.check(|block| block == 3).unwrap();
        assert!(index.check(|_| false).is_err());
        // The newer goes first: the shared key goes with it (the older one left the table).
        index.remove(3);
        index.insert(1, &[key(1), key(2)]);
        index.insert(3, &[key(1), key(9)]);
        index.remove(3);
        assert_eq!(index.find(key(1)), None);
        assert_eq!(index.find(key(2)), Some((1, 2)));
        index.check(|block| block == 1).unwrap();
    }

    #[test]
    fn a_block_of_fewer_pieces_and_the_blocks_it_leaves_keyless() {
        let mut index = SubBlockIndex::new(8, 3, "test").unwrap();
        index.insert(1, &[key(1)]);
        assert_eq!(index.pop_keyless(), None);
        index.insert(2, &[key(1), key(2), key(3)]);
        // Block 1's only key went to block 2.
        assert_eq!(index.pop_keyless(), Some(1));
        assert_eq!(index.pop_keyless(), None);
        index.insert(3, &[key(1), key(2)]);
        assert_eq!(index.pop_keyless(), None, "block 2 keeps key(3)");
        assert_eq!(index.find(key(2)), Some((3, 2)));
        index.remove(1);
        index.remove(3);
        assert_eq!(index.find(key(3)), Some((2, 3)));
        assert_eq!(index.find(key(1)), None);
        index.check(|block| block == 2).unwrap();
    }
}

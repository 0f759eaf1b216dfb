//! Hash index of cached blocks: block hash → block id.
//!
//! Open addressing with linear probing over a fixed array of block ids. The 128-bit keys are
//! not stored here but in the block pool's per-block hash array, so a slot costs 4 bytes and the
//! table never grows: at most one entry per block, and the array has at least twice as many
//! slots as there are blocks. Deletion shifts the following run back (no tombstones), so a
//! lookup never slows down with churn.

use crate::block_hash::BlockHash;

const EMPTY: u32 = u32::MAX;

#[derive(Debug, Clone)]
pub struct PrefixTable {
    slots: Vec<u32>,
    mask: usize,
    len: usize,
}

impl PrefixTable {
    pub fn new(num_blocks: usize) -> Self {
        let num_slots = (2 * num_blocks).max(16).next_power_of_two();
        PrefixTable {
            slots: vec![EMPTY; num_slots],
            mask: num_slots - 1,
            len: 0,
        }
    }

    #[inline]
    fn home(&self, hash: BlockHash) -> usize {
        (hash.0[0] as usize) & self.mask
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The block registered under `hash`; `hashes[b]` is block `b`'s hash.
    #[inline]
    pub fn find(&self, hash: BlockHash, hashes: &[BlockHash]) -> Option<u32> {
        let mut slot = self.home(hash);
        loop {
            let block = self.slots[slot];
            if block == EMPTY {
                return None;
            }
            if hashes[block as usize] == hash {
                return Some(block);
            }
            slot = (slot + 1) & self.mask;
        }
    }

    /// Registers `block` under `hash`, which must not be present yet.
    #[inline]
    pub fn insert(&mut self, block: u32, hash: BlockHash) {
        debug_assert!(self.len < self.slots.len() / 2 + 1);
        let mut slot = self.home(hash);
        while self.slots[slot] != EMPTY {
            slot = (slot + 1) & self.mask;
        }
        self.slots[slot] = block;
        self.len += 1;
    }

    /// Unregisters `block`, which must be present under `hashes[block]`.
    pub fn remove(&mut self, block: u32, hashes: &[BlockHash]) {
        let mut hole = self.home(hashes[block as usize]);
        while self.slots[hole] != block {
            debug_assert_ne!(self.slots[hole], EMPTY, "block not in the prefix table");
            hole = (hole + 1) & self.mask;
        }
        // Backward-shift deletion: move each later entry of the run into the hole when the
        // hole lies on its probe path (between its home slot and where it sits now).
        let mut next = (hole + 1) & self.mask;
        loop {
            let moving = self.slots[next];
            if moving == EMPTY {
                break;
            }
            let home = self.home(hashes[moving as usize]);
            let distance_to_hole = hole.wrapping_sub(home) & self.mask;
            let distance_to_next = next.wrapping_sub(home) & self.mask;
            if distance_to_hole < distance_to_next {
                self.slots[hole] = moving;
                hole = next;
            }
            next = (next + 1) & self.mask;
        }
        self.slots[hole] = EMPTY;
        self.len -= 1;
    }

    pub fn heap_bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<u32>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_find_remove_with_colliding_homes() {
        // 8 blocks → 16 slots; hashes that all share a home slot force long runs.
        let hashes: Vec<BlockHash> = (0..8u64)
            .map(|i| BlockHash([3 | ((i % 2) << 4), i]))
            .collect();
        let mut table = PrefixTable::new(8);
        for block in 0..8 {
            table.insert(block, hashes[block as usize]);
        }
        for block in 0..8 {
            assert_eq!(table.find(hashes[block as usize], &hashes), Some(block));
        }
        for block in [0u32, 5, 2] {
            table.remove(block, &hashes);
            assert_eq!(table.find(hashes[block as usize], &hashes), None);
        }
        for block in [1u32, 3, 4, 6, 7] {
            assert_eq!(table.find(hashes[block as usize], &hashes), Some(block));
        }
        assert_eq!(table.len(), 5);
    }
}

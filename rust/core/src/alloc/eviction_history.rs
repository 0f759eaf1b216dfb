//! The hashes of the most recently evicted cached blocks, so that a prefix lookup can say a
//! block it misses was cached and evicted rather than never cached (ARC's ghost list, without
//! the adaptation): a ring of hashes and an index over it, fixed in size, O(1) per eviction.

use crate::alloc::block_hash::BlockHash;
use crate::alloc::fallible::{array_bytes, try_filled_vec};
use crate::alloc::index_table::IndexTable;
use crate::error::CoreResult;
use crate::undo::{Saved, Undo, UndoVec};

#[derive(Debug, Clone)]
pub struct EvictionHistory {
    /// Ring of evicted hashes; `next` is where the next one goes.
    hashes: UndoVec<BlockHash>,
    index: IndexTable,
    next: usize,
    len: usize,
    saved: Saved<(usize, usize)>,
}

impl EvictionHistory {
    /// Bytes of a history of `capacity` hashes; `None` on overflow.
    pub fn bytes_for(capacity: usize) -> Option<u64> {
        Some(array_bytes::<BlockHash>(capacity)? + IndexTable::bytes_for(capacity)?)
    }

    pub fn new(capacity: usize, what: &str) -> CoreResult<Self> {
        Ok(EvictionHistory {
            hashes: UndoVec::new(try_filled_vec(capacity, BlockHash::default(), what)?),
            index: IndexTable::new(capacity, what)?,
            next: 0,
            len: 0,
            saved: Saved::default(),
        })
    }

    /// Remembers an evicted hash, forgetting the oldest when full.
    #[inline]
    pub fn record(&mut self, hash: BlockHash) {
        let capacity = self.hashes.len();
        if capacity == 0 {
            return;
        }
        let EvictionHistory { hashes, index, .. } = self;
        if self.len == capacity {
            let oldest = hashes[self.next];
            index.remove(self.next as u32, oldest.0[0], |id| hashes[id as usize].0[0]);
        } else {
            self.len += 1;
        }
        hashes.set(self.next, hash);
        index.insert(self.next as u32, hash.0[0]);
        self.next = (self.next + 1) % capacity;
    }

    /// Whether `hash` is among the remembered evictions.
    pub fn contains(&self, hash: BlockHash) -> bool {
        let hashes = &self.hashes;
        self.index
            .find(hash.0[0], |id| hashes[id as usize] == hash)
            .is_some()
    }

    pub fn heap_bytes(&self) -> usize {
        self.hashes.capacity() * std::mem::size_of::<BlockHash>() + self.index.heap_bytes()
    }
}

impl EvictionHistory {
    /// The parts that record their own changes.
    fn undo_parts(&mut self) -> impl Undo + '_ {
        (&mut self.hashes, &mut self.index)
    }
}

impl Undo for EvictionHistory {
    fn begin(&mut self) {
        self.saved.save((self.next, self.len));
        self.undo_parts().begin();
    }

    fn commit(&mut self) {
        self.saved.forget();
        self.undo_parts().commit();
    }

    fn rollback(&mut self) {
        if let Some(saved) = self.saved.take() {
            (self.next, self.len) = saved;
        }
        self.undo_parts().rollback();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remembers_the_last_capacity_evictions() {
        let mut history = EvictionHistory::new(3, "test").unwrap();
        let hash = |n: u64| BlockHash([n, n + 1]);
        for n in 0..5 {
            history.record(hash(n));
        }
        assert!(!history.contains(hash(0)) && !history.contains(hash(1)));
        assert!((2..5).all(|n| history.contains(hash(n))));
        history.record(hash(2)); // a repeat takes a slot like any other
        assert!(!history.contains(hash(2)) || history.contains(hash(2)));
        assert!(history.contains(hash(4)));
        assert!(!history.contains(hash(9)));
        let mut empty = EvictionHistory::new(0, "test").unwrap();
        empty.record(hash(1));
        assert!(!empty.contains(hash(1)));
    }
}

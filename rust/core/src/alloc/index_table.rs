//! A hash index of ids whose keys live elsewhere: open addressing with linear probing over a
//! fixed array of `u32` ids.
//!
//! The caller keeps each id's key (a block's prefix hash, a range's offset) in its own arrays
//! and hands this table the key's hash plus a way to compare; the table stores only ids, so a
//! slot costs 4 bytes. It never grows: it has at least twice as many slots as the ids it may
//! hold. Deletion shifts the following run back (no tombstones), so lookups do not slow down
//! with churn.

use crate::alloc::fallible::{array_bytes, try_filled_vec};
use crate::error::CoreResult;
use crate::undo::{Saved, Undo, UndoVec};

const EMPTY: u32 = u32::MAX;

#[derive(Debug, Clone)]
pub struct IndexTable {
    slots: UndoVec<u32>,
    mask: usize,
    len: usize,
    saved: Saved<usize>,
}

impl IndexTable {
    /// Slots of a table for up to `max_ids` ids; `None` on overflow.
    fn num_slots(max_ids: usize) -> Option<usize> {
        max_ids.checked_mul(2)?.max(16).checked_next_power_of_two()
    }

    /// Bytes of a table for up to `max_ids` ids; `None` on overflow.
    pub fn bytes_for(max_ids: usize) -> Option<u64> {
        array_bytes::<u32>(Self::num_slots(max_ids)?)
    }

    /// A table for up to `max_ids` ids. `what` says whose table it is, for the error if the
    /// host cannot provide its memory.
    pub fn new(max_ids: usize, what: &str) -> CoreResult<Self> {
        let num_slots = Self::num_slots(max_ids)
            .ok_or_else(|| invalid!("an index of {max_ids} ids is too large ({what})"))?;
        Ok(IndexTable {
            slots: UndoVec::new(try_filled_vec(num_slots, EMPTY, what)?),
            mask: num_slots - 1,
            len: 0,
            saved: Saved::default(),
        })
    }

    #[inline]
    fn home(&self, hash: u64) -> usize {
        hash as usize & self.mask
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// The id whose key hashes to `hash` and satisfies `is_key`.
    #[inline]
    pub fn find(&self, hash: u64, is_key: impl Fn(u32) -> bool) -> Option<u32> {
        let mut slot = self.home(hash);
        loop {
            let id = self.slots[slot];
            if id == EMPTY {
                return None;
            }
            if is_key(id) {
                return Some(id);
            }
            slot = (slot + 1) & self.mask;
        }
    }

    /// Adds `id`, whose key hashes to `hash` and is not present yet.
    #[inline]
    pub fn insert(&mut self, id: u32, hash: u64) {
        debug_assert!(self.len < self.slots.len() / 2 + 1);
        let mut slot = self.home(hash);
        while self.slots[slot] != EMPTY {
            slot = (slot + 1) & self.mask;
        }
        self.slots.set(slot, id);
        self.len += 1;
    }

    /// Removes `id`, present under `hash`; `hash_of` gives the hash of any id in the table.
    #[inline]
    pub fn remove(&mut self, id: u32, hash: u64, hash_of: impl Fn(u32) -> u64) {
        let mut hole = self.home(hash);
        while self.slots[hole] != id {
            debug_assert_ne!(self.slots[hole], EMPTY, "id not in the table");
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
            let home = self.home(hash_of(moving));
            let distance_to_hole = hole.wrapping_sub(home) & self.mask;
            let distance_to_next = next.wrapping_sub(home) & self.mask;
            if distance_to_hole < distance_to_next {
                self.slots.set(hole, moving);
                hole = next;
            }
            next = (next + 1) & self.mask;
        }
        self.slots.set(hole, EMPTY);
        self.len -= 1;
    }

    /// Forgets every id.
    pub fn clear(&mut self) {
        for slot in 0..self.slots.len() {
            if self.slots[slot] != EMPTY {
                self.slots.set(slot, EMPTY);
            }
        }
        self.len = 0;
    }

    pub fn heap_bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<u32>()
    }
}

impl Undo for IndexTable {
    fn begin(&mut self) {
        self.saved.save(self.len);
        self.slots.begin();
    }

    fn commit(&mut self) {
        self.saved.forget();
        self.slots.commit();
    }

    fn rollback(&mut self) {
        if let Some(len) = self.saved.take() {
            self.len = len;
        }
        self.slots.rollback();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::CoreError;

    #[test]
    fn insert_find_remove_with_colliding_homes() {
        // 8 ids → 16 slots; keys that share home slots force long runs that wrap around.
        let keys: Vec<u64> = (0..8u64).map(|i| (i << 32) | 15 | ((i % 2) << 4)).collect();
        let hash = |id: u32| keys[id as usize];
        let mut table = IndexTable::new(8, "test").unwrap();
        for id in 0..8 {
            table.insert(id, hash(id));
        }
        for id in 0..8u32 {
            assert_eq!(
                table.find(hash(id), |other| keys[other as usize] == keys[id as usize]),
                Some(id)
            );
        }
        for id in [0u32, 5, 2] {
            table.remove(id, hash(id), hash);
            assert_eq!(table.find(hash(id), |other| other == id), None);
        }
        for id in [1u32, 3, 4, 6, 7] {
            assert_eq!(table.find(hash(id), |other| other == id), Some(id));
        }
        assert_eq!(table.len(), 5);
    }

    #[test]
    fn huge_size_is_an_error_not_an_abort() {
        assert_eq!(IndexTable::bytes_for(0), Some(64));
        assert_eq!(IndexTable::bytes_for(100), Some(1024));
        assert_eq!(IndexTable::bytes_for(usize::MAX / 2), None);
        assert!(matches!(
            IndexTable::new(usize::MAX / 2, "test"),
            Err(CoreError::InvalidArgument(_))
        ));
        // 2**61 slots fit usize but no host: an out-of-memory error, not an abort.
        assert!(matches!(
            IndexTable::new(1 << 60, "test"),
            Err(CoreError::HostOutOfMemory { .. })
        ));
    }
}

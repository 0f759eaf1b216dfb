//! Intrusive doubly linked queue of block ids kept in one vector of links.
//!
//! This is the shape of vLLM v1's `FreeKVCacheBlockQueue`: removing a block from the middle
//! (a prefix-cache hit on an evictable block) is O(1), and no operation allocates. A sentinel
//! node at index `capacity` makes the list circular, so push/pop/remove have no head or tail
//! special cases. A node's two links sit side by side: unlinking one touches one cache line
//! for it, not two (the queue is walked in no order memory likes, so each touch is a miss).

use crate::alloc::fallible::{array_bytes, try_filled_vec};
use crate::error::CoreResult;

const DETACHED: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Link {
    prev: u32,
    next: u32,
}

const UNLINKED: Link = Link {
    prev: DETACHED,
    next: DETACHED,
};

#[derive(Debug, Clone)]
pub struct FreeQueue {
    links: Vec<Link>,
    len: usize,
}

impl FreeQueue {
    /// Bytes of the link arrays of a queue for ids `0..capacity`; `None` on overflow.
    pub fn bytes_for(capacity: usize) -> Option<u64> {
        array_bytes::<Link>(capacity.checked_add(1)?)
    }

    /// An empty queue able to hold ids `0..capacity`. `what` says whose queue it is, for the
    /// error if the host cannot provide its memory.
    pub fn new(capacity: usize, what: &str) -> CoreResult<Self> {
        ensure!(
            capacity < DETACHED as usize,
            "a free queue holds ids below {DETACHED}, not 0..{capacity} ({what})"
        );
        let mut links = try_filled_vec(capacity + 1, UNLINKED, what)?;
        let sentinel = capacity as u32;
        links[capacity] = Link {
            prev: sentinel,
            next: sentinel,
        };
        Ok(FreeQueue { links, len: 0 })
    }

    #[inline]
    fn sentinel(&self) -> u32 {
        (self.links.len() - 1) as u32
    }

    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    #[inline]
    pub fn contains(&self, id: u32) -> bool {
        self.links[id as usize].next != DETACHED
    }

    #[inline]
    fn link_after(&mut self, anchor: u32, id: u32) {
        debug_assert!(!self.contains(id));
        let after = self.links[anchor as usize].next;
        self.links[id as usize] = Link {
            prev: anchor,
            next: after,
        };
        self.links[anchor as usize].next = id;
        self.links[after as usize].prev = id;
        self.len += 1;
    }

    /// Appends at the tail: the block is reused last.
    #[inline]
    pub fn push_back(&mut self, id: u32) {
        let last = self.links[self.sentinel() as usize].prev;
        self.link_after(last, id);
    }

    /// Inserts at the head: the block is reused first.
    #[inline]
    pub fn push_front(&mut self, id: u32) {
        self.link_after(self.sentinel(), id);
    }

    #[inline]
    pub fn front(&self) -> Option<u32> {
        let first = self.links[self.sentinel() as usize].next;
        (first != self.sentinel()).then_some(first)
    }

    #[inline]
    pub fn pop_front(&mut self) -> Option<u32> {
        let first = self.front()?;
        self.remove(first);
        Some(first)
    }

    /// Unlinks `id`, which must be in the queue.
    #[inline]
    pub fn remove(&mut self, id: u32) {
        debug_assert!(self.contains(id));
        let Link { prev, next } = self.links[id as usize];
        self.links[prev as usize].next = next;
        self.links[next as usize].prev = prev;
        self.links[id as usize] = UNLINKED;
        self.len -= 1;
    }

    /// Ids from head to tail (for checks and tests; allocates nothing).
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        let sentinel = self.sentinel();
        let mut cursor = self.links[sentinel as usize].next;
        std::iter::from_fn(move || {
            if cursor == sentinel {
                return None;
            }
            let id = cursor;
            cursor = self.links[id as usize].next;
            Some(id)
        })
    }

    pub fn heap_bytes(&self) -> usize {
        self.links.capacity() * std::mem::size_of::<Link>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::CoreError;

    #[test]
    fn fifo_order_and_middle_removal() {
        let mut queue = FreeQueue::new(5, "test").unwrap();
        for id in 0..5 {
            queue.push_back(id);
        }
        queue.remove(2);
        queue.push_front(2);
        assert_eq!(queue.iter().collect::<Vec<_>>(), [2, 0, 1, 3, 4]);
        assert_eq!(queue.pop_front(), Some(2));
        queue.remove(4);
        assert!(!queue.contains(4));
        assert_eq!(queue.iter().collect::<Vec<_>>(), [0, 1, 3]);
        assert_eq!(queue.len(), 3);
        while queue.pop_front().is_some() {}
        assert_eq!(queue.len(), 0);
        assert_eq!(queue.front(), None);
    }

    #[test]
    fn huge_capacity_is_an_error_not_an_abort() {
        assert_eq!(FreeQueue::bytes_for(3), Some(32));
        assert_eq!(FreeQueue::bytes_for(usize::MAX), None);
        assert!(matches!(
            FreeQueue::new(u32::MAX as usize, "test"),
            Err(CoreError::InvalidArgument(_))
        ));
        assert!(matches!(
            FreeQueue::new(usize::MAX, "test"),
            Err(CoreError::InvalidArgument(_))
        ));
    }
}

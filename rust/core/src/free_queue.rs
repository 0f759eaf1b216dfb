//! Intrusive doubly linked queue of block ids kept in two vectors.
//!
//! This is the shape of vLLM v1's `FreeKVCacheBlockQueue`: removing a block from the middle
//! (a prefix-cache hit on an evictable block) is O(1), and no operation allocates. A sentinel
//! node at index `capacity` makes the list circular, so push/pop/remove have no head or tail
//! special cases.

const DETACHED: u32 = u32::MAX;

#[derive(Debug, Clone)]
pub struct FreeQueue {
    prev: Vec<u32>,
    next: Vec<u32>,
    len: usize,
}

impl FreeQueue {
    /// An empty queue able to hold ids `0..capacity`.
    pub fn new(capacity: usize) -> Self {
        debug_assert!(capacity < DETACHED as usize);
        let mut prev = vec![DETACHED; capacity + 1];
        let mut next = vec![DETACHED; capacity + 1];
        let sentinel = capacity as u32;
        prev[capacity] = sentinel;
        next[capacity] = sentinel;
        FreeQueue { prev, next, len: 0 }
    }

    #[inline]
    fn sentinel(&self) -> u32 {
        (self.next.len() - 1) as u32
    }

    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    #[inline]
    pub fn contains(&self, id: u32) -> bool {
        self.next[id as usize] != DETACHED
    }

    #[inline]
    fn link_after(&mut self, anchor: u32, id: u32) {
        debug_assert!(!self.contains(id));
        let after = self.next[anchor as usize];
        self.prev[id as usize] = anchor;
        self.next[id as usize] = after;
        self.next[anchor as usize] = id;
        self.prev[after as usize] = id;
        self.len += 1;
    }

    /// Appends at the tail: the block is reused last.
    #[inline]
    pub fn push_back(&mut self, id: u32) {
        let last = self.prev[self.sentinel() as usize];
        self.link_after(last, id);
    }

    /// Inserts at the head: the block is reused first.
    #[inline]
    pub fn push_front(&mut self, id: u32) {
        self.link_after(self.sentinel(), id);
    }

    #[inline]
    pub fn front(&self) -> Option<u32> {
        let first = self.next[self.sentinel() as usize];
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
        let (before, after) = (self.prev[id as usize], self.next[id as usize]);
        self.next[before as usize] = after;
        self.prev[after as usize] = before;
        self.prev[id as usize] = DETACHED;
        self.next[id as usize] = DETACHED;
        self.len -= 1;
    }

    /// Ids from head to tail (for checks and tests; allocates nothing).
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        let sentinel = self.sentinel();
        let mut cursor = self.next[sentinel as usize];
        std::iter::from_fn(move || {
            if cursor == sentinel {
                return None;
            }
            let id = cursor;
            cursor = self.next[id as usize];
            Some(id)
        })
    }

    pub fn heap_bytes(&self) -> usize {
        (self.prev.capacity() + self.next.capacity()) * std::mem::size_of::<u32>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fifo_order_and_middle_removal() {
        let mut queue = FreeQueue::new(5);
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
        assert!(queue.is_empty());
        assert_eq!(queue.front(), None);
    }
}

//! Intrusive doubly linked queues of block ids kept in one vector of links.
//!
//! This is the shape of vLLM v1's `FreeKVCacheBlockQueue`: removing a block from the middle
//! (a prefix-cache hit on an evictable block) is O(1), and no operation allocates. A sentinel
//! node at index `capacity` makes the list circular, so push/pop/remove have no head or tail
//! special cases. A node's two links sit side by side: unlinking one touches one cache line
//! for it, not two (the queue is walked in no order memory likes, so each touch is a miss).

use crate::alloc::fallible::{array_bytes, try_filled_vec};
use crate::error::CoreResult;
use crate::undo::{Saved, Undo, UndoVec};

const DETACHED: u32 = u32::MAX;

/// A node's `next` holds the id after it in its low bits and its own queue in the top
/// `QUEUE_BITS`: finding a node's queue costs no memory access beyond its links. Seven bits
/// give the priority policy a queue per retention priority (0 to 100) past the free one.
const QUEUE_BITS: u32 = 7;
const ID_BITS: u32 = 32 - QUEUE_BITS;
const ID_MASK: u32 = (1 << ID_BITS) - 1;

/// Most queues one set holds.
pub const MAX_QUEUES: usize = 1 << QUEUE_BITS;

/// Most ids one set holds (its sentinels take ids past them).
pub const MAX_IDS: usize = (ID_MASK as usize) - MAX_QUEUES;

#[derive(Debug, Clone, Copy)]
struct Link {
    prev: u32,
    /// `queue << ID_BITS | next id`; `DETACHED` when in no queue.
    next: u32,
}

const UNLINKED: Link = Link {
    prev: DETACHED,
    next: DETACHED,
};

/// Several queues over one link array: an id is in at most one of them. Queue `q`'s sentinel
/// is node `capacity + q`. The block pool keeps its free blocks in queue 0 and its evictable
/// cached blocks in the queues its eviction policy orders.
#[derive(Debug, Clone)]
pub struct FreeQueue {
    links: UndoVec<Link>,
    /// Ids per queue, and in all; bit `q` set while queue `q` is not empty.
    lens: [u32; MAX_QUEUES],
    len: usize,
    nonempty: u128,
    capacity: usize,
    /// `lens`, `len` and `nonempty` when a transaction began.
    saved: Saved<([u32; MAX_QUEUES], usize, u128)>,
}

impl FreeQueue {
    /// Bytes of a queue set for ids `0..capacity` in `queues` queues; `None` on overflow.
    pub fn bytes_for(capacity: usize, queues: usize) -> Option<u64> {
        array_bytes::<Link>(capacity.checked_add(queues)?)
    }

    /// `queues` empty queues (at most `MAX_QUEUES`) able to hold ids `0..capacity`. `what`
    /// says whose queues they are, for the error if the host cannot provide their memory.
    pub fn new(capacity: usize, queues: usize, what: &str) -> CoreResult<Self> {
        ensure!(
            capacity < (ID_MASK as usize).saturating_sub(queues)
                && (1..=MAX_QUEUES).contains(&queues),
            "a free queue holds ids below {ID_MASK} in 1 to {MAX_QUEUES} queues, not \
             0..{capacity} in {queues} ({what})"
        );
        let mut links = try_filled_vec(capacity + queues, UNLINKED, what)?;
        for queue in 0..queues {
            let sentinel = (capacity + queue) as u32;
            links[capacity + queue] = Link {
                prev: sentinel,
                next: tagged(queue, sentinel),
            };
        }
        Ok(FreeQueue {
            links: UndoVec::new(links),
            lens: [0; MAX_QUEUES],
            len: 0,
            nonempty: 0,
            capacity,
            saved: Saved::default(),
        })
    }

    #[inline]
    fn sentinel(&self, queue: usize) -> u32 {
        (self.capacity + queue) as u32
    }

    #[inline]
    fn next_of(&self, id: u32) -> u32 {
        self.links[id as usize].next & ID_MASK
    }

    /// Ids in all the queues.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    #[inline]
    pub fn len_of(&self, queue: usize) -> usize {
        self.lens[queue % MAX_QUEUES] as usize
    }

    #[inline]
    pub fn contains(&self, id: u32) -> bool {
        self.links[id as usize].next != DETACHED
    }

    /// The queue `id` is in, if any.
    #[inline]
    pub fn queue_of(&self, id: u32) -> Option<usize> {
        let next = self.links[id as usize].next;
        (next != DETACHED).then_some((next >> ID_BITS) as usize)
    }

    /// Points `node`'s next at `id`, keeping `node`'s queue.
    #[inline]
    fn set_next(&mut self, node: u32, id: u32) {
        self.links.update(node as usize, |link| {
            link.next = (link.next & !ID_MASK) | id
        });
    }

    #[inline]
    fn link_after(&mut self, queue: usize, anchor: u32, id: u32) {
        debug_assert!(!self.contains(id));
        let after = self.next_of(anchor);
        let link = Link {
            prev: anchor,
            next: tagged(queue, after),
        };
        self.links.set(id as usize, link);
        self.set_next(anchor, id);
        self.links.update(after as usize, |link| link.prev = id);
        self.lens[queue % MAX_QUEUES] += 1;
        self.len += 1;
        self.nonempty |= 1 << (queue % MAX_QUEUES);
    }

    /// Appends at the tail of `queue`: the block is reused last.
    #[inline]
    pub fn push_back(&mut self, queue: usize, id: u32) {
        let last = self.links[self.sentinel(queue) as usize].prev;
        self.link_after(queue, last, id);
    }

    /// Inserts at the head of `queue`: the block is reused first.
    #[inline]
    pub fn push_front(&mut self, queue: usize, id: u32) {
        self.link_after(queue, self.sentinel(queue), id);
    }

    #[inline]
    pub fn front(&self, queue: usize) -> Option<u32> {
        let sentinel = self.sentinel(queue);
        let first = self.next_of(sentinel);
        (first != sentinel).then_some(first)
    }

    #[inline]
    pub fn pop_front(&mut self, queue: usize) -> Option<u32> {
        let first = self.front(queue)?;
        self.remove(first);
        Some(first)
    }

    /// Unlinks `id`, which must be in a queue.
    #[inline]
    pub fn remove(&mut self, id: u32) {
        debug_assert!(self.contains(id));
        let Link { prev, next } = self.links[id as usize];
        let (queue, next) = ((next >> ID_BITS) as usize, next & ID_MASK);
        self.set_next(prev, next);
        self.links.update(next as usize, |link| link.prev = prev);
        self.links.set(id as usize, UNLINKED);
        self.lens[queue % MAX_QUEUES] -= 1;
        self.len -= 1;
        if self.lens[queue % MAX_QUEUES] == 0 {
            self.nonempty &= !(1 << (queue % MAX_QUEUES));
        }
    }

    /// The first non-empty queue from `queue` on.
    #[inline]
    pub fn first_nonempty_from(&self, queue: usize) -> Option<usize> {
        let above = self.nonempty.checked_shr(queue as u32).unwrap_or(0);
        (above != 0).then(|| queue + above.trailing_zeros() as usize)
    }

    /// Ids of `queue` from head to tail (for checks and tests; allocates nothing).
    pub fn iter_queue(&self, queue: usize) -> impl Iterator<Item = u32> + '_ {
        let sentinel = self.sentinel(queue);
        let mut cursor = self.next_of(sentinel);
        std::iter::from_fn(move || {
            if cursor == sentinel {
                return None;
            }
            let id = cursor;
            cursor = self.next_of(id);
            Some(id)
        })
    }

    /// Ids of every queue, queue after queue.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        let queues = self.links.len() - self.capacity;
        (0..queues).flat_map(move |queue| self.iter_queue(queue))
    }

    pub fn heap_bytes(&self) -> usize {
        self.links.capacity() * std::mem::size_of::<Link>()
    }
}

impl Undo for FreeQueue {
    fn begin(&mut self) {
        self.saved.save((self.lens, self.len, self.nonempty));
        self.links.begin();
    }

    fn commit(&mut self) {
        self.saved.forget();
        self.links.commit();
    }

    fn rollback(&mut self) {
        if let Some((lens, len, nonempty)) = self.saved.take() {
            (self.lens, self.len, self.nonempty) = (lens, len, nonempty);
        }
        self.links.rollback();
    }
}

#[inline]
fn tagged(queue: usize, id: u32) -> u32 {
    ((queue as u32) << ID_BITS) | id
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::CoreError;

    #[test]
    fn fifo_order_and_middle_removal() {
        let mut queue = FreeQueue::new(5, 1, "test").unwrap();
        for id in 0..5 {
            queue.push_back(0, id);
        }
        queue.remove(2);
        queue.push_front(0, 2);
        assert_eq!(queue.iter().collect::<Vec<_>>(), [2, 0, 1, 3, 4]);
        assert_eq!(queue.pop_front(0), Some(2));
        queue.remove(4);
        assert!(!queue.contains(4));
        assert_eq!(queue.iter().collect::<Vec<_>>(), [0, 1, 3]);
        assert_eq!(queue.len(), 3);
        while queue.pop_front(0).is_some() {}
        assert_eq!(queue.len(), 0);
        assert_eq!(queue.front(0), None);
    }

    #[test]
    fn queues_share_the_links_and_keep_their_own_order() {
        let mut queue = FreeQueue::new(6, 3, "test").unwrap();
        for id in 0..6 {
            queue.push_back((id % 3) as usize, id);
        }
        assert_eq!(queue.iter_queue(1).collect::<Vec<_>>(), [1, 4]);
        assert_eq!((queue.len(), queue.len_of(2)), (6, 2));
        queue.remove(4);
        queue.push_front(2, 4);
        assert_eq!(queue.queue_of(4), Some(2));
        assert_eq!(queue.iter().collect::<Vec<_>>(), [0, 3, 1, 4, 2, 5]);
        assert_eq!(queue.first_nonempty_from(1), Some(1));
        assert_eq!(queue.pop_front(1), Some(1));
        assert_eq!((queue.len_of(1), queue.front(1)), (0, None));
        assert_eq!(queue.queue_of(1), None);
        assert_eq!(queue.first_nonempty_from(1), Some(2));
        assert_eq!(queue.first_nonempty_from(3), None);
    }

    #[test]
    fn huge_capacity_is_an_error_not_an_abort() {
        assert_eq!(FreeQueue::bytes_for(3, 1), Some(32));
        assert_eq!(FreeQueue::bytes_for(usize::MAX, 1), None);
        for (capacity, queues) in [(u32::MAX as usize, 1), (usize::MAX, 1), (4, 0), (4, 129)] {
            assert!(matches!(
                FreeQueue::new(capacity, queues, "test"),
                Err(CoreError::InvalidArgument(_))
            ));
        }
    }
}

//! Fixed-size KV-cache blocks: who owns each block, which are free, which are cached.
//!
//! Every block other than the null block is in exactly one state:
//! - *in use*: reference count > 0 (held by that many sequences), not in the free queue;
//! - *cached*: reference count 0, in the free queue, still registered under its prefix hash,
//!   so a later request with the same prefix takes it back (evictable, least recently used
//!   first);
//! - *free*: reference count 0, in the free queue, no contents worth keeping.
//!
//! Free blocks sit in a queue of their own and cached ones in the queues of the eviction
//! policy (see `eviction`), so an allocation takes a worthless block before it evicts a
//! cached one. Allocation, release and a cache hit are O(1) and allocate no memory.

use crate::alloc::block_hash::BlockHash;
use crate::alloc::block_priorities::BlockPriorities;
use crate::alloc::eviction::EvictionPolicy;
use crate::alloc::eviction_history::EvictionHistory;
use crate::alloc::fallible::{array_bytes, check_bookkeeping, total_bytes, try_filled_vec};
use crate::alloc::free_queue::{FreeQueue, MAX_IDS};
use crate::alloc::index_table::IndexTable;
use crate::alloc::sub_block_index::SubBlockIndex;
use crate::error::CoreResult;
use crate::undo::{Saved, UndoVec};

/// Block 0 is owned by no sequence. Block tables are padded with it, so a kernel that reads
/// past a sequence's last block reads valid (if meaningless) memory.
pub const NULL_BLOCK: u32 = 0;

/// Largest token count (blocks × block size) for which every slot id fits an int32.
pub const MAX_SLOTS: usize = i32::MAX as usize + 1;

/// The free queue set's queue of free (uncached) blocks.
const FREE: usize = 0;

/// Most blocks one pool manages (about 1.2 GiB of bookkeeping; real caches hold far fewer):
/// what a free queue's ids reach.
pub const MAX_BLOCKS: usize = MAX_IDS;

/// Prefix-cache counters since construction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixCacheCounters {
    /// Full blocks looked up by `alloc_sequence` with token ids.
    pub queries: u64,
    /// Of those, blocks found in the cache.
    pub hits: u64,
    /// Cached blocks reused for other contents.
    pub evictions: u64,
}

/// What the prefix cache holds of a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cached {
    No,
    /// Findable by its hash; with `remember`, its eviction goes into the history.
    Yes {
        remember: bool,
    },
    /// Findable by the sub-keys of its leading pieces only (see `keep_pieces`): no full key,
    /// so no lookup, KV event, eviction history or lower tier ever names it.
    Pieces,
}

#[derive(Debug, Clone)]
pub struct BlockPool {
    block_size: usize,
    ref_counts: UndoVec<u32>,
    free_queue: FreeQueue,
    /// Hash of every block registered in `prefix_table`; meaningless for the others.
    block_hashes: UndoVec<BlockHash>,
    cached: UndoVec<Cached>,
    prefix_table: IndexTable,
    num_evictable: usize,
    enable_prefix_caching: bool,
    counters: PrefixCacheCounters,
    policy: EvictionPolicy,
    /// Per block, how often the prefix cache served it since it was cached (saturating).
    hits: UndoVec<u8>,
    /// The (key, block) of the blocks that left the prefix cache since the last
    /// `drain_removed`, kept only while `record_removed` (KV-cache events).
    record_removed: bool,
    removed: UndoVec<(BlockHash, u32)>,
    /// Hashes of the last `num_blocks` evicted blocks registered to be remembered: a lookup
    /// miss can say "evicted".
    evicted: EvictionHistory,
    /// Keys of cached blocks' leading sub-blocks, once `enable_sub_blocks` made them.
    sub_blocks: Option<SubBlockIndex>,
    /// Cached blocks' retention priorities (kept for the priority policy only).
    retention: BlockPriorities,
    /// Blocks cached as `Cached::Pieces`.
    num_pieces: usize,
    /// `num_evictable`, `counters` and `num_pieces` when a transaction began.
    saved: Saved<(usize, PrefixCacheCounters, usize)>,
}

impl BlockPool {
    pub fn new(
        num_blocks: usize,
        block_size: usize,
        enable_prefix_caching: bool,
    ) -> CoreResult<Self> {
        Self::with_policy(
            num_blocks,
            block_size,
            enable_prefix_caching,
            EvictionPolicy::Lru,
        )
    }

    /// A pool whose prefix cache evicts by `policy`.
    pub fn with_policy(
        num_blocks: usize,
        block_size: usize,
        enable_prefix_caching: bool,
        policy: EvictionPolicy,
    ) -> CoreResult<Self> {
        ensure!(
            num_blocks >= 2,
            "num_blocks must be at least 2 (block 0 is the reserved null block), got {num_blocks}"
        );
        ensure!(block_size != 0, "block_size must be at least 1, got 0");
        let table_blocks = if enable_prefix_caching { num_blocks } else { 0 };
        let what = || format!("num_blocks = {num_blocks}");
        let keeps_priorities = policy == EvictionPolicy::Priority && enable_prefix_caching;
        let retention_blocks = if keeps_priorities { num_blocks } else { 0 };
        let bytes = Self::bookkeeping_bytes(num_blocks, table_blocks, policy.queues())
            .zip(BlockPriorities::bytes_for(retention_blocks))
            .and_then(|(pool, retention)| pool.checked_add(retention));
        ensure!(
            num_blocks <= MAX_BLOCKS,
            "num_blocks = {num_blocks} is more than one pool manages ({MAX_BLOCKS}): its \
             bookkeeping alone would take {} bytes of host memory",
            bytes.map_or_else(|| "over 2**64".to_owned(), |bytes| bytes.to_string())
        );
        if num_blocks
            .checked_mul(block_size)
            .is_none_or(|slots| slots > MAX_SLOTS)
        {
            return Err(invalid!(
                "num_blocks × block_size = {num_blocks} × {block_size} exceeds 2**31 slots: \
                 slot ids would not fit the int32 slot mapping kernels read"
            ));
        }
        let bytes = check_bookkeeping(bytes, what)?;
        let what = format!("the bookkeeping of num_blocks = {num_blocks} ({bytes} bytes in all)");
        let mut free_queue = FreeQueue::new(num_blocks, policy.queues(), &what)?;
        for block in 1..num_blocks as u32 {
            free_queue.push_back(FREE, block);
        }
        Ok(BlockPool {
            block_size,
            ref_counts: UndoVec::new(try_filled_vec(num_blocks, 0, &what)?),
            free_queue,
            block_hashes: UndoVec::new(try_filled_vec(table_blocks, BlockHash::default(), &what)?),
            cached: UndoVec::new(try_filled_vec(table_blocks, Cached::No, &what)?),
            prefix_table: IndexTable::new(table_blocks, &what)?,
            num_evictable: 0,
            enable_prefix_caching,
            counters: PrefixCacheCounters::default(),
            policy,
            hits: UndoVec::new(try_filled_vec(table_blocks, 0, &what)?),
            record_removed: false,
            removed: UndoVec::default(),
            evicted: EvictionHistory::new(table_blocks, &what)?,
            sub_blocks: None,
            retention: match keeps_priorities {
                true => BlockPriorities::new(num_blocks),
                false => BlockPriorities::default(),
            },
            num_pieces: 0,
            saved: Saved::default(),
        })
    }

    /// Host bytes `new` takes for `num_blocks` blocks, `table_blocks` of them (all or none)
    /// with prefix-cache entries; `None` on overflow.
    fn bookkeeping_bytes(num_blocks: usize, table_blocks: usize, queues: usize) -> Option<u64> {
        total_bytes(&[
            array_bytes::<u32>(num_blocks),
            FreeQueue::bytes_for(num_blocks, queues),
            array_bytes::<u8>(table_blocks),
            array_bytes::<BlockHash>(table_blocks),
            array_bytes::<bool>(table_blocks),
            IndexTable::bytes_for(table_blocks),
            EvictionHistory::bytes_for(table_blocks),
        ])
    }

    /// The registered block holding `hash`.
    #[inline]
    fn find_cached(&self, hash: BlockHash) -> Option<u32> {
        let hashes = &self.block_hashes;
        self.prefix_table
            .find(hash.0[0], |block| hashes[block as usize] == hash)
    }

    #[inline]
    fn unregister(&mut self, block: u32) {
        match self.cached[block as usize] {
            Cached::Pieces => self.num_pieces -= 1,
            _ => {
                if self.record_removed {
                    self.removed
                        .push((self.block_hashes[block as usize], block));
                }
                let hashes = &self.block_hashes;
                self.prefix_table
                    .remove(block, hashes[block as usize].0[0], |other| {
                        hashes[other as usize].0[0]
                    });
            }
        }
        self.cached.set(block as usize, Cached::No);
        // Its priority (and any expiry waiting for it) went with its contents.
        self.retention.reset(block);
        if let Some(sub_blocks) = self.sub_blocks.as_mut() {
            sub_blocks.remove(block);
        }
    }

    #[inline]
    pub fn num_blocks(&self) -> usize {
        self.ref_counts.len()
    }

    #[inline]
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn enable_prefix_caching(&self) -> bool {
        self.enable_prefix_caching
    }

    pub fn eviction_policy(&self) -> EvictionPolicy {
        self.policy
    }

    /// Puts an unused cached block where its policy keeps it, as the most recently used.
    #[inline]
    fn enqueue_cached(&mut self, block: u32) {
        let priority = self.retention.priority(block);
        let queue = self.policy.queue_for(self.hits[block as usize], priority);
        self.free_queue.push_back(queue, block);
        self.policy
            .rebalance(&mut self.free_queue, self.ref_counts.len());
    }

    /// Blocks an allocation can take now: free plus cached-but-unused (evictable).
    #[inline]
    pub fn num_free(&self) -> usize {
        self.free_queue.len()
    }

    /// Cached blocks that no sequence uses.
    pub fn num_evictable(&self) -> usize {
        self.num_evictable
    }

    /// Records every block that leaves the prefix cache (see `drain_removed`).
    pub fn set_record_removed(&mut self, record: bool) {
        self.record_removed = record;
    }

    /// Hands the (key, block) recorded since the last call to `sink`, oldest first.
    pub fn drain_removed(&mut self, mut sink: impl FnMut(BlockHash, u32)) {
        for &(key, block) in self.removed.iter() {
            sink(key, block);
        }
        self.removed.clear();
    }

    /// How many blocks the prefix cache holds (in use or not).
    pub fn num_cached(&self) -> usize {
        self.prefix_table.len()
    }

    /// The hashes of the blocks the prefix cache holds by their full keys, in block order.
    pub fn cached_hashes(&self) -> impl Iterator<Item = BlockHash> + '_ {
        (1..self.num_blocks() as u32)
            .filter(|&block| self.is_cached(block) && !self.is_pieces(block))
            .map(|block| self.block_hashes[block as usize])
    }

    pub fn counters(&self) -> PrefixCacheCounters {
        self.counters
    }

    #[inline]
    pub fn ref_count(&self, block: u32) -> u32 {
        self.ref_counts[block as usize]
    }

    #[inline]
    fn is_cached(&self, block: u32) -> bool {
        self.enable_prefix_caching && self.cached[block as usize] != Cached::No
    }

    /// Blocks no sequence holds and the prefix cache does not keep (the null block aside):
    /// nothing may read their bytes before they are written again.
    pub fn unused_blocks(&self) -> impl Iterator<Item = u32> + '_ {
        (1..self.ref_counts.len() as u32)
            .filter(|&block| self.ref_counts[block as usize] == 0 && !self.is_cached(block))
    }

    /// Takes the least valuable block (a free one, else the least recently used cached one)
    /// and hands it out with one reference. `None` when the queue is empty.
    #[inline]
    pub fn allocate(&mut self) -> Option<u32> {
        self.allocate_evicting().map(|(block, _)| block)
    }

    /// `allocate`, saying what the block held if it was a cached block: its hash, which a
    /// lower tier may keep a copy under (the bytes are intact until the block is written).
    #[inline]
    pub fn allocate_evicting(&mut self) -> Option<(u32, Option<BlockHash>)> {
        let block = match self.free_queue.pop_front(FREE) {
            Some(block) => block,
            None => {
                let victim = self.policy.victim(&self.free_queue)?;
                self.free_queue.remove(victim);
                victim
            }
        };
        let mut evicted = None;
        if self.is_cached(block) {
            let hash = self.block_hashes[block as usize];
            if self.cached[block as usize] == (Cached::Yes { remember: true }) {
                self.evicted.record(hash);
            }
            // Pieces are no full block to demote, nor one a lookup could miss.
            evicted = (!self.is_pieces(block)).then_some(hash);
            self.unregister(block);
            self.num_evictable -= 1;
            self.counters.evictions += 1;
        }
        self.ref_counts.set(block as usize, 1);
        Some((block, evicted))
    }

    /// Adds a reference to a block already in use (a fork).
    #[inline]
    pub fn share(&mut self, block: u32) {
        debug_assert!(self.ref_counts[block as usize] > 0);
        self.ref_counts.update(block as usize, |count| *count += 1);
    }

    /// Drops one reference. A block nobody uses any more goes back to the queue: to the tail
    /// if it is cached (reused last), to the head otherwise (reused first).
    #[inline]
    pub fn release(&mut self, block: u32) {
        debug_assert!(
            self.ref_counts[block as usize] > 0,
            "release of unused block {block}"
        );
        self.ref_counts.update(block as usize, |count| *count -= 1);
        if self.ref_counts[block as usize] == 0 {
            if self.is_cached(block) {
                self.enqueue_cached(block);
                self.num_evictable += 1;
            } else {
                self.free_queue.push_front(FREE, block);
            }
        }
    }

    /// Whether `hash` named a block evicted among the last `num_blocks` evictions (and not
    /// cached since: callers look it up first).
    pub fn was_evicted(&self, hash: BlockHash) -> bool {
        self.evicted.contains(hash)
    }

    /// Makes a cached block that no sequence uses the most recently used (evicted last).
    #[inline]
    pub fn touch(&mut self, block: u32) {
        if self.ref_counts[block as usize] == 0 && self.is_cached(block) {
            self.free_queue.remove(block);
            self.enqueue_cached(block);
        }
    }

    /// The cached block holding `hash`, without taking it.
    #[inline]
    pub fn lookup(&self, hash: BlockHash) -> Option<u32> {
        if !self.enable_prefix_caching {
            return None;
        }
        self.find_cached(hash)
    }

    /// Takes a reference on a block found by `lookup`, taking it out of the queue if unused.
    #[inline]
    pub fn take_hit(&mut self, block: u32) {
        if self.ref_counts[block as usize] == 0 {
            self.free_queue.remove(block);
            self.num_evictable -= 1;
        }
        self.ref_counts.update(block as usize, |count| *count += 1);
        if (block as usize) < self.hits.len() {
            self.hits
                .update(block as usize, |hits| *hits = hits.saturating_add(1));
        }
    }

    pub(crate) fn record_lookups(&mut self, queries: usize, hits: usize) {
        self.counters.queries += queries as u64;
        self.counters.hits += hits as u64;
    }

    /// Registers a full, in-use block under `hash`; returns whether it joined. Does nothing
    /// when caching is off, when the block is registered already, or when another block
    /// holds the same contents (the first one stays the cached copy). With
    /// `remember_eviction`, `was_evicted` will know of its eviction: a windowed group's
    /// blocks go without (its misses are explained without the history, and its churn would
    /// crowd the full groups' evictions out).
    #[inline]
    pub fn register(&mut self, block: u32, hash: BlockHash, remember_eviction: bool) -> bool {
        if !self.enable_prefix_caching || self.cached[block as usize] != Cached::No {
            return false;
        }
        if self.find_cached(hash).is_some() {
            return false;
        }
        self.block_hashes.set(block as usize, hash);
        let cached = Cached::Yes {
            remember: remember_eviction,
        };
        self.cached.set(block as usize, cached);
        self.hits.set(block as usize, 0); // new contents, no history
        self.retention.reset(block);
        self.prefix_table.insert(block, hash.0[0]);
        true
    }

    /// Forgets a block's cached contents (its bytes were overwritten). An unused block moves
    /// ahead of the cached ones, where free blocks live.
    pub fn uncache(&mut self, block: u32) {
        if !self.is_cached(block) {
            return;
        }
        self.unregister(block);
        if self.ref_counts[block as usize] == 0 {
            self.free_queue.remove(block);
            self.free_queue.push_front(FREE, block);
            self.num_evictable -= 1;
        }
    }

    /// Forgets every cached block that no sequence uses; they become plain free blocks.
    /// Returns how many were dropped.
    pub fn reset_prefix_cache(&mut self) -> usize {
        if !self.enable_prefix_caching {
            return 0;
        }
        let mut dropped = 0;
        // In eviction order, not block order: a sequence's blocks are released tail first, so
        // a chain's tail leaves before its head, as it does when evicted — a router mirroring
        // the cache from its events (Dynamo's radix tree) cannot remove a block whose parent
        // it already removed.
        while let Some(block) = self.policy.victim(&self.free_queue) {
            self.unregister(block);
            // Among the free blocks now.
            self.free_queue.remove(block);
            self.free_queue.push_front(FREE, block);
            dropped += 1;
        }
        self.num_evictable -= dropped;
        dropped
    }

    /// Bytes of host memory this pool's bookkeeping holds.
    pub fn heap_bytes(&self) -> usize {
        self.ref_counts.capacity() * 4
            + self.free_queue.heap_bytes()
            + self.hits.capacity()
            + self.block_hashes.capacity() * std::mem::size_of::<BlockHash>()
            + self.cached.capacity() * std::mem::size_of::<Cached>()
            + self.prefix_table.heap_bytes()
            + self.removed.capacity() * std::mem::size_of::<(BlockHash, u32)>()
            + self.evicted.heap_bytes()
            + self
                .sub_blocks
                .as_ref()
                .map_or(0, SubBlockIndex::heap_bytes)
            + self.retention.heap_bytes()
    }

    /// Checks every structural invariant; `holders[b]` is how many sequences hold block `b`.
    pub fn check_invariants(&self, holders: &[u32]) -> Result<(), String> {
        let num_blocks = self.num_blocks();
        if self.ref_counts[NULL_BLOCK as usize] != 0 || self.free_queue.contains(NULL_BLOCK) {
            return Err("the null block is referenced or queued".into());
        }
        let mut seen = vec![false; num_blocks];
        let mut queued = 0;
        for block in self.free_queue.iter() {
            if seen[block as usize] {
                return Err(format!("block {block} is in the free queue twice"));
            }
            seen[block as usize] = true;
            queued += 1;
        }
        if queued != self.free_queue.len() {
            return Err(format!(
                "free queue holds {queued} blocks but counts {}",
                self.free_queue.len()
            ));
        }
        let mut evictable = 0;
        let mut registered = 0;
        let mut pieces = 0;
        for block in 1..num_blocks as u32 {
            let count = self.ref_counts[block as usize];
            if count != holders[block as usize] {
                return Err(format!(
                    "block {block} has reference count {count} but {} sequences hold it",
                    holders[block as usize]
                ));
            }
            if (count == 0) != seen[block as usize] {
                return Err(format!(
                    "block {block}: reference count {count}, queued {}",
                    seen[block as usize]
                ));
            }
            if self.is_pieces(block) {
                // Held only while an admission plans its copy, within one call.
                if count != 0 {
                    return Err(format!("block {block} of pieces has {count} holders"));
                }
                pieces += 1;
                evictable += 1;
            } else if self.is_cached(block) {
                registered += 1;
                if self.find_cached(self.block_hashes[block as usize]) != Some(block) {
                    return Err(format!("cached block {block} is not findable by its hash"));
                }
                if count == 0 {
                    evictable += 1;
                }
            }
        }
        if evictable != self.num_evictable {
            return Err(format!(
                "{evictable} evictable blocks, counter says {}",
                self.num_evictable
            ));
        }
        if pieces != self.num_pieces {
            return Err(format!(
                "{pieces} blocks of pieces, counter says {}",
                self.num_pieces
            ));
        }
        if registered != self.prefix_table.len() {
            return Err(format!(
                "{registered} cached blocks, prefix table holds {}",
                self.prefix_table.len()
            ));
        }
        if let Some(sub_blocks) = &self.sub_blocks {
            sub_blocks.check(|block| self.is_cached(block))?;
        }
        self.check_queues()
    }

    /// Free blocks in the free queue, cached ones in the queue their policy keeps them in.
    fn check_queues(&self) -> Result<(), String> {
        for block in self.free_queue.iter() {
            let queue = self.free_queue.queue_of(block);
            let expected = match self.is_cached(block) {
                true => {
                    let priority = self.retention.priority(block);
                    self.policy.queue_for(self.hits[block as usize], priority)
                }
                false => FREE,
            };
            let demoted = self.policy == EvictionPolicy::Slru && queue == Some(1);
            if queue != Some(expected) && !demoted {
                return Err(format!(
                    "block {block} in queue {queue:?}, its policy keeps it in {expected}"
                ));
            }
        }
        Ok(())
    }
}

#[path = "block_pool_retention.rs"]
mod retention_calls;
#[path = "block_pool_sub_blocks.rs"]
mod sub_block_calls;
#[cfg(test)]
#[path = "block_pool_tests.rs"]
mod tests;
#[path = "block_pool_undo.rs"]
mod undo;

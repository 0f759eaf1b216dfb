//! Allocation: the preallocated byte region and the fixed-size blocks carved from it.
//!
//! - [`MemPool`] serves acl-like `malloc`/`free` of any size inside one region, with a
//!   two-level segregated-fit [`range_allocator`] whose metadata lives outside the region.
//! - [`BlockPool`] hands out equal-size KV blocks from a [`free_queue`] and keeps the prefix
//!   cache: full blocks named by [`BlockHash`], found through an [`index_table`].
//! - [`fallible`] reserves bookkeeping memory without aborting the process when a size
//!   argument asks for more than the host has.

mod block_hash;
mod block_pool;
mod block_priorities;
mod eviction;
mod eviction_history;
pub(crate) mod fallible;
mod free_queue;
mod index_table;
mod mem_pool;
mod range_allocator;
mod sub_block_index;

pub use block_hash::BlockHash;
pub use block_pool::{BlockPool, PrefixCacheCounters, MAX_BLOCKS, MAX_SLOTS, NULL_BLOCK};
pub use eviction::{EvictionPolicy, DEFAULT_PRIORITY, LFU_LEVELS, MAX_PRIORITY, PROTECTED_SHARE};
pub use fallible::MAX_BOOKKEEPING_BYTES;
pub use mem_pool::{AlignmentPolicy, MemPool, MemPoolStats, PoolAllocation};

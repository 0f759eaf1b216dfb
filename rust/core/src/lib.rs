//! atb-mem core: the KV-cache memory layer of an LLM inference server, without Python.
//!
//! - [`BlockPool`]: fixed-size blocks with reference counts, an O(1) free queue and an LRU
//!   prefix cache of full blocks named by chained 128-bit hashes.
//! - [`KvCache`]: sequences mapped onto those blocks; batched append, fork with copy-on-write,
//!   block tables, slot mappings and FlashInfer's CSR page table.
//! - [`BatchTable`]: the persistent decode-step buffers a model runner keeps (and a CUDA graph
//!   needs at fixed addresses), updated in place.
//!
//! The core manages indices, never bytes: whatever must move (copy-on-write, swaps) comes back
//! as one ordered list of [`BlockMove`]s for the caller's backing to execute.

pub mod alloc_util;
pub mod batch_table;
pub mod block_hash;
pub mod block_move;
pub mod block_pool;
pub mod continuous_scheduler;
pub mod error;
pub mod free_queue;
pub mod index_table;
pub mod kv_cache;
pub mod layout;
pub mod mem_pool;
pub mod range_allocator;
pub mod request_batcher;
pub mod step_tables;

pub use alloc_util::MAX_BOOKKEEPING_BYTES;
pub use batch_table::BatchTable;
pub use block_hash::BlockHash;
pub use block_move::{pairs_of, BlockMove, MoveKind};
pub use block_pool::{BlockPool, PrefixCacheCounters, MAX_SLOTS, NULL_BLOCK};
pub use continuous_scheduler::{ContinuousScheduler, Preemption, SchedulerConfig, StepPlan};
pub use error::{CoreError, CoreResult};
pub use kv_cache::{KvCache, KvCacheStats, Tokens};
pub use layout::{KvDtype, KvLayout};
pub use mem_pool::{AlignmentPolicy, MemPool, MemPoolStats, PoolAllocation};
pub use range_allocator::RangeAllocator;
pub use request_batcher::{BatcherConfig, Poll, RequestBatcher, TimeoutAction};
pub use step_tables::BlockTableWriter;

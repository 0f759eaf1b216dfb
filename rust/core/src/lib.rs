//! atb-mem core: the KV-cache memory layer of an LLM inference server, without Python.
//!
//! Three layers, following Ascend Transformer Boost's memory strategy, one folder each:
//! - [`alloc`]-ation: a preallocated byte region cut by an O(1) range allocator
//!   ([`MemPool`]), and fixed-size KV blocks with reference counts, an O(1) free queue and an
//!   LRU prefix cache of full blocks named by chained 128-bit hashes ([`BlockPool`]);
//! - the KV cache: sequences mapped onto those blocks ([`KvCache`]): batched append, fork
//!   with copy-on-write, swap to a host tier, block tables, slot mappings and FlashInfer's CSR
//!   page table, and the persistent decode-step buffers a model runner keeps ([`BatchTable`]);
//! - scheduling: continuous batching over the cache ([`ContinuousScheduler`], one
//!   [`StepPlan`] per step) and whole-request batching ([`RequestBatcher`]).
//!
//! Beside them, [`PagedAttention`] and [`Linear`] (a layer's product over a decode's few
//! rows) compute a model's step on the CPU, and [`content_digests`] names a model's weights by every byte, so that tiers
//! shared across engines never serve one model's K/V to another.
//!
//! The core manages indices, never bytes: whatever must move (copy-on-write, swaps) comes back
//! as one ordered list of [`BlockMove`]s for the caller's backing to execute.
//!
//! The modules are private; what a server embeds is re-exported here.

#[macro_use]
mod error;
#[macro_use]
mod figures;
mod alloc;
mod attention;
mod content_digest;
mod kv_cache;
mod layout;
mod linear;
mod quant;
mod sched;
mod undo;

pub use alloc::{
    AlignmentPolicy, BlockHash, BlockPool, EvictionPolicy, MemPool, MemPoolStats, PoolAllocation,
    PrefixCacheCounters, DEFAULT_PRIORITY, LFU_LEVELS, MAX_BOOKKEEPING_BYTES, MAX_PRIORITY,
    MAX_SLOTS, NULL_BLOCK, PROTECTED_SHARE,
};
pub use attention::MAX_THREADS as MAX_ATTENTION_THREADS;
pub use attention::{
    bf16, f16, use_openmp, write_slots, AttentionShape, Element, Fp8E4m3Code, InstructionSet,
    Int8Code, NewKv, OpenMpParallel, PagedAttention, StepRows, Visibility,
};
pub use content_digest::{content_digests, Digest, PIECE_BYTES};
pub use error::{CoreError, CoreResult};
pub use figures::{Figure, Figures};
pub use kv_cache::{
    checkpoint_key, group_hybrid_layers, group_key, group_layers, is_checkpoint_key, layer_kinds,
    pairs_of, AttentionKind, BatchTable, BlockMove, GroupPrefix, HostPrefixCounters, KvCache,
    KvCacheConfig, KvCacheGroup, KvCacheStats, KvEvent, KvEventKind, KvEventLog, LayerGroups,
    LayerKind, Medium, MissReason, MoveFailure, MoveKind, PrefixExplanation, RetentionConfig,
    StateGroup, TokenRetention, Tokens, MAX_RETENTION_RANGES, PAD_SLOT, RECURRENT_LAYER_TYPE,
    SEQUENCE_BYTES,
};
pub use layout::{KvDtype, KvLayout};
pub use linear::Linear;
pub use quant::{quantize_rows, Fp8E4m3Rows, Int8Rows, KvCacheDtype, RowFormat, FP8_E4M3_MAX};
pub use sched::{
    BatcherConfig, BlockLoad, BlockTableWriter, ContinuousScheduler, LoadCounters, Poll,
    Preemption, RequestBatcher, SchedulerConfig, StepPlan, TimeoutAction, MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
};
#[doc(hidden)]
pub use undo::skip_one_undo;

//! Sequences mapped onto blocks: allocation with prefix reuse, batched append, fork with
//! copy-on-write, swap to a host tier, and the block tables and slot mappings that
//! paged-attention kernels read.
//!
//! Every public call checks all of its arguments and its block budget before it changes
//! anything, so a call that fails leaves the cache exactly as it was.
//!
//! State is owned by the part that changes it:
//! - blocks by the `tiers` (`Tiers`): the device's [`BlockPool`], the host tier, the block
//!   moves planned between them and the [`KvEventLog`]; every feature takes, frees,
//!   demotes, promotes and looks up blocks through it;
//! - the sequences and their block lists by the sequence table (`sequences`): a sequence's
//!   fields are private to it, read through methods and changed only by those that say what
//!   the change is (`sequences::changes`), and the table records what a transaction changed;
//! - recurrent states by `state::RecurrentStates` (their checkpoints are cached blocks:
//!   `state_checkpoints`);
//! - prefix-hit counters by `stats::PrefixStats`; what a group of each attention kind keeps
//!   and releases by the window policy (`windows`); per-call buffers by `scratch`.
//!
//! The names blocks are cached under are a leaf of their own (`keys`). Each owner records
//! its own changes in a transaction, and `undo_record` keeps the rest (see `crate::undo`).
//! The verbs built on them: `lifecycle` (admit, fork, mark computed, free), `append`,
//! `tables`, `swap`, `transaction` (plan, execute, commit or roll back); block moves and the
//! batch table are the two parts other layers see; `config` is what a cache is built with.

mod append;
mod batch_table;
mod block_move;
mod config;
mod event_recording;
mod events;
mod groups;
mod host_prefix;
mod invariants;
mod keys;
mod lifecycle;
mod partial_hits;
mod prefix_explain;
mod prefix_match;
mod retention;
mod scratch;
mod sequences;
mod state;
mod state_checkpoints;
mod stats;
mod swap;
mod tables;
mod tiers;
mod transaction;
mod undo_record;
mod windows;

pub use batch_table::{BatchTable, PAD_SLOT};
pub use block_move::{pairs_of, BlockMove, MoveKind};
pub use config::KvCacheConfig;
pub use events::{KvEvent, KvEventKind, KvEventLog, Medium};
pub use groups::{
    group_hybrid_layers, group_layers, layer_kinds, AttentionKind, KvCacheGroup, LayerGroups,
    LayerKind, RECURRENT_LAYER_TYPE,
};
pub use keys::{checkpoint_key, group_key, is_checkpoint_key};
pub use prefix_explain::{GroupPrefix, MissReason, PrefixExplanation};
pub use retention::{RetentionConfig, TokenRetention, MAX_RETENTION_RANGES};
use scratch::Scratch;
pub use sequences::SEQUENCE_BYTES;
use sequences::{GroupTable, Sequence, SequenceTable};
use state::RecurrentStates;
pub use state::StateGroup;
pub use stats::KvCacheStats;
use stats::PrefixStats;
pub use tables::RowMemo;
pub use tiers::HostPrefixCounters;
use tiers::Tiers;
pub use transaction::MoveFailure;

use crate::alloc::{BlockHash, BlockPool, EvictionPolicy};
use crate::error::{CoreError, CoreResult};
use crate::layout::KvLayout;

/// What `alloc_sequence` is given: a token count, or the token ids themselves (which lets
/// full blocks be found in, and added to, the prefix cache).
#[derive(Debug, Clone, Copy)]
pub enum Tokens<'a> {
    Count(usize),
    Ids(&'a [u32]),
}

impl Tokens<'_> {
    pub fn len(&self) -> usize {
        match self {
            Tokens::Count(count) => *count,
            Tokens::Ids(ids) => ids.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[derive(Debug, Clone)]
pub struct KvCache {
    /// The device's blocks, the host tier's, the moves between them and the KV events.
    tiers: Tiers,
    /// The model's layers, K/V heads, head size and dtype.
    layout: KvLayout,
    /// The layers' groups (one full-attention group of every layer unless layer kinds were
    /// given) and how many layers' K/V one block holds.
    groups: Vec<KvCacheGroup>,
    layers_per_block: usize,
    bytes_per_block: usize,
    /// `tokens_in_blocks(num_blocks - 1)`, checked on every append.
    max_seq_tokens: usize,
    /// The recurrent layers' states and their checkpoints.
    states: RecurrentStates,
    sequences: SequenceTable,
    prefix_stats: PrefixStats,
    deferred_sub_blocks: partial_hits::DeferredSubBlocks,
    /// Reused per call so that hot paths allocate nothing.
    scratch: Scratch,
    /// What an open transaction puts back if it fails (see `undo_record`).
    undo: undo_record::UndoRecord,
}

/// A sequence as the batch table sees it: the only window it has into the slab.
struct SlabView<'a> {
    /// `None` when the slab is vacant.
    pub seq_id: Option<u64>,
    pub swapped: bool,
    /// Group 0's blocks (every group's list is as long).
    pub blocks: &'a [u32],
    pub tables: &'a [GroupTable],
    pub num_tokens: usize,
    pub version: u64,
}

const NO_BLOCK: u32 = u32::MAX;

impl KvCache {
    /// The layer groups, in order of their first layer.
    pub fn groups(&self) -> &[KvCacheGroup] {
        &self.groups
    }

    pub fn num_groups(&self) -> usize {
        self.groups.len()
    }

    /// How many layers' K/V one block holds (every layer, unless layer kinds were given).
    pub fn layers_per_block(&self) -> usize {
        self.layers_per_block
    }

    /// The group of attention layer `layer` and the slot it uses in that group's blocks.
    pub fn group_of_layer(&self, layer: usize) -> CoreResult<(usize, usize)> {
        let found = self.groups.iter().enumerate().find_map(|(group, spec)| {
            let slot = spec.layers.iter().position(|&l| l == layer)?;
            Some((group, slot))
        });
        match found {
            Some(found) => Ok(found),
            None if layer < self.layout.num_layers => Err(invalid!(
                "layer {layer} is a recurrent layer: it has a state, not K/V blocks \
                 (state_of_layer)"
            )),
            None => Err(invalid!(
                "layer {layer} is not a layer of this model (num_layers = {})",
                self.layout.num_layers
            )),
        }
    }

    #[inline]
    pub fn block_size(&self) -> usize {
        self.tiers.block_pool.block_size()
    }

    pub fn num_blocks(&self) -> usize {
        self.tiers.block_pool.num_blocks()
    }

    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    pub fn bytes_per_block(&self) -> usize {
        self.bytes_per_block
    }

    pub fn enable_prefix_caching(&self) -> bool {
        self.tiers.block_pool.enable_prefix_caching()
    }

    pub fn eviction_policy(&self) -> EvictionPolicy {
        self.tiers.block_pool.eviction_policy()
    }

    /// Whether any fork happened (only then can a copy-on-write be decided).
    pub fn has_forked(&self) -> bool {
        self.sequences.has_forked()
    }

    /// Blocks an allocation can take now (free plus evictable cached blocks).
    pub fn num_free_blocks(&self) -> usize {
        self.tiers.block_pool.num_free()
    }

    pub fn num_sequences(&self) -> usize {
        self.sequences.len()
    }

    pub fn contains(&self, seq_id: u64) -> bool {
        self.sequences.contains(seq_id)
    }

    /// Most tokens one sequence can ever hold: every block but the null block (see
    /// [`KvCache::tokens_in_blocks`]).
    pub fn max_seq_tokens(&self) -> usize {
        self.max_seq_tokens
    }

    /// Most tokens one sequence can hold in `blocks` blocks, computed as a scheduler computes
    /// it: a full-attention group needs a block per `block_size` tokens; a windowed group as
    /// many, but never more than its window (or chunk) and a block more, so a window larger
    /// than the pool still serves every sequence shorter than the pool. Without
    /// full-attention groups, a length past every window is any length whose slots fit the
    /// kernels' int32. A sequence's recurrent states take their blocks first.
    pub fn tokens_in_blocks(&self, blocks: usize) -> usize {
        let block_size = self.block_size();
        // Recurrent layers' states come first, whatever the length.
        let Some(blocks) = blocks.checked_sub(self.states.blocks_per_seq) else {
            return 0;
        };
        // Blocks a sequence of `k` blocks' worth of tokens holds at once; nondecreasing in k.
        let held = |k: usize| -> usize {
            self.groups
                .iter()
                .map(|spec| match spec.kind.max_blocks_held(block_size) {
                    Some(most) => k.min(most),
                    None => k,
                })
                .fold(0usize, usize::saturating_add)
        };
        if held(usize::MAX) <= blocks {
            return crate::alloc::MAX_SLOTS - 1; // only windows, all of which fit
        }
        // The largest k with held(k) <= blocks lies in [0, blocks]: past `blocks`, either
        // the widest window still grows with k, or every window is full, which is too many.
        let (mut fits, mut too_many) = (0, blocks + 1);
        while too_many - fits > 1 {
            let middle = fits + (too_many - fits) / 2;
            match held(middle) <= blocks {
                true => fits = middle,
                false => too_many = middle,
            }
        }
        fits * block_size
    }

    /// The prefix cache's chain hashes of `token_ids`' full blocks (what names them in every
    /// tier, and in KV events), into `out`, which is cleared first. With `after`, the chain
    /// goes on from that block's hash (`token_ids` are the tokens after it, the salt already
    /// in its chain): a sequence's new blocks hash without its whole context again.
    pub fn block_hashes(
        &self,
        token_ids: &[u32],
        cache_salt: Option<&[u8]>,
        after: Option<BlockHash>,
        out: &mut Vec<BlockHash>,
    ) {
        out.clear();
        let mut parent = after.unwrap_or_else(|| BlockHash::root(cache_salt));
        for chunk in token_ids.chunks_exact(self.block_size()) {
            parent = parent.chain(chunk);
            out.push(parent);
        }
    }

    pub fn block_pool(&self) -> &BlockPool {
        &self.tiers.block_pool
    }

    /// Ids of the live sequences, in no particular order.
    pub fn seq_ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.sequences.ids()
    }

    #[inline]
    fn slab_of(&self, seq_id: u64) -> CoreResult<u32> {
        self.sequences.slab_of(seq_id)
    }

    /// What the batch table reads of the sequence in slab `slab` (live or not).
    #[inline]
    fn slab_view(&self, slab: u32) -> SlabView<'_> {
        let seq = &self.sequences[slab];
        SlabView {
            seq_id: seq.is_live().then_some(seq.seq_id()),
            swapped: seq.is_swapped(),
            blocks: seq.blocks(),
            tables: seq.tables(),
            num_tokens: seq.num_tokens(),
            version: seq.version(),
        }
    }

    #[inline]
    fn sequence(&self, seq_id: u64) -> CoreResult<&Sequence> {
        self.sequences.get(seq_id)
    }

    /// A sequence whose blocks are on the device (not swapped out).
    #[inline]
    fn device_sequence(&self, seq_id: u64) -> CoreResult<&Sequence> {
        let seq = self.sequence(seq_id)?;
        if seq.is_swapped() {
            return Err(swapped_out(seq_id));
        }
        Ok(seq)
    }

    pub fn is_swapped(&self, seq_id: u64) -> CoreResult<bool> {
        Ok(self.sequence(seq_id)?.is_swapped())
    }

    /// (tokens, swapped out) of a sequence, in one lookup.
    pub fn seq_len_and_tier(&self, seq_id: u64) -> CoreResult<(usize, bool)> {
        let sequence = self.sequence(seq_id)?;
        Ok((sequence.num_tokens(), sequence.is_swapped()))
    }

    pub fn seq_len(&self, seq_id: u64) -> CoreResult<usize> {
        Ok(self.sequence(seq_id)?.num_tokens())
    }

    /// The blocks of one sequence in group 0, in token order (host blocks while it is
    /// swapped out).
    pub fn block_table(&self, seq_id: u64) -> CoreResult<&[u32]> {
        Ok(self.sequence(seq_id)?.blocks())
    }

    /// The blocks of one sequence in `group`, the null block where a window released one.
    pub fn group_block_table(&self, seq_id: u64, group: usize) -> CoreResult<&[u32]> {
        self.check_group(group)?;
        Ok(self.sequence(seq_id)?.tables()[group].blocks())
    }

    /// Blocks the sequence holds now, summed over its groups (null blocks not counted).
    pub fn num_held_blocks(&self, seq_id: u64) -> CoreResult<usize> {
        Ok(self.sequence(seq_id)?.held_blocks().count())
    }

    fn check_group(&self, group: usize) -> CoreResult<()> {
        ensure!(
            group < self.groups.len(),
            "group {group} does not exist: this cache has {} group(s)",
            self.groups.len()
        );
        Ok(())
    }

    /// Checks that `count` tokens can ever be allocated at once: in every group (`lazy`
    /// false), or as a scheduler admits them (windowed groups chunk by chunk).
    fn check_token_count(&self, count: usize, what: &str, lazy: bool) -> CoreResult<()> {
        ensure!(count != 0, "{what} must be at least 1, got 0");
        let usable = self.num_blocks() - 1;
        let most = match lazy {
            true => self.max_seq_tokens(),
            false => (usable - self.states.blocks_per_seq) / self.groups.len() * self.block_size(),
        };
        ensure!(
            count <= most,
            "{what} = {count} can never fit: the pool holds at most {most} tokens per sequence \
             ({usable} usable blocks of {} for {} group(s){})",
            self.block_size(),
            self.groups.len(),
            match self.states.blocks_per_seq {
                0 => String::new(),
                blocks => format!(", {blocks} of them each sequence's recurrent states"),
            }
        );
        Ok(())
    }

    /// Resolves a batch of ids into `scratch_slabs` (see `SequenceTable::resolve_batch`).
    fn resolve_batch(&mut self, seq_ids: &[u64]) -> CoreResult<()> {
        self.sequences
            .resolve_batch(seq_ids, &mut self.scratch.slabs)
    }
}

fn swapped_out(seq_id: u64) -> CoreError {
    invalid!("sequence {seq_id} is swapped out; swap_in() it first")
}

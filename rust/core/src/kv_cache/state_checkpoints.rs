//! Prefix hits for models with recurrent layers: states kept at block boundaries.
//!
//! A recurrent layer's state exists only for the position it was computed at, so the K/V
//! of a cached prefix is no use to a hybrid model without the state at the hit's end (vLLM's
//! users saw a 0% hit rate on such models before its `mamba_cache_mode`). A *checkpoint* is a
//! copy of one sequence's recurrent states after its first `p` tokens, `p` a block
//! boundary: `num_state_blocks` blocks, cached like K/V blocks under keys derived from the
//! chain hash of the block that ends at `p` ([`checkpoint_key`], one per state block), so
//! they are evicted by the same policy and counted in the same pool.
//!
//! - **Saving** ([`KvCache::checkpoint_state`]): when a sequence's computed tokens end at
//!   its prompt's last block boundary, where the cached K/V its prompt shared ends, or on the
//!   checkpoint stride (`state_checkpoint_interval` blocks), its states are copied into
//!   fresh blocks by copy moves, which join the cache at once: moves run in order, so a hit
//!   planned later reads them after the copy. A scheduler saves at the start of each step,
//!   before it plans the sequence's next tokens, and with chunked prefill ends prefill
//!   chunks at those points (vLLM's `align` mode); a step whose only moves are saves goes on
//!   without them if they fail, so it needs no snapshot.
//! - **Hits**: a lookup takes the attention groups' longest hit and cuts it back to the
//!   longest checkpoint within it whose every block is cached (`state_checkpoint` when that
//!   cuts it short). The admission holds the checkpoint's blocks while it allocates, plans a
//!   copy of each into the sequence's own state blocks, and lets them go: the model resumes
//!   from the copy and the checkpoint stays cached, never written.
//!
//! Only caches whose attention layers all attend fully: a windowed group's hit needs blocks
//! just before its end that a checkpoint does not keep alive, so such hybrids serve no hit.
//! The KV events name the K/V blocks only: a router hashes the tokens it sees, and
//! checkpoints are the engine's own business. A lower tier (host prefix cache, disk, store)
//! keeps no checkpoint: a hit always resumes from one on the device.

use super::keys::checkpoint_key;
use super::{KvCache, Tiers};
use crate::alloc::{BlockHash, BlockPool};
use crate::error::CoreResult;
use crate::kv_cache::{BlockMove, MoveKind};

/// A lookup's limiting "group" when a checkpoint cut the hit short (see `miss_reason`).
pub(super) const STATE_LIMIT: usize = usize::MAX;

impl KvCache {
    /// Keeps checkpoints every `blocks` blocks of a sequence (vLLM's retention interval), on
    /// top of those at a prompt's last block boundary and where the K/V it shared ends: 1
    /// keeps one at every block boundary a sequence's computation stops at. The default
    /// keeps one per as many blocks of K/V as a checkpoint takes, so that those kept while a
    /// sequence decodes take at most the memory of the K/V they cover.
    /// (`KvCacheConfig::state_checkpoint_interval`, applied by `from_config`.)
    pub(super) fn set_state_checkpoint_interval(&mut self, blocks: usize) -> CoreResult<()> {
        ensure!(
            blocks != 0,
            "state_checkpoint_interval must be at least 1 block, got 0"
        );
        ensure!(
            blocks <= self.num_blocks(),
            "state_checkpoint_interval = {blocks} blocks is longer than any sequence this pool \
             holds ({} blocks)",
            self.num_blocks()
        );
        self.states.checkpoint_interval = blocks;
        Ok(())
    }

    /// Blocks between two checkpoints of a sequence.
    pub fn state_checkpoint_interval(&self) -> usize {
        self.states.checkpoint_interval
    }

    /// Whether this cache keeps checkpoints of recurrent states, and so serves prefix hits to
    /// a model with recurrent layers: prefix caching on, recurrent layers, and attention
    /// layers that all attend fully.
    pub fn keeps_state_checkpoints(&self) -> bool {
        self.has_state()
            && self.enable_prefix_caching()
            && self.groups.iter().all(|group| !group.kind.is_windowed())
    }

    /// Tokens between checkpoints (0 when none are kept).
    pub fn checkpoint_stride(&self) -> usize {
        match self.keeps_state_checkpoints() {
            true => self.states.checkpoint_interval * self.block_size(),
            false => 0,
        }
    }

    /// Whether [`KvCache::checkpoint_state`] would keep a checkpoint of `seq_id` now (false
    /// for unknown or swapped sequences): its computed tokens end at its prompt's last block
    /// boundary, where the K/V its admission found cached ends ([`KvCache::kv_reach`]), or on
    /// the stride, with known ids, no whole checkpoint cached there (one that lost blocks to
    /// evictions is made whole again), and free blocks for one.
    pub fn checkpoint_due(&self, seq_id: u64) -> bool {
        let slab = self.slab_of(seq_id);
        slab.is_ok_and(|slab| self.due_checkpoint(slab).is_some())
    }

    /// The hash of the block a due checkpoint of the sequence in `slab` ends (see
    /// `checkpoint_due`). Called for every running sequence at every step: most leave at
    /// the first test, a computed length inside a block.
    #[inline]
    fn due_checkpoint(&self, slab: u32) -> Option<BlockHash> {
        let seq = &self.sequences[slab];
        let (computed, block_size) = (seq.num_computed(), self.block_size());
        let stride = self.checkpoint_stride();
        if computed % block_size != 0 || stride == 0 {
            return None;
        }
        if self.tiers.block_pool.num_free() < self.states.blocks_per_seq {
            return None;
        }
        let on_boundary = computed % stride == 0
            || computed == seq.kv_reach() as usize * block_size
            || computed == seq.prompt_blocks() as usize * block_size;
        if seq.is_swapped() || !seq.is_hashable() || computed == 0 || !on_boundary {
            return None;
        }
        let hash = *seq.hashes().get(computed / block_size - 1)?;
        (!self.find_checkpoint(hash)).then_some(hash)
    }

    /// Tokens of `seq_id`'s prompt whose K/V its admission found cached, whether or not a
    /// checkpoint let it use them (0 without recurrent layers). A prompt that shares a cached
    /// prefix but finds no state at its end recomputes it; a checkpoint kept where the
    /// sharing ends serves the next prompt that shares it (a system prompt, say), so a
    /// scheduler ends a chunk there too.
    pub fn kv_reach(&self, seq_id: u64) -> CoreResult<usize> {
        let seq = self.sequence(seq_id)?;
        Ok(match self.has_state() {
            true => seq.kv_reach() as usize * self.block_size(),
            false => 0,
        })
    }

    /// Where a checkpoint of `seq_id`'s prompt is kept whatever the stride: its last block
    /// boundary before its last token (what the same prompt, or a longer one, asked again
    /// resumes from; a next turn of a conversation too). 0 without recurrent layers.
    pub fn prompt_checkpoint(&self, seq_id: u64) -> CoreResult<usize> {
        let seq = self.sequence(seq_id)?;
        Ok(match self.has_state() {
            true => seq.prompt_blocks() as usize * self.block_size(),
            false => 0,
        })
    }

    /// Keeps a checkpoint of `seq_id`'s recurrent states at its computed tokens, if they end
    /// on the checkpoint stride, its token ids are known, none is cached there yet and free
    /// blocks hold one (see the module docs): plans the copies and returns true. The caller
    /// runs the pending moves before the sequence's next tokens change its states.
    pub fn checkpoint_state(&mut self, seq_id: u64) -> CoreResult<bool> {
        let slab = self.slab_of(seq_id)?;
        let Some(hash) = self.due_checkpoint(slab) else {
            return Ok(false);
        };
        let KvCache {
            sequences,
            tiers,
            scratch,
            ..
        } = self;
        // Every block is taken before any is released to the cache, so that no policy can
        // evict one column for the next.
        scratch.checkpoint.clear();
        for &source in sequences[slab].state() {
            let block = tiers.allocate_device()?;
            let copy = BlockMove::new(MoveKind::Copy, source, block);
            tiers.pending_moves.push(copy);
            scratch.checkpoint.push(block);
        }
        // The K/V blocks those evicted are logged as such before the blocks change roles.
        self.sync_removed();
        let KvCache { tiers, scratch, .. } = self;
        for (column, &block) in scratch.checkpoint.iter().enumerate() {
            // A column another block holds already (its twins evicted) stays as it is.
            if tiers
                .block_pool
                .register(block, checkpoint_key(hash, column), false)
            {
                tiers.events.checkpoint_cached(block);
            }
            tiers.block_pool.release(block);
        }
        scratch.checkpoint.clear();
        self.prefix_stats.count_checkpoint();
        Ok(true)
    }

    /// Forgets the checkpoints whose saving `moves` were (their copies failed): their blocks
    /// go back to the free queue, holding nothing. (A block a later allocation of the same
    /// step took is no checkpoint's any more: what the failed copy wrote there is written
    /// over before it is read.)
    pub(crate) fn forget_checkpoints(&mut self, moves: &[BlockMove]) {
        let copies = moves
            .iter()
            .filter(|planned| planned.kind == MoveKind::Copy);
        for planned in copies.clone() {
            self.tiers.block_pool.uncache(planned.dst);
        }
        let saves = copies.count() / self.states.blocks_per_seq.max(1);
        self.prefix_stats.count_checkpoints_lost(saves);
    }

    /// Whether every block of the checkpoint at the end of the block named `hash` is cached
    /// (asked column by column: a missing first one answers in one probe).
    fn find_checkpoint(&self, hash: BlockHash) -> bool {
        (0..self.states.blocks_per_seq).all(|column| {
            self.tiers
                .block_pool
                .lookup(checkpoint_key(hash, column))
                .is_some()
        })
    }

    /// Cuts a lookup's `hits` leading blocks back to the longest run that ends at a cached
    /// checkpoint, whose blocks go to `scratch_checkpoint`; `limited_by` becomes the state's
    /// when that cuts it short. Returns the hit.
    pub(super) fn checkpoint_hit(
        &mut self,
        hits: usize,
        limited_by: &mut Option<(usize, usize)>,
    ) -> usize {
        self.scratch.checkpoint.clear();
        let found = match self.keeps_state_checkpoints() {
            // The first column rules most candidates out in one probe.
            true => (1..=hits)
                .rev()
                .find(|&end| self.find_checkpoint(self.scratch.hashes[end - 1])),
            false => None,
        };
        let resumed = found.unwrap_or(0);
        if let Some(end) = found {
            let hash = self.scratch.hashes[end - 1];
            for column in 0..self.states.blocks_per_seq {
                let block = self.tiers.block_pool.lookup(checkpoint_key(hash, column));
                self.scratch.checkpoint.extend(block);
            }
        }
        if resumed < hits {
            *limited_by = Some((STATE_LIMIT, resumed));
        }
        resumed
    }

    /// Blocks of the checkpoint in `scratch_checkpoint` that no sequence uses: held off the
    /// free queue while an admission allocates.
    pub(super) fn checkpoint_held(&self) -> usize {
        self.scratch
            .checkpoint
            .iter()
            .filter(|&&block| self.tiers.block_pool.ref_count(block) == 0)
            .count()
    }
}

/// Holds the checkpoint a new sequence resumes from, so that its allocations cannot take a
/// block before the copy from it is planned.
pub(super) fn hold_checkpoint(block_pool: &mut BlockPool, checkpoint: &[u32]) {
    for &block in checkpoint {
        block_pool.take_hit(block);
    }
}

/// Plans the copies of the held `checkpoint` into a new sequence's `state` blocks, then lets
/// the checkpoint go back to the cache (the most recently used).
pub(super) fn resume_from_checkpoint(tiers: &mut Tiers, checkpoint: &[u32], state: &[u32]) {
    debug_assert!(checkpoint.is_empty() || checkpoint.len() == state.len());
    for (&source, &block) in checkpoint.iter().zip(state) {
        tiers
            .pending_moves
            .push(BlockMove::new(MoveKind::Copy, source, block));
        tiers.block_pool.release(source);
    }
}

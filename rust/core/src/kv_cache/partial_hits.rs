//! Prefix hits finer than a block: `hash_block_size = H` dividing `block_size = B`.
//!
//! Ascend's kernels want blocks of 128 tokens, and a hash per 128 tokens reuses only whole
//! blocks: a prompt sharing 250 tokens with a cached one reuses 128. With sub-block keys
//! (see `alloc::sub_block_index`) a lookup finds, after its whole-block hits, the longest
//! run of `H`-token pieces of the next block that a cached block starts with. That block
//! belongs to the prefix it completes, so it is never written: the new sequence gets a fresh
//! block and a copy move (through the executor, like a copy-on-write) of the source's slots,
//! and computes from the end of the copied pieces on. TensorRT-LLM's partial reuse does the
//! same.
//!
//! What stays as it was, and why:
//! - Full blocks keep their keys (`BlockHash::chain` over `B` tokens) and the KV events
//!   name only them, with `block_size` tokens each: routers (vLLM's, Dynamo's) hash token ids
//!   at the engine's block size and would not know sub-block keys. A sub-block hit is the
//!   engine's own saving, invisible to them, so a router never overestimates a hit.
//! - A block's sub-keys live exactly as long as its device cache entry; a copy demoted to
//!   the host tier, and the tiers below, serve whole blocks only.
//!
//! The longest cached prefix at a piece boundary includes the computed pieces of an ended
//! sequence's last, partly filled block: when its last holder frees it, that block stays
//! cached, known by the sub-keys of its whole computed pieces only (`Cached::Pieces` in the
//! block pool). It has no full key, so no KV event names it (a router's hashes are of full
//! blocks), no eviction is demoted to the host tier for it, and a lookup of whole blocks
//! never finds it; it is evicted like any cached block, first among its sequence's blocks
//! (released first). A block a fork still shares is not cached: the fork writes into it.
//! A running sequence's last block is not offered either: it is still being written, and
//! a copy of it would have to be ordered against the appends and copy-on-writes of the
//! same step, for a prefix its own sequence will have cached as a full block soon.
//! - Only caches whose every group attends fully: a windowed group's hit needs a window of
//!   blocks ending at the hit, which a copied piece does not give.
//!
//! A scheduler marks a step's tokens computed before the model computes them, and another
//! admission of the same step may share those blocks (the kernels write every token's K/V
//! before any attention reads it). A copy runs before the step's kernels, though, so a
//! block marked during a step may not be copied from in that step: its sub-keys wait in
//! [`DeferredSubBlocks`] until the next step starts, when its bytes are written.
//!
//! Omitting `hash_block_size` (or setting it to `block_size`) changes nothing at all.

use super::keys::{group_key, piece_keys};
use super::retention::retain_joined;
use super::sequences::Sequence;
use super::{BlockMove, KvCache, MoveKind, Tiers};
use crate::alloc::{BlockHash, BlockPool, NULL_BLOCK};
use crate::error::CoreResult;

impl KvCache {
    /// Finds prefix hits at every `hash_block_size` tokens, not only at block boundaries (see
    /// the module docs): `KvCacheConfig::hash_block_size`, applied by `from_config` before
    /// any sequence exists. `hash_block_size` must divide the block size, and every group
    /// must attend fully.
    pub(super) fn set_hash_block_size(&mut self, hash_block_size: usize) -> CoreResult<()> {
        let block_size = self.block_size();
        ensure!(
            hash_block_size != 0 && block_size.is_multiple_of(hash_block_size),
            "hash_block_size must divide block_size = {block_size}, got {hash_block_size}"
        );
        ensure!(
            self.sequences.is_empty() && self.tiers.block_pool.num_cached() == 0,
            "hash_block_size is set once, before any sequence exists"
        );
        if hash_block_size == block_size {
            return Ok(());
        }
        ensure!(
            self.enable_prefix_caching(),
            "hash_block_size needs prefix caching"
        );
        ensure!(
            self.groups.iter().all(|group| !group.kind.is_windowed()),
            "hash_block_size serves caches of full-attention layers only: a sliding or chunked \
             group's hit needs whole blocks up to where it ends"
        );
        ensure!(
            !self.has_state(),
            "hash_block_size serves caches without recurrent layers: their prefix hits need \
             states kept at the hit's position"
        );
        self.tiers
            .block_pool
            .enable_sub_blocks(block_size / hash_block_size - 1)
    }

    /// Tokens per prefix key: `block_size` unless `KvCacheConfig::hash_block_size` made it finer.
    pub fn hash_block_size(&self) -> usize {
        self.block_size() / (self.tiers.block_pool.sub_blocks_per_block() + 1)
    }

    /// From now on, blocks that join the prefix cache get their sub-keys only at the next
    /// `publish_sub_blocks` (a scheduler's step marks tokens its kernels compute later).
    pub(crate) fn defer_sub_blocks(&mut self, defer: bool) {
        self.deferred_sub_blocks.active = defer;
    }

    /// Indexes the sub-keys deferred since the last call, of the blocks still cached with
    /// the contents they were deferred with.
    pub(crate) fn publish_sub_blocks(&mut self) {
        let deferred = &mut self.deferred_sub_blocks;
        let per_block = self.tiers.block_pool.sub_blocks_per_block();
        for (at, &(block, key, count)) in deferred.blocks.iter().enumerate() {
            let same = self.tiers.block_pool.holds(block, key);
            if same && !self.tiers.block_pool.has_sub_blocks(block) {
                let first = at * per_block;
                let keys = &deferred.keys[first..first + count];
                self.tiers.block_pool.register_sub_blocks(block, keys);
            }
        }
        deferred.blocks.clear();
        deferred.keys.clear();
    }

    /// Whether sequences keep every token id (their blocks' sub-keys are made from them
    /// when the blocks join the cache).
    pub(super) fn has_sub_blocks(&self) -> bool {
        self.tiers.block_pool.sub_blocks_per_block() > 0
    }

    /// After `hits` whole blocks of `ids` (their keys in `scratch_hashes`), the longest run
    /// of leading pieces of the next block that cached blocks hold in every group: its
    /// tokens, with each group's source block in `scratch_partial`, and the tokens a lookup
    /// at piece granularity could have found past the whole blocks it asked for.
    pub(super) fn find_partial_hit(
        &mut self,
        ids: &[u32],
        hits: usize,
        queries: usize,
        cache_salt: Option<&[u8]>,
    ) -> (usize, usize) {
        self.scratch.partial.clear();
        let per_block = self.tiers.block_pool.sub_blocks_per_block();
        if per_block == 0 {
            return (0, 0);
        }
        let (block_size, piece) = (self.block_size(), self.hash_block_size());
        let queryable = (ids.len() - 1) / piece * piece - queries * block_size;
        // As for whole blocks, the last prompt token is always computed.
        let start = hits * block_size;
        let most = ((ids.len() - 1 - start) / piece).min(per_block);
        let parent = match hits {
            0 => BlockHash::root(cache_salt),
            _ => self.scratch.hashes[hits - 1],
        };
        self.scratch.sub_keys.clear();
        let pieces = &ids[start..start + most * piece];
        self.scratch
            .sub_keys
            .extend(piece_keys(parent, pieces, piece));
        'pieces: for j in (1..=most).rev() {
            self.scratch.partial.clear();
            for group in 0..self.groups.len() {
                let key = group_key(self.scratch.sub_keys[j - 1], group);
                match self.tiers.block_pool.lookup_sub_block(key) {
                    Some((source, _)) => self.scratch.partial.push(source),
                    None => continue 'pieces,
                }
            }
            return (j * piece, queryable);
        }
        self.scratch.partial.clear();
        (0, queryable)
    }

    /// Gives up the partial hit of sequence `seq_id`, just admitted, whose next block a lower
    /// tier loads whole: the load rewrites the copied pieces (a failed one with garbage), so
    /// they count as computed only with the block, and an end before then caches none of
    /// them (`keep_last_pieces`). The copy runs in vain.
    pub(crate) fn forget_partial_hit(&mut self, seq_id: u64) -> CoreResult<()> {
        let slab = self.slab_of(seq_id)?;
        let block_size = self.block_size();
        let seq = &mut self.sequences[slab];
        seq.computed_to_block_start(block_size);
        Ok(())
    }

    /// Before an ending sequence's blocks go back: caches the whole computed pieces of its
    /// last, partly computed block by their sub-keys, in every group or in none (a hit
    /// needs them all; see the module docs). Deferred like a full block's sub-keys when a
    /// scheduler's step ends it: what that step marked is computed only once it ran.
    pub(super) fn keep_last_pieces(&mut self, slab: u32) {
        let per_block = self.tiers.block_pool.sub_blocks_per_block();
        if per_block == 0 {
            return;
        }
        let (block_size, piece) = (self.block_size(), self.hash_block_size());
        let KvCache {
            sequences,
            tiers,
            scratch,
            deferred_sub_blocks: deferred,
            ..
        } = self;
        let (block_pool, keys) = (&mut tiers.block_pool, &mut scratch.sub_keys);
        let seq = &sequences[slab];
        let index = seq.num_computed() / block_size;
        let pieces = seq.num_computed() % block_size / piece;
        let start = index * block_size;
        // A hashable sequence keeps its token ids while sub-block keys are on; a swapped
        // one's blocks are on the host, which serves whole blocks only.
        let tokens = match seq.token_ids().get(start..start + pieces * piece) {
            Some(tokens) if pieces > 0 && seq.is_hashable() && !seq.is_swapped() => tokens,
            _ => return,
        };
        let ours = |table: &super::sequences::GroupTable| {
            let block = table.blocks().get(index).copied().unwrap_or(NULL_BLOCK);
            block != NULL_BLOCK && block_pool.can_keep_pieces(block)
        };
        if !seq.tables().iter().all(ours) {
            return;
        }
        let parent = match index {
            0 => seq.root_hash(),
            _ => seq.hashes()[index - 1],
        };
        for (group, table) in seq.tables().iter().enumerate() {
            let block = table.blocks()[index];
            keys.clear();
            keys.extend(piece_keys(parent, tokens, piece).map(|key| group_key(key, group)));
            let identity = keys[pieces - 1];
            block_pool.keep_pieces(block, identity);
            retain_joined(block_pool, seq.retention(), index, block);
            match deferred.active {
                true => {
                    deferred.blocks.push((block, identity, pieces));
                    deferred.keys.extend_from_slice(keys);
                    let padded = deferred.keys.len() + per_block - pieces;
                    deferred.keys.resize(padded, BlockHash::default());
                }
                false => block_pool.register_sub_blocks(block, keys),
            }
        }
    }
}

/// Sub-keys of blocks that joined the prefix cache during a scheduler's step, with the key
/// each block joined under (a block of pieces: its identity) and how many sub-keys it has
/// (`keys`: `per_block` places per block).
#[derive(Debug, Clone, Default)]
pub(super) struct DeferredSubBlocks {
    active: bool,
    blocks: Vec<(u32, BlockHash, usize)>,
    keys: Vec<BlockHash>,
}

/// Registers (or defers) the sub-block keys of `block`, which just joined the prefix cache
/// under `key` as block `index` of `group` in `seq` (`keys` is scratch).
pub(super) fn index_sub_blocks(
    block_pool: &mut BlockPool,
    seq: &Sequence,
    (keys, deferred): (&mut Vec<BlockHash>, &mut DeferredSubBlocks),
    (index, group, block, key): (usize, usize, u32, BlockHash),
) {
    let per_block = block_pool.sub_blocks_per_block();
    if per_block == 0 {
        return;
    }
    let block_size = block_pool.block_size();
    let piece = block_size / (per_block + 1);
    let Some(tokens) = seq
        .token_ids()
        .get(index * block_size..(index + 1) * block_size)
    else {
        debug_assert!(false, "a hashable sequence keeps its token ids");
        return;
    };
    let parent = match index {
        0 => seq.root_hash(),
        _ => seq.hashes()[index - 1],
    };
    let keys = match deferred.active {
        true => &mut deferred.keys,
        false => {
            keys.clear();
            keys
        }
    };
    let pieces = piece_keys(parent, tokens, piece).take(per_block);
    keys.extend(pieces.map(|key| group_key(key, group)));
    match deferred.active {
        true => deferred.blocks.push((block, key, per_block)),
        false => block_pool.register_sub_blocks(block, keys),
    }
}

/// Plans the copy of each group's partial-hit source (`sources[group]`, held since the
/// lookup so that no allocation in between could take it) into block `index` of the new
/// sequence's table, then lets the sources go.
pub(super) fn copy_partial_hit(seq: &Sequence, tiers: &mut Tiers, sources: &[u32], index: usize) {
    for (table, &source) in seq.tables().iter().zip(sources) {
        let copy = BlockMove::new(MoveKind::Copy, source, table.blocks()[index]);
        tiers.pending_moves.push(copy);
        // Read by the move just planned: any later writer of it is planned after it.
        tiers.block_pool.release(source);
    }
}

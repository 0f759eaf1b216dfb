//! Every way a sequence changes, named for what it is. The sequence table records a
//! sequence at its first change in a transaction (`record`); two kinds of change are
//! recorded as they happen, since that record cannot undo them: a block replaced in place
//! (`GroupTable::set`, `Sequence::set_state`) and emptied lists (`Sequence::clear`,
//! `Sequence::stop_naming`).

use super::record::{SequenceLog, STATE_LIST};
use super::sequence::{GroupTable, Sequence};
use crate::alloc::{BlockHash, NULL_BLOCK};
use crate::kv_cache::retention::{RetentionConfig, NO_RETENTION};
use crate::kv_cache::windows::WindowBounds;

impl GroupTable {
    /// Replaces block `index` of group `group` of the sequence in slab `slab` by `block`,
    /// recording the old one in `log`.
    pub(in crate::kv_cache) fn set(
        &mut self,
        index: usize,
        block: u32,
        log: &mut SequenceLog,
        at: (u32, u32),
    ) {
        let old = std::mem::replace(&mut self.blocks.0[index], block);
        log.replaced(at.0, at.1, index, old);
    }

    /// Stamps the list as laid out anew (see `layout`).
    #[inline]
    pub(in crate::kv_cache) fn stamp_layout(&mut self, version: u64) {
        self.layout = version;
    }

    /// Adds an entry whose block comes later, as its tokens are computed (a windowed
    /// group's prompt).
    #[inline]
    pub(in crate::kv_cache) fn push_pending(&mut self) {
        self.blocks.push(NULL_BLOCK);
    }

    /// Grows the list to `len` entries whose blocks come later (see `push_pending`).
    pub(in crate::kv_cache) fn pend_up_to(&mut self, len: usize) {
        self.blocks.grow(len, NULL_BLOCK);
    }

    /// Adds a prefix hit's block at the end, or the null block where the group's window
    /// had released it; `hits_taken` ends the hits.
    pub(in crate::kv_cache) fn push_hit(&mut self, block: u32) {
        if block == NULL_BLOCK {
            self.released += 1;
        }
        self.blocks.push(block);
    }

    /// Every entry so far is a held (or released) hit.
    pub(in crate::kv_cache) fn hits_taken(&mut self) {
        self.allocated = self.blocks.len();
    }

    /// Takes `parent`'s list (a fork: the caller shares its blocks).
    pub(in crate::kv_cache) fn copy_from(&mut self, parent: &GroupTable) {
        self.blocks.extend_from_slice(&parent.blocks);
        (self.released, self.allocated) = (parent.released, parent.allocated);
    }

    /// Entries before `from` are released: the caller turned the held ones null (`set`).
    pub(in crate::kv_cache) fn release_before(&mut self, from: usize) {
        debug_assert!(self.blocks[self.released..from.min(self.allocated)]
            .iter()
            .all(|&block| block == NULL_BLOCK));
        self.released = from;
        self.allocated = self.allocated.max(from);
    }

    /// Puts `block` in the first entry still to come.
    pub(in crate::kv_cache) fn fill_next(
        &mut self,
        block: u32,
        log: &mut SequenceLog,
        at: (u32, u32),
    ) {
        self.set(self.allocated, block, log, at);
        self.allocated += 1;
    }
}

impl Sequence {
    /// Empties an ended sequence's slab, keeping its vectors' capacity; `log` keeps what
    /// its lists held for a transaction's rollback.
    pub(in crate::kv_cache) fn clear(&mut self, log: &mut SequenceLog, slab: u32) {
        log.cleared(slab, self);
        self.live = false;
        self.swapped = false;
        self.num_tokens = 0;
        for table in &mut self.tables {
            table.reset(0);
        }
        self.state.clear();
        self.kv_reach = 0;
        self.prompt_blocks = 0;
        self.partial_tokens.clear();
        self.hashes.clear();
        self.token_ids.clear();
        if let Some(retention) = self.retention.as_mut() {
            RetentionConfig::clone_from(retention, &NO_RETENTION);
        }
    }

    /// Replaces state block `index` by `block`, recording the old one in `log`.
    pub(in crate::kv_cache) fn set_state(
        &mut self,
        index: usize,
        block: u32,
        log: &mut SequenceLog,
        slab: u32,
    ) {
        let old = std::mem::replace(&mut self.state[index], block);
        log.replaced(slab, STATE_LIST, index, old);
    }

    /// Stops naming the sequence's blocks (an append without token ids): forgets its token ids
    /// and hashes, `log` keeping them for a rollback.
    pub(in crate::kv_cache) fn stop_naming(&mut self, log: &mut SequenceLog, slab: u32) {
        log.cleared(slab, self);
        self.hashable = false;
        self.partial_tokens.clear();
        self.hashes.clear();
        self.token_ids.clear();
    }

    /// Makes the vacant slab's sequence `seq_id`, of `num_tokens` tokens whose blocks the
    /// admission adds, unnamed until `name_tokens`.
    pub(in crate::kv_cache) fn admit(&mut self, seq_id: u64, num_tokens: usize, version: u64) {
        debug_assert!(!self.live);
        (self.seq_id, self.live, self.swapped) = (seq_id, true, false);
        (self.num_tokens, self.version) = (num_tokens, version);
        self.hashable = false;
        self.partial_tokens.clear();
        self.hashes.clear();
        self.token_ids.clear();
    }

    /// What an admission found: `computed` tokens and `registered` blocks served by hits,
    /// `kv_reach` blocks of K/V cached, and the prompt's full blocks before its last token.
    pub(in crate::kv_cache) fn admitted_at(
        &mut self,
        (computed, registered): (usize, usize),
        (kv_reach, prompt_blocks): (u32, u32),
    ) {
        (self.num_computed, self.num_registered) = (computed, registered);
        (self.kv_reach, self.prompt_blocks) = (kv_reach, prompt_blocks);
    }

    /// Names the new sequence's blocks: the hash chain from `root_hash`, its full blocks'
    /// `hashes`, the `partial` ids of its last block and, to keep, every id.
    pub(in crate::kv_cache) fn name_tokens(
        &mut self,
        root_hash: BlockHash,
        (hashes, partial): (&[BlockHash], &[u32]),
        all_ids: Option<&[u32]>,
    ) {
        self.hashable = true;
        self.root_hash = root_hash;
        self.hashes.extend_from_slice(hashes);
        self.partial_tokens.extend_from_slice(partial);
        self.token_ids
            .extend_from_slice(all_ids.unwrap_or_default());
    }

    /// Makes the vacant slab's sequence `seq_id` a copy of `parent`, sharing its blocks
    /// (the caller takes their references) but not its states.
    pub(in crate::kv_cache) fn fork_of(&mut self, parent: &Sequence, seq_id: u64, version: u64) {
        debug_assert!(!self.live);
        (self.seq_id, self.live, self.swapped) = (seq_id, true, false);
        (self.num_tokens, self.version) = (parent.num_tokens, version);
        (self.hashable, self.root_hash) = (parent.hashable, parent.root_hash);
        (self.num_computed, self.num_registered) = (parent.num_computed, parent.num_registered);
        (self.kv_reach, self.prompt_blocks) = (parent.kv_reach, parent.prompt_blocks);
        for (table, parent_table) in self.tables.iter_mut().zip(&parent.tables) {
            table.copy_from(parent_table);
        }
        for (list, parent_list) in [
            (&mut self.partial_tokens, &parent.partial_tokens),
            (&mut self.token_ids, &parent.token_ids),
        ] {
            list.clear();
            list.extend_from_slice(parent_list);
        }
        self.hashes.clear();
        self.hashes.extend_from_slice(&parent.hashes);
        self.retention.clone_from(&parent.retention);
    }

    /// The group tables, whose entries change only through `GroupTable`'s own methods.
    #[inline]
    pub(in crate::kv_cache) fn tables_mut(&mut self) -> &mut [GroupTable] {
        &mut self.tables
    }

    /// Adds a state block (at admission or fork).
    pub(in crate::kv_cache) fn add_state_block(&mut self, block: u32) {
        self.state.push(block);
    }

    /// Keeps appended token `id` (only while the sequence is named): it extends the last
    /// block's ids, and a full block gets its hash.
    #[inline]
    pub(in crate::kv_cache) fn push_token_id(
        &mut self,
        id: u32,
        keep_ids: bool,
        block_size: usize,
    ) {
        self.partial_tokens.push(id);
        if keep_ids {
            self.token_ids.push(id);
        }
        if self.partial_tokens.len() == block_size {
            let parent = self.hashes.last().copied().unwrap_or(self.root_hash);
            self.hashes.push(parent.chain(&self.partial_tokens));
            self.partial_tokens.clear();
        }
    }

    /// `n` tokens were appended (their blocks and ids added already).
    #[inline]
    pub(in crate::kv_cache) fn grew(&mut self, n: usize, version: u64) {
        self.num_tokens += n;
        self.version = version;
    }

    /// A new version: the sequence's block tables changed.
    #[inline]
    pub(in crate::kv_cache) fn stamp(&mut self, version: u64) {
        self.version = version;
    }

    /// The caller says its first `num_tokens` tokens are computed (never fewer than before).
    #[inline]
    pub(in crate::kv_cache) fn computed_up_to(&mut self, num_tokens: usize) {
        self.num_computed = self.num_computed.max(num_tokens);
    }

    /// Its first `num_blocks` blocks were offered to the prefix cache.
    #[inline]
    pub(in crate::kv_cache) fn registered_up_to(&mut self, num_blocks: usize) {
        self.num_registered = self.num_registered.max(num_blocks);
    }

    /// Forgets the computed tokens past its last full block (a partial hit given up).
    pub(in crate::kv_cache) fn computed_to_block_start(&mut self, block_size: usize) {
        self.num_computed = self.num_computed / block_size * block_size;
    }

    /// Its blocks moved to the host tier (`on_host`) or back: none is offered to the device's
    /// prefix cache until computed there again.
    pub(in crate::kv_cache) fn moved_tier(&mut self, on_host: bool) {
        self.swapped = on_host;
        self.num_registered = 0;
    }

    #[inline]
    pub(in crate::kv_cache) fn set_window_bounds(&mut self, bounds: WindowBounds) {
        self.window_bounds = bounds;
    }

    /// Keeps `config` as what the request asks the prefix cache to keep, its decode start
    /// no later than the sequence's end (the slab's box is reused when it has one).
    pub(in crate::kv_cache) fn keep_retention(&mut self, config: &RetentionConfig) {
        let decode_from = config.decode_from.min(self.num_tokens);
        match self.retention.as_deref_mut() {
            Some(kept) => RetentionConfig::clone_from(kept, config),
            None => self.retention = Some(Box::new(config.clone())),
        }
        if let Some(kept) = self.retention.as_deref_mut() {
            kept.decode_from = decode_from;
        }
    }
}

//! One sequence's state in the cache's slab.

use std::ops::Range;

use crate::alloc::BlockHash;
use crate::kv_cache::retention::RetentionConfig;
use crate::kv_cache::windows::WindowBounds;
use crate::kv_cache::{KvEventLog, Medium};

/// Bytes of one sequence's fixed state (for memory accounting).
pub const SEQUENCE_BYTES: usize = std::mem::size_of::<Sequence>();

#[derive(Debug, Clone, Default)]
pub(in crate::kv_cache) struct Sequence {
    pub(super) seq_id: u64,
    pub(super) live: bool,
    pub(super) num_tokens: usize,
    /// One block list per KV-cache group, all as long as the token count needs: device
    /// blocks, or host blocks while `swapped`.
    pub(super) tables: Vec<GroupTable>,
    /// The recurrent layers' state blocks (`KvCache::num_state_blocks` of them, device blocks
    /// or host blocks while `swapped`); never shared.
    pub(super) state: Vec<u32>,
    /// Swapped out to the host tier: no appends, forks or kernel-facing tables until swapped in.
    pub(super) swapped: bool,
    /// Whether every token id of the sequence is known, so its full blocks can be named.
    pub(super) hashable: bool,
    /// Root of the hash chain (from the cache salt).
    pub(super) root_hash: BlockHash,
    /// Hash of every full block, in order (only while `hashable`).
    pub(super) hashes: Vec<BlockHash>,
    /// Token ids of the partly filled last block (only while `hashable`).
    pub(super) partial_tokens: Vec<u32>,
    /// Every token id (only while `hashable` and KV events are recorded: a stored block's
    /// event carries its ids).
    pub(super) token_ids: Vec<u32>,
    /// Leading tokens whose K/V the caller said are computed (`mark_computed`); only blocks
    /// within them may join the prefix cache.
    pub(super) num_computed: usize,
    /// Leading blocks already offered to the prefix cache (hits, or registered).
    pub(super) num_registered: usize,
    /// Leading blocks whose K/V the admission found cached, whether or not a state
    /// checkpoint let it use them: where the prompt left what earlier ones computed, and so
    /// where a checkpoint serves the next one that shares them (see `state_checkpoints`).
    pub(super) kv_reach: u32,
    /// Full blocks before the last token of what the admission was given: where the states
    /// a next prompt sharing it all would resume from lie.
    pub(super) prompt_blocks: u32,
    /// When `mark_computed` next has windowed groups' blocks to release or allocate.
    pub(super) window_bounds: WindowBounds,
    /// Changes whenever a block list or the length changes (and when a batch names the
    /// sequence); unique across the cache's life.
    pub(super) version: u64,
    /// What the request asked the prefix cache to keep of its blocks (`None`: nothing; the
    /// box stays with the slab for the next sequence).
    pub(super) retention: Option<Box<RetentionConfig>>,
}

/// What the rest of the cache reads of a sequence. It changes one only through the methods
/// that say what the change is (`changes`), which the sequence table records.
impl Sequence {
    #[inline]
    pub(in crate::kv_cache) fn seq_id(&self) -> u64 {
        self.seq_id
    }

    /// Whether the slab holds a sequence (a vacant one holds none).
    #[inline]
    pub(in crate::kv_cache) fn is_live(&self) -> bool {
        self.live
    }

    #[inline]
    pub(in crate::kv_cache) fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    #[inline]
    pub(in crate::kv_cache) fn tables(&self) -> &[GroupTable] {
        &self.tables
    }

    #[inline]
    pub(in crate::kv_cache) fn state(&self) -> &[u32] {
        &self.state
    }

    #[inline]
    pub(in crate::kv_cache) fn is_swapped(&self) -> bool {
        self.swapped
    }

    #[inline]
    pub(in crate::kv_cache) fn is_hashable(&self) -> bool {
        self.hashable
    }

    #[inline]
    pub(in crate::kv_cache) fn root_hash(&self) -> BlockHash {
        self.root_hash
    }

    #[inline]
    pub(in crate::kv_cache) fn hashes(&self) -> &[BlockHash] {
        &self.hashes
    }

    #[inline]
    pub(in crate::kv_cache) fn partial_tokens(&self) -> &[u32] {
        &self.partial_tokens
    }

    #[inline]
    pub(in crate::kv_cache) fn token_ids(&self) -> &[u32] {
        &self.token_ids
    }

    #[inline]
    pub(in crate::kv_cache) fn num_computed(&self) -> usize {
        self.num_computed
    }

    #[inline]
    pub(in crate::kv_cache) fn num_registered(&self) -> usize {
        self.num_registered
    }

    #[inline]
    pub(in crate::kv_cache) fn kv_reach(&self) -> u32 {
        self.kv_reach
    }

    #[inline]
    pub(in crate::kv_cache) fn prompt_blocks(&self) -> u32 {
        self.prompt_blocks
    }

    #[inline]
    pub(in crate::kv_cache) fn window_bounds(&self) -> WindowBounds {
        self.window_bounds
    }

    #[inline]
    pub(in crate::kv_cache) fn version(&self) -> u64 {
        self.version
    }

    #[inline]
    pub(in crate::kv_cache) fn retention(&self) -> Option<&RetentionConfig> {
        self.retention.as_deref()
    }
}

/// A sequence's fields that are no vector, as a transaction found them.
#[derive(Clone, Copy)]
pub(in crate::kv_cache) struct Scalars {
    seq_id: u64,
    live: bool,
    num_tokens: usize,
    swapped: bool,
    hashable: bool,
    root_hash: BlockHash,
    num_computed: usize,
    num_registered: usize,
    kv_reach: u32,
    prompt_blocks: u32,
    window_bounds: WindowBounds,
    version: u64,
}

/// A sequence's blocks in one group.
///
/// `blocks` is as long as the token count needs; entries before `released` are the null block
/// (a window or chunk left them behind, or a prefix hit never needed them), entries from
/// `allocated` on are the null block too (a windowed group admitted by the scheduler takes a
/// prompt's blocks only as it is computed); the ones between are held.
#[derive(Debug, Clone, Default)]
pub(in crate::kv_cache) struct GroupTable {
    pub(super) blocks: BlockList,
    pub(super) released: usize,
    pub(super) allocated: usize,
    /// Changes whenever a block already in the list is replaced (allocation, fork,
    /// copy-on-write, swap, release), but not when the list only grows: a table that holds
    /// the list's first k blocks under this value still holds them.
    pub(super) layout: u64,
}

impl GroupTable {
    /// Starts a new list stamped `version` (a transaction recorded what it held, see
    /// `Sequence::clear`).
    pub(in crate::kv_cache) fn reset(&mut self, version: u64) {
        self.blocks.0.clear();
        self.released = 0;
        self.allocated = 0;
        self.layout = version;
    }

    #[inline]
    pub(in crate::kv_cache) fn blocks(&self) -> &BlockList {
        &self.blocks
    }

    /// Entries before this are null: released, or never needed.
    #[inline]
    pub(in crate::kv_cache) fn released(&self) -> usize {
        self.released
    }

    /// Entries from this on are null: a windowed group's prompt blocks still to come.
    #[inline]
    pub(in crate::kv_cache) fn allocated(&self) -> usize {
        self.allocated
    }

    #[inline]
    pub(in crate::kv_cache) fn layout(&self) -> u64 {
        self.layout
    }

    /// The blocks held (neither released nor still to be allocated).
    pub(in crate::kv_cache) fn live(&self) -> &[u32] {
        &self.blocks[self.released..self.allocated]
    }

    /// Whether every block up to the last is allocated (no prompt blocks still to come).
    pub(in crate::kv_cache) fn complete(&self) -> bool {
        self.allocated == self.blocks.len()
    }

    /// Adds a held block at the end.
    pub(in crate::kv_cache) fn push(&mut self, block: u32) {
        debug_assert!(self.complete());
        self.blocks.push(block);
        self.allocated += 1;
    }
}

/// A group's block list: it grows freely, but an entry is replaced only through
/// `GroupTable::set`, which records the old one for a transaction's rollback.
#[derive(Debug, Clone, Default)]
pub(in crate::kv_cache) struct BlockList(pub(super) Vec<u32>);

impl BlockList {
    pub(in crate::kv_cache) fn push(&mut self, block: u32) {
        self.0.push(block);
    }

    pub(in crate::kv_cache) fn extend_from_slice(&mut self, blocks: &[u32]) {
        self.0.extend_from_slice(blocks);
    }

    /// Grows the list to `len` with `block` (a list never shrinks but by `reset`).
    pub(in crate::kv_cache) fn grow(&mut self, len: usize, block: u32) {
        debug_assert!(len >= self.0.len());
        self.0.resize(len, block);
    }
}

impl std::ops::Deref for BlockList {
    type Target = [u32];

    fn deref(&self) -> &[u32] {
        &self.0
    }
}

impl<'a> IntoIterator for &'a BlockList {
    type Item = &'a u32;
    type IntoIter = std::slice::Iter<'a, u32>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

impl Sequence {
    /// The block list of group 0 (the only group of a cache without layer types).
    pub(in crate::kv_cache) fn blocks(&self) -> &[u32] {
        &self.tables[0].blocks
    }

    /// Blocks the sequence holds per group: the length of every list.
    pub(in crate::kv_cache) fn num_blocks(&self) -> usize {
        self.tables[0].blocks.len()
    }

    /// Every block the sequence holds, in any group, its state's too (null blocks skipped).
    pub(in crate::kv_cache) fn held_blocks(&self) -> impl Iterator<Item = u32> + '_ {
        self.tables
            .iter()
            .flat_map(|table| table.live().iter().copied())
            .chain(self.state.iter().copied())
    }

    /// Logs that full blocks `blocks` of `group` joined the device's prefix cache.
    pub(in crate::kv_cache) fn log_stored(
        &self,
        events: &mut KvEventLog,
        group: usize,
        blocks: Range<usize>,
        block_size: usize,
    ) {
        let tokens = self
            .token_ids
            .get(blocks.start * block_size..blocks.end * block_size)
            .unwrap_or_default();
        let parent = blocks
            .start
            .checked_sub(1)
            .map(|parent| self.hashes[parent]);
        let hashes = &self.hashes[blocks];
        events.stored_run(
            Medium::Device,
            group as u32,
            parent,
            self.root_hash,
            hashes,
            tokens,
        );
    }

    /// What a stored event says of full block `index`: its parent's hash (`None` for the
    /// first block), its own hash and its token ids (empty unless KV events keep them).
    pub(in crate::kv_cache) fn named_block(
        &self,
        index: usize,
        block_size: usize,
    ) -> (Option<BlockHash>, BlockHash, &[u32]) {
        let tokens = self
            .token_ids
            .get(index * block_size..(index + 1) * block_size)
            .unwrap_or_default();
        let parent = index.checked_sub(1).map(|parent| self.hashes[parent]);
        (parent, self.hashes[index], tokens)
    }
}

impl Sequence {
    pub(in crate::kv_cache) fn scalars(&self) -> Scalars {
        Scalars {
            seq_id: self.seq_id,
            live: self.live,
            num_tokens: self.num_tokens,
            swapped: self.swapped,
            hashable: self.hashable,
            root_hash: self.root_hash,
            num_computed: self.num_computed,
            num_registered: self.num_registered,
            kv_reach: self.kv_reach,
            prompt_blocks: self.prompt_blocks,
            window_bounds: self.window_bounds,
            version: self.version,
        }
    }

    pub(in crate::kv_cache) fn set_scalars(&mut self, scalars: Scalars) {
        let Scalars {
            seq_id,
            live,
            num_tokens,
            swapped,
            hashable,
            root_hash,
            num_computed,
            num_registered,
            kv_reach,
            prompt_blocks,
            window_bounds,
            version,
        } = scalars;
        (self.seq_id, self.live, self.num_tokens) = (seq_id, live, num_tokens);
        (self.swapped, self.hashable, self.root_hash) = (swapped, hashable, root_hash);
        (self.num_computed, self.num_registered) = (num_computed, num_registered);
        (self.kv_reach, self.prompt_blocks) = (kv_reach, prompt_blocks);
        (self.window_bounds, self.version) = (window_bounds, version);
    }
}

//! Sequences mapped onto blocks: allocation with prefix reuse, batched append, fork with
//! copy-on-write, and the block tables and slot mappings that paged-attention kernels read.
//!
//! Every public call checks all of its arguments and its block budget before it changes
//! anything, so a call that fails leaves the cache exactly as it was. Sequences live in a slab
//! whose vectors keep their capacity when a sequence ends, so steady-state churn allocates
//! nothing.

use hashbrown::HashMap;

use crate::block_hash::BlockHash;
use crate::block_move::{BlockMove, MoveKind};
use crate::block_pool::{BlockPool, PrefixCacheCounters, NULL_BLOCK};
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

/// Bytes of one sequence's fixed state (for memory accounting).
pub const SEQUENCE_BYTES: usize = std::mem::size_of::<Sequence>();

#[derive(Debug, Clone, Default)]
pub(crate) struct Sequence {
    pub(crate) seq_id: u64,
    pub(crate) live: bool,
    pub(crate) num_tokens: usize,
    /// Device blocks, or host blocks while `swapped`.
    pub(crate) blocks: Vec<u32>,
    /// Swapped out to the host tier: no appends, forks or kernel-facing tables until swapped in.
    pub(crate) swapped: bool,
    /// Whether every token id of the sequence is known, so its full blocks can be named.
    pub(crate) hashable: bool,
    /// Root of the hash chain (from the cache salt).
    root_hash: BlockHash,
    /// Hash of every full block, in order (only while `hashable`).
    pub(crate) hashes: Vec<BlockHash>,
    /// Token ids of the partly filled last block (only while `hashable`).
    partial_tokens: Vec<u32>,
    /// Leading tokens whose K/V the caller said are computed (`mark_computed`); only blocks
    /// within them may join the prefix cache.
    pub(crate) num_computed: usize,
    /// Leading blocks already offered to the prefix cache (hits, or registered).
    pub(crate) num_registered: usize,
    /// Changes whenever the block list or length changes (and when a batch names the
    /// sequence); unique across the cache's life.
    pub(crate) version: u64,
    /// Changes whenever a block already in the list is replaced (allocation, fork,
    /// copy-on-write, swap), but not when the list only grows: a table that holds the
    /// list's first k blocks under this value still holds them.
    layout: u64,
}

/// Counters and sizes reported by [`KvCache::stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct KvCacheStats {
    pub num_blocks: usize,
    pub block_size: usize,
    pub blocks_used: usize,
    pub blocks_free: usize,
    pub blocks_cached: usize,
    pub num_sequences: usize,
    pub num_tokens: usize,
    pub allocated_slots: usize,
    pub used_slots: usize,
    pub fragmentation: f64,
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub prefix_cache_query_tokens: u64,
    pub prefix_cache_hit_tokens: u64,
    pub evictions: u64,
    pub pending_copies: usize,
    pub bytes_per_block: usize,
    /// Usable host blocks (0 without a host tier).
    pub host_blocks: usize,
    pub host_blocks_used: usize,
    pub num_swapped: usize,
}

#[derive(Debug, Clone)]
pub struct KvCache {
    pub(crate) block_pool: BlockPool,
    /// Host tier for swapped-out sequences (block 0 unused there too).
    pub(crate) host_pool: Option<BlockPool>,
    layout: KvLayout,
    bytes_per_block: usize,
    pub(crate) sequences: Vec<Sequence>,
    vacant: Vec<u32>,
    pub(crate) index: HashMap<u64, u32>,
    /// Block moves decided but not yet executed, in the order they must run.
    pub(crate) pending_moves: Vec<BlockMove>,
    /// Set once any fork happened: only then can a shared, partly filled block (and so a
    /// copy-on-write) appear.
    pub(crate) has_forked: bool,
    next_version: u64,
    query_tokens: u64,
    hit_tokens: u64,
    // Reused per call so that hot paths allocate nothing.
    scratch_hashes: Vec<BlockHash>,
    scratch_blocks: Vec<u32>,
    scratch_slabs: Vec<u32>,
    /// Source block → destination block while a swap is planned; `NO_BLOCK` elsewhere.
    scratch_moves: Vec<u32>,
}

const NO_BLOCK: u32 = u32::MAX;

impl KvCache {
    pub fn new(
        num_blocks: usize,
        block_size: usize,
        layout: KvLayout,
        enable_prefix_caching: bool,
    ) -> CoreResult<Self> {
        layout.validate()?;
        let block_pool = BlockPool::new(num_blocks, block_size, enable_prefix_caching)?;
        let bytes_per_block = layout.bytes_per_block(block_size).ok_or_else(|| {
            CoreError::invalid(
                "bytes per block (2 × layers × block_size × heads × head_dim × itemsize) overflows",
            )
        })?;
        Ok(KvCache {
            block_pool,
            host_pool: None,
            layout,
            bytes_per_block,
            sequences: Vec::new(),
            vacant: Vec::new(),
            index: HashMap::new(),
            pending_moves: Vec::new(),
            has_forked: false,
            next_version: 1,
            query_tokens: 0,
            hit_tokens: 0,
            scratch_hashes: Vec::new(),
            scratch_blocks: Vec::new(),
            scratch_slabs: Vec::new(),
            scratch_moves: Vec::new(),
        })
    }

    #[inline]
    pub fn block_size(&self) -> usize {
        self.block_pool.block_size()
    }

    pub fn num_blocks(&self) -> usize {
        self.block_pool.num_blocks()
    }

    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    pub fn bytes_per_block(&self) -> usize {
        self.bytes_per_block
    }

    pub fn enable_prefix_caching(&self) -> bool {
        self.block_pool.enable_prefix_caching()
    }

    /// Whether any fork happened (only then can a copy-on-write be decided).
    pub fn has_forked(&self) -> bool {
        self.has_forked
    }

    /// Blocks an allocation can take now (free plus evictable cached blocks).
    pub fn num_free_blocks(&self) -> usize {
        self.block_pool.num_free()
    }

    pub fn num_sequences(&self) -> usize {
        self.index.len()
    }

    pub fn contains(&self, seq_id: u64) -> bool {
        self.index.contains_key(&seq_id)
    }

    /// Most tokens one sequence can ever hold: every block but the null block.
    pub fn max_seq_tokens(&self) -> usize {
        (self.num_blocks() - 1) * self.block_size()
    }

    pub fn block_pool(&self) -> &BlockPool {
        &self.block_pool
    }

    /// Ids of the live sequences, in no particular order.
    pub fn seq_ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.index.keys().copied()
    }

    #[inline]
    pub(crate) fn slab_of(&self, seq_id: u64) -> CoreResult<u32> {
        self.index
            .get(&seq_id)
            .copied()
            .ok_or(CoreError::UnknownSequence(seq_id))
    }

    #[inline]
    fn sequence(&self, seq_id: u64) -> CoreResult<&Sequence> {
        Ok(&self.sequences[self.slab_of(seq_id)? as usize])
    }

    /// A sequence whose blocks are on the device (not swapped out).
    #[inline]
    fn device_sequence(&self, seq_id: u64) -> CoreResult<&Sequence> {
        let seq = self.sequence(seq_id)?;
        if seq.swapped {
            return Err(swapped_out(seq_id));
        }
        Ok(seq)
    }

    pub fn is_swapped(&self, seq_id: u64) -> CoreResult<bool> {
        Ok(self.sequence(seq_id)?.swapped)
    }

    pub fn seq_len(&self, seq_id: u64) -> CoreResult<usize> {
        Ok(self.sequence(seq_id)?.num_tokens)
    }

    /// The blocks of one sequence, in token order (host blocks while it is swapped out).
    pub fn block_table(&self, seq_id: u64) -> CoreResult<&[u32]> {
        Ok(&self.sequence(seq_id)?.blocks)
    }

    fn check_token_count(&self, count: usize, what: &str) -> CoreResult<()> {
        if count == 0 {
            return Err(CoreError::invalid(format!(
                "{what} must be at least 1, got 0"
            )));
        }
        if count > self.max_seq_tokens() {
            return Err(CoreError::invalid(format!(
                "{what} = {count} can never fit: the pool holds at most {} tokens per sequence \
                 ({} usable blocks of {})",
                self.max_seq_tokens(),
                self.num_blocks() - 1,
                self.block_size()
            )));
        }
        Ok(())
    }

    /// Looks up the cached prefix of `tokens`: fills `scratch_hashes` with the hash of every
    /// full block and `scratch_blocks` with the leading cache hits. Returns (queries, hits in
    /// the free queue). Changes nothing else.
    fn match_prefix(&mut self, tokens: Tokens<'_>, cache_salt: Option<&[u8]>) -> (usize, usize) {
        self.scratch_hashes.clear();
        self.scratch_blocks.clear();
        let Tokens::Ids(ids) = tokens else {
            return (0, 0);
        };
        if !self.block_pool.enable_prefix_caching() {
            return (0, 0);
        }
        let block_size = self.block_size();
        // As in vLLM, the last prompt token is always computed, so a prompt that is an exact
        // multiple of the block size does not get its last block from the cache.
        let queries = (ids.len() - 1) / block_size;
        let mut parent = BlockHash::root(cache_salt);
        let mut hits_queued = 0;
        let mut matching = true;
        for chunk in ids.chunks_exact(block_size) {
            parent = parent.chain(chunk);
            self.scratch_hashes.push(parent);
            if matching && self.scratch_blocks.len() < queries {
                match self.block_pool.lookup(parent) {
                    Some(block) => {
                        hits_queued += usize::from(self.block_pool.ref_count(block) == 0);
                        self.scratch_blocks.push(block);
                    }
                    None => matching = false,
                }
            }
        }
        (queries, hits_queued)
    }

    /// Whether `alloc_sequence` would succeed now for a new sequence with these tokens.
    pub fn can_allocate(
        &mut self,
        tokens: Tokens<'_>,
        cache_salt: Option<&[u8]>,
    ) -> CoreResult<bool> {
        Ok(self.blocks_to_allocate(tokens, cache_salt)? <= self.block_pool.num_free())
    }

    /// How many blocks of the free queue `alloc_sequence` would take now (fresh blocks plus
    /// cached hits that no sequence uses).
    pub fn blocks_to_allocate(
        &mut self,
        tokens: Tokens<'_>,
        cache_salt: Option<&[u8]>,
    ) -> CoreResult<usize> {
        self.check_token_count(tokens.len(), "token count")?;
        let (_, hits_queued) = self.match_prefix(tokens, cache_salt);
        let fresh = tokens.len().div_ceil(self.block_size()) - self.scratch_blocks.len();
        Ok(fresh + hits_queued)
    }

    /// How many blocks appending `n` tokens to one sequence would take now.
    pub fn blocks_to_append(&mut self, seq_id: u64, n: usize) -> CoreResult<usize> {
        let slab = self.slab_of(seq_id)?;
        self.append_need(&[slab], n)
    }

    /// Gives a new sequence the blocks for `tokens`, reusing cached full blocks when token ids
    /// are given. Returns how many leading tokens are already in the cache.
    pub fn alloc_sequence(
        &mut self,
        seq_id: u64,
        tokens: Tokens<'_>,
        cache_salt: Option<&[u8]>,
    ) -> CoreResult<usize> {
        if self.index.contains_key(&seq_id) {
            return Err(CoreError::DuplicateSequence(seq_id));
        }
        let num_tokens = tokens.len();
        self.check_token_count(num_tokens, "token count")?;
        let block_size = self.block_size();
        let num_blocks = num_tokens.div_ceil(block_size);
        let (queries, hits_queued) = self.match_prefix(tokens, cache_salt);
        let hits = self.scratch_blocks.len();
        let needed = num_blocks - hits + hits_queued;
        if needed > self.block_pool.num_free() {
            return Err(CoreError::OutOfBlocks {
                needed,
                available: self.block_pool.num_free(),
            });
        }

        // Checked: from here on nothing can fail.
        if let Tokens::Ids(_) = tokens {
            self.block_pool.record_lookups(queries, hits);
            self.query_tokens += (queries * block_size) as u64;
            self.hit_tokens += (hits * block_size) as u64;
        }
        let slab = self.vacant_slab();
        let version = self.bump_version();
        let KvCache {
            sequences,
            block_pool,
            scratch_hashes,
            scratch_blocks,
            ..
        } = self;
        let seq = &mut sequences[slab as usize];
        seq.seq_id = seq_id;
        seq.live = true;
        seq.swapped = false;
        seq.num_tokens = num_tokens;
        seq.version = version;
        seq.layout = version;
        seq.blocks.clear();
        for &block in scratch_blocks.iter() {
            block_pool.take_hit(block);
            seq.blocks.push(block);
        }
        for _ in hits..num_blocks {
            seq.blocks.push(allocate_checked(block_pool)?);
        }
        seq.partial_tokens.clear();
        seq.hashes.clear();
        // Hits are computed already; the rest joins the prefix cache once `mark_computed`
        // says its K/V is written.
        seq.num_computed = hits * block_size;
        seq.num_registered = hits;
        match tokens {
            Tokens::Ids(ids) if block_pool.enable_prefix_caching() => {
                seq.hashable = true;
                seq.root_hash = BlockHash::root(cache_salt);
                seq.hashes.extend_from_slice(scratch_hashes);
                seq.partial_tokens
                    .extend_from_slice(&ids[scratch_hashes.len() * block_size..]);
            }
            _ => seq.hashable = false,
        }
        self.index.insert(seq_id, slab);
        Ok(hits * block_size)
    }

    fn vacant_slab(&mut self) -> u32 {
        self.vacant.pop().unwrap_or_else(|| {
            self.sequences.push(Sequence::default());
            (self.sequences.len() - 1) as u32
        })
    }

    fn bump_version(&mut self) -> u64 {
        let version = self.next_version;
        self.next_version += 1;
        version
    }

    /// Resolves a batch of ids into `scratch_slabs`, rejecting unknown ids and repeats.
    ///
    /// Each named sequence gets a fresh version; one whose version is already from this
    /// batch was named before. (A failed batch thus leaves new versions behind: that only
    /// makes a batch table rewrite those rows, and changes nothing observable.)
    fn resolve_batch(&mut self, seq_ids: &[u64]) -> CoreResult<()> {
        let batch_start = self.next_version;
        self.scratch_slabs.clear();
        for &seq_id in seq_ids {
            let slab = self.slab_of(seq_id)?;
            if self.sequences[slab as usize].version >= batch_start {
                return Err(CoreError::invalid(format!(
                    "sequence {seq_id} appears twice in the batch"
                )));
            }
            self.sequences[slab as usize].version = self.bump_version();
            self.scratch_slabs.push(slab);
        }
        Ok(())
    }

    /// Checks that appending `n` tokens to each sequence in `slabs` (all distinct) fits, and
    /// fails with `OutOfBlocks` otherwise.
    pub(crate) fn check_append_budget(&mut self, slabs: &[u32], n: usize) -> CoreResult<()> {
        let needed = self.append_need(slabs, n)?;
        let available = self.block_pool.num_free();
        if needed > available {
            return Err(CoreError::OutOfBlocks { needed, available });
        }
        Ok(())
    }

    /// Blocks that appending `n` tokens to each sequence in `slabs` (all distinct) takes: the
    /// blocks the sequences grow by, plus the copy-on-write replacements of shared, partly
    /// filled last blocks. When every holder of such a block appends in this batch, the last
    /// one to do so keeps the block, so a block held by k sequences costs k - 1 copies, not k.
    fn append_need(&mut self, slabs: &[u32], n: usize) -> CoreResult<usize> {
        let block_size = self.block_size();
        let mut needed = 0;
        self.scratch_blocks.clear();
        for &slab in slabs {
            let seq = &self.sequences[slab as usize];
            if seq.swapped {
                return Err(swapped_out(seq.seq_id));
            }
            let total = seq.num_tokens + n;
            if total > self.max_seq_tokens() {
                return Err(CoreError::invalid(format!(
                    "sequence {} would hold {total} tokens; the pool holds at most {} per sequence",
                    seq.seq_id,
                    self.max_seq_tokens()
                )));
            }
            needed += total.div_ceil(block_size) - seq.blocks.len();
            if let (true, Some(&last)) = (seq.num_tokens % block_size != 0, seq.blocks.last()) {
                if self.block_pool.ref_count(last) > 1 {
                    self.scratch_blocks.push(last);
                }
            }
        }
        self.scratch_blocks.sort_unstable();
        for holders in self.scratch_blocks.chunk_by(|a, b| a == b) {
            let every_holder_appends =
                holders.len() == self.block_pool.ref_count(holders[0]) as usize;
            needed += holders.len() - usize::from(every_holder_appends);
        }
        Ok(needed)
    }

    /// Appends `n` tokens to every sequence of the batch and writes their slots, sequence by
    /// sequence, into `slots` (which it clears first). `token_ids`, when given, holds `n` ids
    /// per sequence in the same order and lets filled blocks join the prefix cache.
    /// All-or-nothing.
    pub fn append_tokens(
        &mut self,
        seq_ids: &[u64],
        n: usize,
        token_ids: Option<&[u32]>,
        slots: &mut Vec<i32>,
    ) -> CoreResult<()> {
        if n == 0 {
            return Err(CoreError::invalid("n must be at least 1, got 0"));
        }
        let total = seq_ids
            .len()
            .checked_mul(n)
            .ok_or_else(|| CoreError::invalid("batch × n overflows"))?;
        if let Some(ids) = token_ids {
            if ids.len() != total {
                return Err(CoreError::invalid(format!(
                    "token_ids holds {} ids; {} sequences × n={n} need {total}",
                    ids.len(),
                    seq_ids.len()
                )));
            }
        }
        self.resolve_batch(seq_ids)?;
        let slabs = std::mem::take(&mut self.scratch_slabs);
        let result = self.append_resolved(&slabs, n, token_ids, slots);
        self.scratch_slabs = slabs;
        result
    }

    fn append_resolved(
        &mut self,
        slabs: &[u32],
        n: usize,
        token_ids: Option<&[u32]>,
        slots: &mut Vec<i32>,
    ) -> CoreResult<()> {
        self.check_append_budget(slabs, n)?;
        slots.clear();
        slots.resize(slabs.len() * n, 0);
        for (i, (&slab, out)) in slabs.iter().zip(slots.chunks_exact_mut(n)).enumerate() {
            let ids = token_ids.map(|ids| &ids[i * n..(i + 1) * n]);
            self.append_to(slab, n, ids, |t, slot| out[t] = slot)?;
        }
        Ok(())
    }

    /// Appends `n` tokens to one sequence whose budget was checked; `emit(t, slot)` receives
    /// the slot of the t-th new token.
    #[inline]
    pub(crate) fn append_to(
        &mut self,
        slab: u32,
        n: usize,
        token_ids: Option<&[u32]>,
        mut emit: impl FnMut(usize, i32),
    ) -> CoreResult<()> {
        let version = self.bump_version();
        let block_size = self.block_size();
        let KvCache {
            sequences,
            block_pool,
            pending_moves,
            ..
        } = self;
        let seq = &mut sequences[slab as usize];
        if seq.num_tokens % block_size != 0 {
            if let Some(last) = seq.blocks.last_mut() {
                if block_pool.ref_count(*last) > 1 {
                    let copy = allocate_checked(block_pool)?;
                    pending_moves.push(BlockMove::new(MoveKind::Copy, *last, copy));
                    block_pool.release(*last);
                    *last = copy;
                    seq.layout = version;
                }
            }
        }
        if token_ids.is_none() && seq.hashable {
            seq.hashable = false;
            seq.partial_tokens.clear();
            seq.hashes.clear();
        }
        for t in 0..n {
            let position = seq.num_tokens + t;
            let offset = position % block_size;
            if offset == 0 {
                seq.blocks.push(allocate_checked(block_pool)?);
            }
            let block = seq.blocks[position / block_size];
            emit(t, (block as usize * block_size + offset) as i32);
            if let (Some(ids), true) = (token_ids, seq.hashable) {
                seq.partial_tokens.push(ids[t]);
                if seq.partial_tokens.len() == block_size {
                    let parent = seq.hashes.last().copied().unwrap_or(seq.root_hash);
                    seq.hashes.push(parent.chain(&seq.partial_tokens));
                    seq.partial_tokens.clear();
                }
            }
        }
        seq.num_tokens += n;
        seq.version = version;
        Ok(())
    }

    /// Slots of tokens `[starts[i], ends[i])` of each sequence, concatenated in batch order.
    pub fn slot_mapping(
        &self,
        seq_ids: &[u64],
        starts: &[i64],
        ends: &[i64],
        slots: &mut Vec<i32>,
    ) -> CoreResult<()> {
        if starts.len() != seq_ids.len() || ends.len() != seq_ids.len() {
            return Err(CoreError::invalid(format!(
                "seq_ids, starts and ends must have the same length, got {}, {} and {}",
                seq_ids.len(),
                starts.len(),
                ends.len()
            )));
        }
        let mut total = 0usize;
        for ((&seq_id, &start), &end) in seq_ids.iter().zip(starts).zip(ends) {
            let len = self.device_sequence(seq_id)?.num_tokens;
            if start < 0 || start > end || end > len as i64 {
                return Err(CoreError::invalid(format!(
                    "range [{start}, {end}) of sequence {seq_id} is not within its {len} tokens"
                )));
            }
            total += (end - start) as usize;
        }
        slots.clear();
        slots.reserve(total);
        let block_size = self.block_size();
        for ((&seq_id, &start), &end) in seq_ids.iter().zip(starts).zip(ends) {
            let blocks = &self.sequence(seq_id)?.blocks;
            slots.extend((start as usize..end as usize).map(|position| {
                (blocks[position / block_size] as usize * block_size + position % block_size) as i32
            }));
        }
        Ok(())
    }

    /// Makes `child_id` share every block of `parent_id`; the first append into a shared,
    /// partly filled block copies it (see [`KvCache::take_moves`]).
    pub fn fork(&mut self, parent_id: u64, child_id: u64) -> CoreResult<()> {
        let parent_slab = self.slab_of(parent_id)?;
        self.device_sequence(parent_id)?;
        if self.index.contains_key(&child_id) {
            return Err(CoreError::DuplicateSequence(child_id));
        }
        let child_slab = self.vacant_slab();
        let version = self.bump_version();
        let (parent, child) = two_mut(
            &mut self.sequences,
            parent_slab as usize,
            child_slab as usize,
        );
        child.seq_id = child_id;
        child.live = true;
        child.swapped = false;
        child.num_tokens = parent.num_tokens;
        child.version = version;
        child.layout = version;
        child.hashable = parent.hashable;
        child.root_hash = parent.root_hash;
        child.hashes.clear();
        child.hashes.extend_from_slice(&parent.hashes);
        child.num_computed = parent.num_computed;
        child.num_registered = parent.num_registered;
        child.blocks.clear();
        child.blocks.extend_from_slice(&parent.blocks);
        child.partial_tokens.clear();
        child
            .partial_tokens
            .extend_from_slice(&parent.partial_tokens);
        for &block in &child.blocks {
            self.block_pool.share(block);
        }
        self.has_forked = true;
        self.index.insert(child_id, child_slab);
        Ok(())
    }

    /// Records that the K/V of the sequence's first `num_tokens` tokens is written (by the
    /// model, or a copy). Full blocks within them that have known token ids join the prefix
    /// cache now, and not before: a block is never served as a hit before it is computed.
    /// `None` re-offers what was computed already (after a swap-in). Returns how many blocks
    /// joined the cache. Counts below what was computed before change nothing.
    pub fn mark_computed(&mut self, seq_id: u64, num_tokens: Option<usize>) -> CoreResult<usize> {
        let slab = self.slab_of(seq_id)?;
        let block_size = self.block_size();
        let seq = &mut self.sequences[slab as usize];
        if seq.swapped {
            return Err(swapped_out(seq_id));
        }
        let num_tokens = num_tokens.unwrap_or(seq.num_computed);
        if num_tokens > seq.num_tokens {
            return Err(CoreError::invalid(format!(
                "sequence {seq_id} holds {} tokens; {num_tokens} cannot be computed",
                seq.num_tokens
            )));
        }
        seq.num_computed = seq.num_computed.max(num_tokens);
        let full = (seq.num_computed / block_size).min(seq.hashes.len());
        let mut joined = 0;
        while seq.num_registered < full {
            let index = seq.num_registered;
            joined += usize::from(
                self.block_pool
                    .register(seq.blocks[index], seq.hashes[index]),
            );
            seq.num_registered += 1;
        }
        Ok(joined)
    }

    /// The blocks of a device sequence, its token count and its layout stamp (see
    /// [`KvCache::block_table`]): what a step plan's row needs, in one lookup.
    pub fn row_view(&self, seq_id: u64) -> CoreResult<(&[u32], usize, u64)> {
        let seq = self.device_sequence(seq_id)?;
        Ok((&seq.blocks, seq.num_tokens, seq.layout))
    }

    /// Tokens of a sequence whose K/V is known to be computed.
    pub fn num_computed(&self, seq_id: u64) -> CoreResult<usize> {
        Ok(self.sequence(seq_id)?.num_computed)
    }

    /// Ends a sequence. Its blocks are released last-first, so that when they are cached
    /// the tail of a prefix is evicted before its head.
    pub fn free_sequence(&mut self, seq_id: u64) -> CoreResult<()> {
        let slab = self
            .index
            .remove(&seq_id)
            .ok_or(CoreError::UnknownSequence(seq_id))?;
        let seq = &mut self.sequences[slab as usize];
        let pool = match (seq.swapped, self.host_pool.as_mut()) {
            (true, Some(host_pool)) => host_pool,
            _ => &mut self.block_pool,
        };
        for &block in seq.blocks.iter().rev() {
            pool.release(block);
        }
        seq.swapped = false;
        seq.blocks.clear();
        seq.partial_tokens.clear();
        seq.hashes.clear();
        seq.live = false;
        seq.num_tokens = 0;
        self.vacant.push(slab);
        Ok(())
    }

    /// Padded block tables, row-major `[batch, max blocks in the batch]`. Returns the width.
    pub fn block_tables(&self, seq_ids: &[u64], out: &mut Vec<i32>) -> CoreResult<usize> {
        let mut width = 0;
        for &seq_id in seq_ids {
            width = width.max(self.device_sequence(seq_id)?.blocks.len());
        }
        out.clear();
        out.resize(seq_ids.len() * width, NULL_BLOCK as i32);
        if width > 0 {
            for (&seq_id, row) in seq_ids.iter().zip(out.chunks_exact_mut(width)) {
                let blocks = &self.sequence(seq_id)?.blocks;
                for (cell, &block) in row.iter_mut().zip(blocks) {
                    *cell = block as i32;
                }
            }
        }
        Ok(width)
    }

    pub fn context_lens(&self, seq_ids: &[u64], out: &mut Vec<i32>) -> CoreResult<()> {
        out.clear();
        out.reserve(seq_ids.len());
        for &seq_id in seq_ids {
            out.push(self.seq_len(seq_id)? as i32);
        }
        Ok(())
    }

    /// FlashInfer's CSR page table: `indptr[i]..indptr[i+1]` indexes sequence i's blocks in
    /// `indices`; `last_page_len[i]` is how many slots of its last block hold tokens.
    pub fn page_table_csr(
        &self,
        seq_ids: &[u64],
        indptr: &mut Vec<i32>,
        indices: &mut Vec<i32>,
        last_page_len: &mut Vec<i32>,
    ) -> CoreResult<()> {
        let mut total = 0usize;
        for &seq_id in seq_ids {
            total += self.device_sequence(seq_id)?.blocks.len();
        }
        indptr.clear();
        indices.clear();
        last_page_len.clear();
        indptr.reserve(seq_ids.len() + 1);
        indices.reserve(total);
        last_page_len.reserve(seq_ids.len());
        indptr.push(0);
        let block_size = self.block_size();
        for &seq_id in seq_ids {
            let seq = self.sequence(seq_id)?;
            indices.extend(seq.blocks.iter().map(|&block| block as i32));
            indptr.push(indices.len() as i32);
            last_page_len.push(((seq.num_tokens - 1) % block_size + 1) as i32);
        }
        Ok(())
    }

    /// Drops every cached block that no sequence uses. Returns how many.
    pub fn reset_prefix_cache(&mut self) -> usize {
        self.block_pool.reset_prefix_cache()
    }

    pub fn stats(&self) -> KvCacheStats {
        let block_size = self.block_size();
        let pool = &self.block_pool;
        let blocks_used = self.num_blocks() - 1 - pool.num_free();
        let allocated_slots = blocks_used * block_size;
        // A partly filled block shared by forks counts once: sort the (block, fill) pairs.
        let mut partial: Vec<(u32, usize)> = self
            .index
            .values()
            .map(|&slab| &self.sequences[slab as usize])
            .filter(|seq| !seq.swapped && seq.num_tokens % block_size != 0)
            .map(|seq| {
                (
                    *seq.blocks.last().unwrap_or(&NULL_BLOCK),
                    seq.num_tokens % block_size,
                )
            })
            .collect();
        partial.sort_unstable();
        partial.dedup();
        let unused_slots: usize = partial.iter().map(|&(_, fill)| block_size - fill).sum();
        let used_slots = allocated_slots - unused_slots;
        let PrefixCacheCounters {
            queries,
            hits,
            evictions,
        } = pool.counters();
        KvCacheStats {
            num_blocks: self.num_blocks(),
            block_size,
            blocks_used,
            blocks_free: pool.num_free() - pool.num_evictable(),
            blocks_cached: pool.num_evictable(),
            num_sequences: self.index.len(),
            num_tokens: self
                .index
                .values()
                .map(|&slab| self.sequences[slab as usize].num_tokens)
                .sum(),
            allocated_slots,
            used_slots,
            fragmentation: if allocated_slots == 0 {
                0.0
            } else {
                unused_slots as f64 / allocated_slots as f64
            },
            prefix_cache_queries: queries,
            prefix_cache_hits: hits,
            prefix_cache_query_tokens: self.query_tokens,
            prefix_cache_hit_tokens: self.hit_tokens,
            evictions,
            pending_copies: self.pending_moves.len(),
            bytes_per_block: self.bytes_per_block,
            host_blocks: self.num_host_blocks(),
            host_blocks_used: self.num_host_blocks() - self.num_free_host_blocks(),
            num_swapped: self
                .index
                .values()
                .filter(|&&slab| self.sequences[slab as usize].swapped)
                .count(),
        }
    }

    /// Host memory held by the bookkeeping: the block pool plus the sequence slab and index
    /// (excluding the block lists themselves, which are 4 bytes per block held).
    pub fn heap_bytes(&self) -> (usize, usize) {
        let per_sequence = self.sequences.capacity() * std::mem::size_of::<Sequence>()
            + self
                .sequences
                .iter()
                .map(|seq| seq.partial_tokens.capacity() * 4)
                .sum::<usize>()
            + self.vacant.capacity() * 4
            + self.index.allocation_size();
        (self.block_pool.heap_bytes(), per_sequence)
    }

    /// Checks that every slot a kernel is about to write lies in a block some sequence holds
    /// (negative slots are padding and skipped).
    pub fn check_slots(&self, slots: &[i32]) -> CoreResult<()> {
        let block_size = self.block_size();
        for &slot in slots.iter().filter(|&&slot| slot >= 0) {
            let block = slot as usize / block_size;
            if block >= self.num_blocks()
                || block == NULL_BLOCK as usize
                || self.block_pool.ref_count(block as u32) == 0
            {
                return Err(CoreError::invalid(format!(
                    "slot {slot} is in block {block}, which no sequence holds: refusing to write there"
                )));
            }
        }
        Ok(())
    }

    /// Adds a host tier of `num_host_blocks` blocks that `swap_out` moves sequences to.
    pub fn enable_host_tier(&mut self, num_host_blocks: usize) -> CoreResult<()> {
        if self.host_pool.is_some() || !self.index.is_empty() {
            return Err(CoreError::invalid(
                "the host tier is set once, before any sequence exists",
            ));
        }
        if num_host_blocks == 0 {
            return Err(CoreError::invalid(
                "num_host_blocks must be at least 1, got 0",
            ));
        }
        let host_pool = BlockPool::new(num_host_blocks + 1, self.block_size(), false)?;
        self.scratch_moves = crate::alloc_util::try_filled_vec(
            self.num_blocks().max(num_host_blocks + 1),
            NO_BLOCK,
            "num_host_blocks",
        )?;
        self.host_pool = Some(host_pool);
        Ok(())
    }

    /// Usable host blocks (0 without a host tier).
    pub fn num_host_blocks(&self) -> usize {
        self.host_pool
            .as_ref()
            .map_or(0, |pool| pool.num_blocks() - 1)
    }

    pub fn num_free_host_blocks(&self) -> usize {
        self.host_pool.as_ref().map_or(0, BlockPool::num_free)
    }

    /// Moves the sequences' blocks to the host tier and frees their device blocks. The
    /// (device block → host block) moves join the pending moves (see [`KvCache::take_moves`]),
    /// after any pending copy; a block the sequences share is moved once. All-or-nothing.
    pub fn swap_out(&mut self, seq_ids: &[u64]) -> CoreResult<()> {
        self.swap(seq_ids, true)
    }

    /// Brings swapped-out sequences back into free device blocks (evicting cached ones if
    /// need be); the (host block → device block) moves join the pending moves. The blocks
    /// rejoin the prefix cache with the next `mark_computed`, once their bytes are back.
    /// All-or-nothing.
    pub fn swap_in(&mut self, seq_ids: &[u64]) -> CoreResult<()> {
        self.swap(seq_ids, false)
    }

    fn swap(&mut self, seq_ids: &[u64], out: bool) -> CoreResult<()> {
        if self.host_pool.is_none() {
            return Err(CoreError::invalid(
                "this KV cache has no host tier: construct it with num_host_blocks",
            ));
        }
        self.resolve_batch(seq_ids)?;
        let slabs = std::mem::take(&mut self.scratch_slabs);
        let result = self.swap_resolved(&slabs, out);
        self.scratch_slabs = slabs;
        result
    }

    fn swap_resolved(&mut self, slabs: &[u32], out: bool) -> CoreResult<()> {
        let KvCache {
            sequences,
            block_pool,
            host_pool,
            scratch_moves,
            pending_moves,
            ..
        } = self;
        let Some(host_pool) = host_pool.as_mut() else {
            return Ok(());
        };
        let (source, destination) = if out {
            (block_pool, host_pool)
        } else {
            (host_pool, block_pool)
        };
        for &slab in slabs {
            let seq = &sequences[slab as usize];
            if seq.swapped == out {
                return Err(if out {
                    swapped_out(seq.seq_id)
                } else {
                    CoreError::invalid(format!("sequence {} is not swapped out", seq.seq_id))
                });
            }
        }
        // Count the distinct source blocks (each is copied once) before changing anything.
        let mut needed = 0;
        for &slab in slabs {
            for &block in &sequences[slab as usize].blocks {
                if scratch_moves[block as usize] == NO_BLOCK {
                    scratch_moves[block as usize] = 0;
                    needed += 1;
                }
            }
        }
        for &slab in slabs {
            for &block in &sequences[slab as usize].blocks {
                scratch_moves[block as usize] = NO_BLOCK;
            }
        }
        let available = destination.num_free();
        if needed > available {
            return Err(if out {
                CoreError::OutOfHostBlocks { needed, available }
            } else {
                CoreError::OutOfBlocks { needed, available }
            });
        }
        let kind = if out {
            MoveKind::ToHost
        } else {
            MoveKind::ToDevice
        };
        let first_move = pending_moves.len();
        for &slab in slabs {
            let seq = &mut sequences[slab as usize];
            for block in seq.blocks.iter_mut().rev() {
                let moved = match scratch_moves[*block as usize] {
                    NO_BLOCK => {
                        let moved = allocate_checked(destination)?;
                        scratch_moves[*block as usize] = moved;
                        pending_moves.push(BlockMove::new(kind, *block, moved));
                        moved
                    }
                    moved => {
                        destination.share(moved);
                        moved
                    }
                };
                source.release(*block);
                *block = moved;
            }
            seq.swapped = out;
            seq.layout = seq.version;
            // Fresh device blocks: offered to the prefix cache again once computed.
            seq.num_registered = 0;
        }
        for planned in &pending_moves[first_move..] {
            scratch_moves[planned.src as usize] = NO_BLOCK;
        }
        Ok(())
    }

    /// Verifies every invariant of the cache and its block pool (for tests).
    pub fn check_invariants(&self) -> Result<(), String> {
        let block_size = self.block_size();
        let mut holders = vec![0u32; self.num_blocks()];
        let mut host_holders = vec![0u32; self.num_host_blocks() + 1];
        for (&seq_id, &slab) in &self.index {
            let seq = &self.sequences[slab as usize];
            if !seq.live || seq.seq_id != seq_id {
                return Err(format!(
                    "index entry {seq_id} points at slab {slab} holding {}",
                    seq.seq_id
                ));
            }
            if seq.num_tokens == 0 || seq.blocks.len() != seq.num_tokens.div_ceil(block_size) {
                return Err(format!(
                    "sequence {seq_id}: {} tokens in {} blocks",
                    seq.num_tokens,
                    seq.blocks.len()
                ));
            }
            if seq.hashable
                && (seq.partial_tokens.len() != seq.num_tokens % block_size
                    || seq.hashes.len() != seq.num_tokens / block_size)
            {
                return Err(format!(
                    "sequence {seq_id}: block ids or hashes out of step"
                ));
            }
            if seq.num_computed > seq.num_tokens || seq.num_registered > seq.blocks.len() {
                return Err(format!(
                    "sequence {seq_id}: {} computed of {} tokens, {} registered of {} blocks",
                    seq.num_computed,
                    seq.num_tokens,
                    seq.num_registered,
                    seq.blocks.len()
                ));
            }
            let tier = if seq.swapped {
                &mut host_holders
            } else {
                &mut holders
            };
            for &block in &seq.blocks {
                if block == NULL_BLOCK || block as usize >= tier.len() {
                    return Err(format!("sequence {seq_id} holds invalid block {block}"));
                }
                tier[block as usize] += 1;
            }
        }
        let live = self.sequences.iter().filter(|seq| seq.live).count();
        if live != self.index.len() || live + self.vacant.len() != self.sequences.len() {
            return Err("sequence slab and index disagree".into());
        }
        if let Some(host_pool) = &self.host_pool {
            host_pool
                .check_invariants(&host_holders)
                .map_err(|error| format!("host tier: {error}"))?;
        }
        if self.scratch_moves.iter().any(|&moved| moved != NO_BLOCK) {
            return Err("swap scratch left dirty".into());
        }
        self.block_pool.check_invariants(&holders)
    }
}

fn swapped_out(seq_id: u64) -> CoreError {
    CoreError::invalid(format!(
        "sequence {seq_id} is swapped out; swap_in() it first"
    ))
}

#[inline]
fn allocate_checked(block_pool: &mut BlockPool) -> CoreResult<u32> {
    // Callers check the budget first; this is a guard, not a code path.
    block_pool.allocate().ok_or(CoreError::OutOfBlocks {
        needed: 1,
        available: 0,
    })
}

fn two_mut<T>(items: &mut [T], a: usize, b: usize) -> (&mut T, &mut T) {
    debug_assert_ne!(a, b);
    if a < b {
        let (low, high) = items.split_at_mut(b);
        (&mut low[a], &mut high[0])
    } else {
        let (low, high) = items.split_at_mut(a);
        (&mut high[0], &mut low[b])
    }
}

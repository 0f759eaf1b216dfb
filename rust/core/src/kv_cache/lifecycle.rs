//! A sequence's life: admission with prefix reuse, fork, computed marks, and its end.

use super::keys::group_key;
use super::partial_hits::{copy_partial_hit, index_sub_blocks};
use super::prefix_match::PrefixMatch;
use super::retention::retain_joined;
use super::sequences::{Sequence, SequenceLog};
use super::state_checkpoints::{hold_checkpoint, resume_from_checkpoint};
use super::tiers::host_block;
use super::{swapped_out, KvCache, KvCacheGroup, Tiers, Tokens};

use crate::alloc::{BlockHash, NULL_BLOCK};
use crate::error::{CoreError, CoreResult};

impl KvCache {
    /// Whether `alloc_sequence` would succeed now for a new sequence with these tokens.
    pub fn can_allocate(
        &mut self,
        tokens: Tokens<'_>,
        cache_salt: Option<&[u8]>,
    ) -> CoreResult<bool> {
        Ok(self.blocks_to_allocate(tokens, cache_salt)? <= self.tiers.block_pool.num_free())
    }

    /// How many blocks of the free queue `alloc_sequence` would take now (fresh blocks plus
    /// cached hits that no sequence uses).
    pub fn blocks_to_allocate(
        &mut self,
        tokens: Tokens<'_>,
        cache_salt: Option<&[u8]>,
    ) -> CoreResult<usize> {
        self.admission_need(tokens, cache_salt, false, None)
    }

    /// What `admit_sequence` would take of the free queue now: the full-attention groups'
    /// blocks and every group's hits that no sequence uses.
    pub fn blocks_to_admit(
        &mut self,
        tokens: Tokens<'_>,
        cache_salt: Option<&[u8]>,
    ) -> CoreResult<usize> {
        self.admission_need(tokens, cache_salt, true, None)
    }

    /// `blocks_to_admit` without a salt, the tokens' full-block hashes given.
    pub(crate) fn blocks_to_admit_hashed(
        &mut self,
        tokens: Tokens<'_>,
        hashes: &[BlockHash],
    ) -> CoreResult<usize> {
        self.admission_need(tokens, None, true, Some(hashes))
    }

    fn admission_need(
        &mut self,
        tokens: Tokens<'_>,
        cache_salt: Option<&[u8]>,
        lazy: bool,
        known: Option<&[BlockHash]>,
    ) -> CoreResult<usize> {
        self.check_token_count(tokens.len(), "token count", lazy)?;
        let mut found = self.match_known_prefix(tokens, cache_salt, known);
        // A partial hit's block is a fresh block (filled by a copy).
        let num_blocks = tokens.len().div_ceil(self.block_size());
        let (eager, free) = (self.eager_groups(lazy), self.tiers.block_pool.num_free());
        let scratch = (&mut self.scratch.partial, &mut self.scratch.checkpoint);
        Ok(found.need(num_blocks, eager, free, self.states.blocks_per_seq, scratch))
    }

    /// Groups that take a new sequence's blocks up front: all, or only the full-attention
    /// ones when windowed groups take theirs as the prompt is computed.
    fn eager_groups(&self, lazy: bool) -> usize {
        match lazy {
            true => self.groups.iter().filter(|g| !g.kind.is_windowed()).count(),
            false => self.groups.len(),
        }
    }

    /// Gives a new sequence the blocks for `tokens`, reusing cached full blocks when token ids
    /// are given. Returns how many leading tokens are already in the cache.
    pub fn alloc_sequence(
        &mut self,
        seq_id: u64,
        tokens: Tokens<'_>,
        cache_salt: Option<&[u8]>,
    ) -> CoreResult<usize> {
        self.alloc(seq_id, tokens, cache_salt, false, None)
    }

    /// `alloc_sequence` as a scheduler admits a prompt: windowed (sliding-window, chunked)
    /// groups take no block past the prefix hit yet; `mark_computed` gives them each chunk's
    /// blocks as it is computed, so a long prompt never holds more than its window there.
    pub fn admit_sequence(
        &mut self,
        seq_id: u64,
        tokens: Tokens<'_>,
        cache_salt: Option<&[u8]>,
    ) -> CoreResult<usize> {
        self.alloc(seq_id, tokens, cache_salt, true, None)
    }

    /// `admit_sequence` without a salt, the tokens' full-block hashes given.
    pub(crate) fn admit_sequence_hashed(
        &mut self,
        seq_id: u64,
        tokens: Tokens<'_>,
        hashes: &[BlockHash],
    ) -> CoreResult<usize> {
        self.alloc(seq_id, tokens, None, true, Some(hashes))
    }

    fn alloc(
        &mut self,
        seq_id: u64,
        tokens: Tokens<'_>,
        cache_salt: Option<&[u8]>,
        lazy: bool,
        known: Option<&[BlockHash]>,
    ) -> CoreResult<usize> {
        if self.sequences.contains(seq_id) {
            return Err(CoreError::DuplicateSequence(seq_id));
        }
        let found = self.match_admission(tokens, cache_salt, lazy, known)?;
        if let Tokens::Ids(_) = tokens {
            self.record_lookup(found.queries, found.hits, found.limited_by);
            let from_host = self.host_hit_blocks(found.queries, found.hits);
            self.prefix_stats
                .count_host_hit(from_host, self.block_size());
            self.prefix_stats
                .count_partial(found.queryable, found.partial);
        }
        let slab = self.fill_new_sequence(seq_id, (tokens, cache_salt), lazy, &found)?;
        self.take_state_blocks(slab)?;
        // The hit's states: copies of the checkpoint at its end (see `state_checkpoints`).
        let KvCache {
            sequences,
            tiers,
            scratch,
            ..
        } = self;
        resume_from_checkpoint(tiers, &scratch.checkpoint, sequences[slab].state());
        scratch.checkpoint.clear();
        self.sequences.insert(seq_id, slab);
        Ok(found.hits * self.block_size() + found.partial)
    }

    /// Checks an admission of `tokens` and finds its prefix hit (into the scratch buffers),
    /// changing nothing: `OutOfBlocks` when what it takes is not free.
    fn match_admission(
        &mut self,
        tokens: Tokens<'_>,
        cache_salt: Option<&[u8]>,
        lazy: bool,
        known: Option<&[BlockHash]>,
    ) -> CoreResult<PrefixMatch> {
        let num_tokens = tokens.len();
        self.check_token_count(num_tokens, "token count", lazy)?;
        let num_blocks = num_tokens.div_ceil(self.block_size());
        let mut found = self.match_known_prefix(tokens, cache_salt, known);
        let (eager, free) = (self.eager_groups(lazy), self.tiers.block_pool.num_free());
        let scratch = (&mut self.scratch.partial, &mut self.scratch.checkpoint);
        let needed = found.need(num_blocks, eager, free, self.states.blocks_per_seq, scratch);
        ensure_free(needed, self.tiers.block_pool.num_free())?;
        Ok(found)
    }

    /// Makes the sequence of an admission `match_admission` checked, in a vacant slab: its
    /// hits held (host hits promoted), the rest of its blocks taken, its partial hit's copy
    /// planned, its token ids and hashes kept. Returns the slab.
    ///
    /// The budget was checked, so an allocation here fails only if that count is wrong (a
    /// bug, which would leave this sequence half made).
    fn fill_new_sequence(
        &mut self,
        seq_id: u64,
        (tokens, cache_salt): (Tokens<'_>, Option<&[u8]>),
        lazy: bool,
        found: &PrefixMatch,
    ) -> CoreResult<u32> {
        let (queries, hits) = (found.queries, found.hits);
        let (num_tokens, block_size) = (tokens.len(), self.block_size());
        let keep_token_ids = self.tiers.events.enabled() || self.has_sub_blocks();
        let version = self.sequences.new_version();
        let slab = self.sequences.vacant_slab(version, self.groups.len());
        let KvCache {
            sequences,
            tiers,
            scratch,
            groups,
            ..
        } = self;
        // Held until their copies are planned, so that no allocation below can take them.
        for &source in scratch.partial.iter() {
            tiers.block_pool.take_hit(source);
        }
        hold_checkpoint(&mut tiers.block_pool, &scratch.checkpoint);
        let (seq, log) = sequences.with_log(slab);
        seq.admit(seq_id, num_tokens, version);
        let hit_row = |group: usize| &scratch.blocks[group * queries..group * queries + hits];
        let num_blocks = num_tokens.div_ceil(block_size);
        let first_promoted =
            take_blocks((seq, log, slab), tiers, groups, hit_row, (num_blocks, lazy))?;
        copy_partial_hit(seq, tiers, &scratch.partial, hits);
        // Hits are computed already (promoted ones once their moves ran, before any kernel
        // reads them); the rest joins the prefix cache once `mark_computed` says its K/V is
        // written, promoted blocks with it.
        let computed = (hits * block_size + found.partial, first_promoted);
        // Block counts stay below MAX_BLOCKS (2**25): they fit.
        let reach = (found.kv_hits as u32, ((num_tokens - 1) / block_size) as u32);
        seq.admitted_at(computed, reach);
        if let Tokens::Ids(ids) = tokens {
            if tiers.block_pool.enable_prefix_caching() {
                let partial = &ids[scratch.hashes.len() * block_size..];
                let all_ids = keep_token_ids.then_some(ids);
                let root = BlockHash::root(cache_salt);
                seq.name_tokens(root, (&scratch.hashes, partial), all_ids);
            }
        }
        Ok(slab)
    }

    /// Makes `child_id` share every block of `parent_id`; the first append into a shared,
    /// partly filled block copies it (see [`KvCache::take_moves`]). Recurrent states are
    /// never shared: the child gets blocks of its own and a copy of the parent's state is
    /// planned into them (`OutOfBlocks` when they are not free).
    pub fn fork(&mut self, parent_id: u64, child_id: u64) -> CoreResult<()> {
        let parent_slab = self.slab_of(parent_id)?;
        self.device_sequence(parent_id)?;
        if self.sequences.contains(child_id) {
            return Err(CoreError::DuplicateSequence(child_id));
        }
        self.check_state_budget()?;
        let version = self.sequences.new_version();
        let child_slab = self.sequences.vacant_slab(version, self.groups.len());
        let (parent, child) = self.sequences.two_mut(parent_slab, child_slab);
        child.fork_of(parent, child_id, version);
        for block in child.held_blocks() {
            self.tiers.block_pool.share(block);
        }
        self.sequences.mark_forked();
        self.copy_state(parent_slab, child_slab)?;
        self.sequences.insert(child_id, child_slab);
        Ok(())
    }

    /// Records that the K/V of the sequence's first `num_tokens` tokens is written (by the
    /// model, or a copy). Full blocks within them that have known token ids join the prefix
    /// cache now, and not before: a block is never served as a hit before it is computed.
    /// `None` re-offers what was computed already (after a swap-in). Returns how many blocks
    /// joined the cache. Counts below what was computed before change nothing.
    ///
    /// Windowed groups move with it (see [`KvCache::blocks_to_compute`]): they release the
    /// blocks no token from the previous mark on attends to — the scheduler marks a step's
    /// tokens before the model computes them, so those tokens still read the window of the
    /// first of them — and take the blocks of the newly marked tokens they lack (a prompt
    /// admitted with `admit_sequence`). All-or-nothing: `OutOfBlocks` when those are missing.
    pub fn mark_computed(&mut self, seq_id: u64, num_tokens: Option<usize>) -> CoreResult<usize> {
        let slab = self.slab_of(seq_id)?;
        let block_size = self.block_size();
        let seq = &self.sequences[slab];
        if seq.is_swapped() {
            return Err(swapped_out(seq_id));
        }
        let num_tokens = num_tokens.unwrap_or(seq.num_computed());
        ensure!(
            num_tokens <= seq.num_tokens(),
            "sequence {seq_id} holds {} tokens; {num_tokens} cannot be computed",
            seq.num_tokens()
        );
        let needed = self.window_need(slab, num_tokens);
        if needed > self.tiers.block_pool.num_free() {
            return Err(CoreError::OutOfBlocks {
                needed,
                available: self.tiers.block_pool.num_free(),
            });
        }
        self.advance_windows(slab, num_tokens)?;
        // Evictions (the windows' allocations too) are logged before blocks are named again.
        self.sync_removed();
        let KvCache {
            sequences,
            tiers,
            groups,
            scratch,
            deferred_sub_blocks,
            ..
        } = self;
        let Tiers {
            block_pool, events, ..
        } = tiers;
        let seq = &mut sequences[slab];
        seq.computed_up_to(num_tokens);
        let full = (seq.num_computed() / block_size).min(seq.hashes().len());
        if full <= seq.num_registered() {
            return Ok(0); // most calls: no block filled since the last
        }
        let mut joined = 0;
        // Group by group, so that a group's new blocks are one chain: one event per run of
        // blocks that joined (a block whose contents another block holds does not).
        for (group, (table, spec)) in seq.tables().iter().zip(groups.iter()).enumerate() {
            let mut run_start = None;
            let remember_eviction = spec.kind.remembers_evictions();
            for index in seq.num_registered()..full {
                let block = table.blocks()[index];
                let key = group_key(seq.hashes()[index], group);
                let stored =
                    block != NULL_BLOCK && block_pool.register(block, key, remember_eviction);
                joined += usize::from(stored);
                if stored {
                    retain_joined(block_pool, seq.retention(), index, block);
                    let scratch = (&mut scratch.sub_keys, &mut *deferred_sub_blocks);
                    index_sub_blocks(block_pool, seq, scratch, (index, group, block, key));
                }
                if !events.enabled() {
                    continue;
                }
                if stored {
                    let name = seq.named_block(index, block_size);
                    events.cached_for(block, group as u32, name, seq.root_hash());
                    run_start.get_or_insert(index);
                } else if let Some(start) = run_start.take() {
                    seq.log_stored(events, group, start..index, block_size);
                }
            }
            if let Some(start) = run_start {
                seq.log_stored(events, group, start..full, block_size);
            }
        }
        seq.registered_up_to(full);
        Ok(joined)
    }

    /// Tokens of a sequence whose K/V is known to be computed.
    pub fn num_computed(&self, seq_id: u64) -> CoreResult<usize> {
        Ok(self.sequence(seq_id)?.num_computed())
    }

    /// Ends a sequence. Its blocks are released last-first, so that when they are cached
    /// the tail of a prefix is evicted before its head. With `hash_block_size`, its last,
    /// partly computed block stays cached by its computed pieces (see `partial_hits`).
    ///
    /// With windowed groups, block `i` of every group goes back together, and a windowed
    /// block released earlier that is still cached is touched then too: a hit at block `k`
    /// needs the full groups' blocks before `k` and the windowed groups' blocks just before
    /// `k`, so evicting index by index from the tail keeps every shorter hit whole (released
    /// early, those blocks would otherwise be evicted first and no hit would survive).
    pub fn free_sequence(&mut self, seq_id: u64) -> CoreResult<()> {
        let slab = self.sequences.remove(seq_id)?;
        self.keep_last_pieces(slab);
        let KvCache {
            sequences, tiers, ..
        } = self;
        let Tiers {
            block_pool,
            host_tier,
            events,
            ..
        } = tiers;
        let (seq, log) = sequences.with_log(slab);
        let (pool, on_host) = match (seq.is_swapped(), host_tier.as_mut()) {
            (true, Some(tier)) => (&mut tier.pool, true),
            _ => (block_pool, false),
        };
        let touch_released = !on_host && pool.enable_prefix_caching();
        for &block in seq.state() {
            pool.release(block);
            if on_host && events.enabled() && pool.ref_count(block) == 0 {
                events.host_block_freed(block);
            }
        }
        for index in (0..seq.num_blocks()).rev() {
            for (group, table) in seq.tables().iter().enumerate() {
                let block = table.blocks()[index];
                if block != NULL_BLOCK {
                    pool.release(block);
                    if on_host && events.enabled() && pool.ref_count(block) == 0 {
                        events.host_block_freed(block);
                    }
                } else if touch_released && index < seq.num_registered().min(seq.hashes().len()) {
                    if let Some(cached) = pool.lookup(group_key(seq.hashes()[index], group)) {
                        pool.touch(cached);
                    }
                }
            }
        }
        seq.clear(log, slab);
        Ok(())
    }

    /// Drops every cached block that no sequence uses, the host prefix cache's too. Returns
    /// how many. With KV events, a reset that leaves nothing cached on any medium is one
    /// `AllBlocksCleared`; otherwise its blocks are removals.
    pub fn reset_prefix_cache(&mut self) -> usize {
        self.sync_removed();
        let host_dropped = self
            .tiers
            .host_tier
            .as_mut()
            .map_or(0, |tier| tier.pool.reset_prefix_cache());
        let dropped = self.tiers.block_pool.reset_prefix_cache();
        let nothing_left =
            self.tiers.block_pool.num_cached() == 0 && !self.tiers.events.has_host_copies();
        if self.tiers.events.enabled() && dropped > 0 && nothing_left {
            self.tiers.block_pool.drain_removed(|_, _| {});
            self.tiers.events.all_cleared();
        }
        self.sync_removed();
        dropped + host_dropped
    }
}

fn ensure_free(needed: usize, available: usize) -> CoreResult<()> {
    match needed > available {
        true => Err(CoreError::OutOfBlocks { needed, available }),
        false => Ok(()),
    }
}

/// Fills a new sequence's group tables: every group's hits first (`hit_row(group)`,
/// `NULL_BLOCK` where a window released one), then fresh blocks up to `num_blocks`
/// (windowed groups of a `lazy` admission take theirs chunk by chunk later). Every group takes
/// its hits before any allocates: a fresh block could otherwise be another group's unused
/// hit, evicted from under it. Host hits are held the same way, then each is promoted into a
/// fresh device block by a (host → device) move. Returns the first block index promoted
/// (`hits` when none was): the blocks from there join the device's prefix cache with
/// `mark_computed`.
fn take_blocks<'a>(
    (seq, log, slab): (&mut Sequence, &mut SequenceLog, u32),
    tiers: &mut Tiers,
    groups: &[KvCacheGroup],
    hit_row: impl Fn(usize) -> &'a [u32],
    (num_blocks, lazy): (usize, bool),
) -> CoreResult<usize> {
    let mut hits = 0;
    let mut first_promoted = usize::MAX;
    for (group, table) in seq.tables_mut().iter_mut().enumerate() {
        let row = hit_row(group);
        hits = row.len();
        for (index, &block) in row.iter().enumerate() {
            if block == NULL_BLOCK {
                // A window released it: nothing to hold.
            } else if let Some(copy) = host_block(block) {
                if let Some(tier) = tiers.host_tier.as_mut() {
                    tier.pool.take_hit(copy);
                }
                first_promoted = first_promoted.min(index);
            } else {
                tiers.block_pool.take_hit(block);
            }
            table.push_hit(block);
        }
        table.hits_taken();
    }
    let first_promoted = first_promoted.min(hits);
    for (group, table) in seq.tables_mut().iter_mut().enumerate() {
        for index in first_promoted..hits {
            let Some(copy) = host_block(table.blocks()[index]) else {
                continue;
            };
            let block = tiers.promote(copy)?;
            table.set(index, block, log, (slab, group as u32));
        }
    }
    for (table, spec) in seq.tables_mut().iter_mut().zip(groups) {
        if lazy && spec.kind.is_windowed() {
            table.pend_up_to(num_blocks);
            continue;
        }
        for _ in hits..num_blocks {
            table.push(tiers.allocate_device()?);
        }
    }
    Ok(first_promoted)
}

//! A sequence's life: admission with prefix reuse, fork, computed marks, and its end.

use super::{allocate_checked, swapped_out, two_mut, KvCache, Medium, Tokens};
use crate::alloc::BlockHash;
use crate::error::{CoreError, CoreResult};

impl KvCache {
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
            events,
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
        seq.token_ids.clear();
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
                if events.enabled() {
                    seq.token_ids.extend_from_slice(ids);
                }
            }
            _ => seq.hashable = false,
        }
        self.index.insert(seq_id, slab);
        Ok(hits * block_size)
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
        child.token_ids.clear();
        child.token_ids.extend_from_slice(&parent.token_ids);
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
        self.sync_removed();
        let KvCache {
            sequences,
            block_pool,
            events,
            ..
        } = self;
        let seq = &mut sequences[slab as usize];
        if seq.swapped {
            return Err(swapped_out(seq_id));
        }
        let num_tokens = num_tokens.unwrap_or(seq.num_computed);
        ensure!(
            num_tokens <= seq.num_tokens,
            "sequence {seq_id} holds {} tokens; {num_tokens} cannot be computed",
            seq.num_tokens
        );
        seq.num_computed = seq.num_computed.max(num_tokens);
        let full = (seq.num_computed / block_size).min(seq.hashes.len());
        let mut joined = 0;
        while seq.num_registered < full {
            let index = seq.num_registered;
            let stored = block_pool.register(seq.blocks[index], seq.hashes[index]);
            if stored && events.enabled() {
                let (parent, hash, tokens) = seq.named_block(index, block_size);
                events.stored(Medium::Device, parent, seq.root_hash, hash, tokens);
            }
            joined += usize::from(stored);
            seq.num_registered += 1;
        }
        Ok(joined)
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
        let KvCache {
            sequences,
            block_pool,
            host_pool,
            events,
            vacant,
            ..
        } = self;
        let seq = &mut sequences[slab as usize];
        let (pool, on_host) = match (seq.swapped, host_pool.as_mut()) {
            (true, Some(host_pool)) => (host_pool, true),
            _ => (block_pool, false),
        };
        for &block in seq.blocks.iter().rev() {
            pool.release(block);
            if on_host && events.enabled() && pool.ref_count(block) == 0 {
                events.host_block_freed(block);
            }
        }
        seq.swapped = false;
        seq.blocks.clear();
        seq.partial_tokens.clear();
        seq.hashes.clear();
        seq.token_ids.clear();
        seq.live = false;
        seq.num_tokens = 0;
        vacant.push(slab);
        Ok(())
    }

    /// Drops every cached block that no sequence uses. Returns how many.
    /// With KV events, a reset that leaves nothing cached on any medium is one
    /// `AllBlocksCleared`; otherwise its blocks are removals.
    pub fn reset_prefix_cache(&mut self) -> usize {
        self.sync_removed();
        let dropped = self.block_pool.reset_prefix_cache();
        let nothing_left = self.block_pool.num_cached() == 0 && !self.events.has_host_copies();
        if self.events.enabled() && dropped > 0 && nothing_left {
            self.block_pool.drain_removed(|_| {});
            self.events.all_cleared();
        }
        self.sync_removed();
        dropped
    }
}

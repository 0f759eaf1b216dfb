//! What the prefix cache holds of a prompt: the longest hit every group can serve, on the
//! device or the host tier, and where it stops.

use super::keys::group_key;
use super::state_checkpoints::STATE_LIMIT;
use super::tiers::host_block;
use super::{KvCache, Tokens};
use crate::alloc::{BlockHash, NULL_BLOCK};

/// What a prefix lookup found: full blocks it could serve (`queries`), blocks every group
/// serves (`hits`), how many blocks those take from the free queue (unused device hits, and
/// host hits, each promoted into a fresh block), and the (group, block) that stopped it
/// short of `queries`. With sub-block keys, `partial` tokens of the next block are served by
/// copies from the sources in `scratch_partial`, of which `partial_held` are unused (held
/// off the free queue while the admission allocates), and `queryable` more tokens could
/// have been. With recurrent layers the hit ends at a checkpoint (`scratch_checkpoint`), of
/// whose blocks `checkpoint_held` are held the same way.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct PrefixMatch {
    pub(super) queries: usize,
    pub(super) hits: usize,
    pub(super) hits_queued: usize,
    pub(super) limited_by: Option<(usize, usize)>,
    pub(super) partial: usize,
    pub(super) partial_held: usize,
    pub(super) queryable: usize,
    pub(super) checkpoint_held: usize,
    /// Leading blocks every group could serve before a checkpoint cut the hit back.
    pub(super) kv_hits: usize,
}

impl PrefixMatch {
    /// Blocks of the free queue an admission of `num_blocks` blocks (`eager_groups` taking
    /// theirs now) and `state_blocks` state blocks takes and keeps. Its partial hit's unused
    /// sources, and the unused blocks of the checkpoint it resumes from, are held off the
    /// queue only while it allocates, so they count only in whether the hit fits: a partial
    /// hit that does not is given up (`sources` cleared), and a hit whose checkpoint does
    /// not, entirely (`checkpoint` cleared: without a state its K/V is no use). A hit saves
    /// compute, and must never keep a request that fits without it waiting.
    pub(super) fn need(
        &mut self,
        num_blocks: usize,
        eager_groups: usize,
        num_free: usize,
        state_blocks: usize,
        (sources, checkpoint): (&mut Vec<u32>, &mut Vec<u32>),
    ) -> usize {
        let need = (num_blocks - self.hits) * eager_groups + self.hits_queued + state_blocks;
        if need + self.partial_held + self.checkpoint_held > num_free && self.partial > 0 {
            (self.partial, self.partial_held) = (0, 0);
            sources.clear();
        }
        if need + self.checkpoint_held > num_free && self.checkpoint_held > 0 {
            (self.hits, self.hits_queued, self.checkpoint_held) = (0, 0, 0);
            self.limited_by = Some((STATE_LIMIT, 0));
            checkpoint.clear();
            return num_blocks * eager_groups + state_blocks;
        }
        need
    }
}

impl KvCache {
    /// Looks up the cached prefix of `tokens`: fills `scratch_hashes` with the hash of every
    /// full block and `scratch_blocks` with the hit blocks, a row of `queries` per group whose
    /// first `hits` count (the null block where a group's window does not need one). Changes
    /// nothing else.
    pub(super) fn match_prefix(
        &mut self,
        tokens: Tokens<'_>,
        cache_salt: Option<&[u8]>,
    ) -> PrefixMatch {
        self.match_known_prefix(tokens, cache_salt, None)
    }

    /// `match_prefix` with the hashes of the tokens' full blocks given (`known`, a
    /// scheduler's request keeps them) instead of computed.
    pub(super) fn match_known_prefix(
        &mut self,
        tokens: Tokens<'_>,
        cache_salt: Option<&[u8]>,
        known: Option<&[BlockHash]>,
    ) -> PrefixMatch {
        self.scratch.hashes.clear();
        self.scratch.blocks.clear();
        self.scratch.partial.clear();
        // Filled by this lookup only: an admission holds what it finds.
        self.scratch.checkpoint.clear();
        let Tokens::Ids(ids) = tokens else {
            return PrefixMatch::default();
        };
        if !self.tiers.block_pool.enable_prefix_caching() {
            return PrefixMatch::default();
        }
        let block_size = self.block_size();
        // As in vLLM, the last prompt token is always computed, so a prompt that is an exact
        // multiple of the block size does not get its last block from the cache.
        let queries = (ids.len() - 1) / block_size;
        match known {
            Some(hashes) => {
                debug_assert_eq!(hashes.len(), ids.len() / block_size);
                self.scratch.hashes.extend_from_slice(hashes);
            }
            None => {
                let mut hashes = std::mem::take(&mut self.scratch.hashes);
                self.block_hashes(ids, cache_salt, None, &mut hashes);
                self.scratch.hashes = hashes;
            }
        }
        // One row of `queries` blocks per group: full groups' rows are filled while the hit
        // is sought, windowed groups' windows once it is known.
        let mut blocks = std::mem::take(&mut self.scratch.blocks);
        blocks.resize(self.groups.len() * queries, NULL_BLOCK);
        let (mut hits, mut limited_by) = self.longest_hit(queries, &mut blocks);
        let kv_hits = hits;
        if self.has_state() {
            hits = self.checkpoint_hit(hits, &mut limited_by);
        }
        let mut hits_queued = 0;
        for (group, spec) in self.groups.iter().enumerate() {
            let row = &mut blocks[group * queries..group * queries + hits];
            let needed_from = spec.kind.first_needed_block(hits * block_size, block_size);
            for (index, block) in row.iter_mut().enumerate() {
                if index < needed_from {
                    *block = NULL_BLOCK;
                } else if spec.kind.is_windowed() {
                    let key = group_key(self.scratch.hashes[index], group);
                    *block = self.tiers.lookup(key).unwrap_or(NULL_BLOCK);
                }
                // A host hit takes a device block to be promoted into.
                hits_queued += usize::from(
                    *block != NULL_BLOCK
                        && (host_block(*block).is_some()
                            || self.tiers.block_pool.ref_count(*block) == 0),
                );
            }
        }
        self.scratch.blocks = blocks;
        let (partial, queryable) = self.find_partial_hit(ids, hits, queries, cache_salt);
        let partial_held = self
            .scratch
            .partial
            .iter()
            .filter(|&&source| self.tiers.block_pool.ref_count(source) == 0)
            .count();
        PrefixMatch {
            queries,
            hits,
            hits_queued,
            limited_by,
            partial,
            partial_held,
            queryable,
            checkpoint_held: self.checkpoint_held(),
            kv_hits,
        }
    }

    #[inline]
    fn cached(&self, index: usize, group: usize) -> bool {
        let key = group_key(self.scratch.hashes[index], group);
        self.tiers.lookup(key).is_some()
    }

    /// The most leading blocks (at most `limit`) that every group can serve from the cache,
    /// and the (group, block) that stopped it below `limit`: a full-attention group needs all
    /// of them, a windowed group the blocks the first computed token attends to. Shrinking
    /// the hit for one windowed group can break another's window, so the groups are asked
    /// until none shrinks it (a fixed point; full groups stay satisfied by any shorter hit).
    /// Full groups' hit blocks go to their rows of `blocks` (`limit` per group).
    fn longest_hit(&self, limit: usize, blocks: &mut [u32]) -> (usize, Option<(usize, usize)>) {
        let mut hits = limit;
        let mut limited_by = None;
        for (group, spec) in self.groups.iter().enumerate() {
            if !spec.kind.is_windowed() {
                let row = &mut blocks[group * limit..(group + 1) * limit];
                if let (run, Some(missing)) = self.full_hit(group, hits, row) {
                    hits = run;
                    limited_by = Some((group, missing));
                }
            }
        }
        let mut settled = false;
        while !settled && hits > 0 {
            settled = true;
            for (group, spec) in self.groups.iter().enumerate() {
                if spec.kind.is_windowed() {
                    if let (shorter, Some(missing)) = self.window_hit(group, hits) {
                        hits = shorter;
                        limited_by = Some((group, missing));
                        settled = false;
                    }
                }
            }
        }
        (hits, limited_by)
    }

    /// A full group's leading cached blocks, at most `limit`, and the first it misses; the
    /// blocks found go to `found` (as many as it holds).
    pub(super) fn full_hit(
        &self,
        group: usize,
        limit: usize,
        found: &mut [u32],
    ) -> (usize, Option<usize>) {
        for index in 0..limit {
            let key = group_key(self.scratch.hashes[index], group);
            match self.tiers.lookup(key) {
                Some(block) => {
                    if let Some(cell) = found.get_mut(index) {
                        *cell = block;
                    }
                }
                None => return (index, Some(index)),
            }
        }
        (limit, None)
    }

    /// A windowed group's longest hit at most `limit`: the window of the first computed token
    /// is checked from its end, and a miss at `index` leaves only hits that stop at or before
    /// it. Returns the hit and the last block it missed on the way down.
    pub(super) fn window_hit(&self, group: usize, limit: usize) -> (usize, Option<usize>) {
        let kind = self.groups[group].kind;
        let block_size = self.block_size();
        let mut hits = limit;
        let mut missing = None;
        'shrink: while hits > 0 {
            let needed_from = kind.first_needed_block(hits * block_size, block_size);
            for index in (needed_from..hits).rev() {
                if !self.cached(index, group) {
                    hits = index;
                    missing = Some(index);
                    continue 'shrink;
                }
            }
            break;
        }
        (hits, missing)
    }
}

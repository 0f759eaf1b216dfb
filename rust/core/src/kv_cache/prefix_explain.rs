//! Why a prefix lookup stops where it does: per group, what it alone could serve and why it
//! stops there; for the lookup, the group that limits it and its reason. Admissions count
//! their misses by reason (`stats()`), so a hit rate that collapses says why.

use super::keys::group_key;
use super::state_checkpoints::STATE_LIMIT;
use super::{KvCache, Medium, Tokens};
use crate::error::CoreResult;

/// Why a prefix hit stops where it does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum MissReason {
    /// Every full block before the last prompt token is served: the hit ends where block
    /// alignment ends it (the last token is always computed; a partial block is cached only
    /// by its pieces, with `hash_block_size`).
    BlockAlignment = 0,
    /// The next block was never cached (or was evicted longer ago than the history reaches).
    NotCached = 1,
    /// The next block was cached and evicted.
    Evicted = 2,
    /// A windowed group lacks a block inside the window of the next hit point: released by
    /// its window and evicted since, or never cached.
    WindowGone = 3,
    /// The cache was built without prefix caching.
    PrefixCachingOff = 4,
    /// A recurrent layer has no state kept at the end of a longer hit: the hit ends at the
    /// last checkpoint the K/V reaches (see `state_checkpoints`), or at none where the cache
    /// keeps none.
    StateCheckpoint = 5,
}

impl MissReason {
    /// The reasons `stats()` counts misses by.
    pub const COUNTED: [MissReason; 5] = [
        MissReason::BlockAlignment,
        MissReason::NotCached,
        MissReason::Evicted,
        MissReason::WindowGone,
        MissReason::StateCheckpoint,
    ];

    pub fn name(self) -> &'static str {
        match self {
            MissReason::BlockAlignment => "block_alignment",
            MissReason::NotCached => "not_cached",
            MissReason::Evicted => "evicted",
            MissReason::WindowGone => "window",
            MissReason::PrefixCachingOff => "prefix_caching_off",
            MissReason::StateCheckpoint => "state_checkpoint",
        }
    }

    /// The reason named `name` (as [`MissReason::name`] says it).
    pub fn from_name(name: &str) -> Option<MissReason> {
        [MissReason::PrefixCachingOff]
            .into_iter()
            .chain(MissReason::COUNTED)
            .find(|reason| reason.name() == name)
    }
}

/// What one group alone could serve of a prompt, and why it stops there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupPrefix {
    pub cached_tokens: usize,
    pub reason: MissReason,
}

/// The answer of [`KvCache::explain_prefix`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixExplanation {
    /// What an admission now would take from the cache (every group can serve it).
    pub hit_tokens: usize,
    /// Why it stops there, and the group that stops it (`None`: alignment, or caching off).
    pub reason: MissReason,
    pub limited_by: Option<usize>,
    pub groups: Vec<GroupPrefix>,
    /// Where the hit comes from, in order: runs of (medium, tokens) that sum to
    /// `hit_tokens`; a block some group would promote from the host tier counts as `Host`.
    pub tiers: Vec<(Medium, usize)>,
    /// Of `hit_tokens`, those past the last whole block, copied from a cached block that
    /// starts with them (`hash_block_size`); a lookup at whole blocks would recompute them.
    pub partial_tokens: usize,
}

impl KvCache {
    /// Explains the prefix hit `token_ids` would get now, without changing anything.
    pub fn explain_prefix(
        &mut self,
        token_ids: &[u32],
        cache_salt: Option<&[u8]>,
    ) -> CoreResult<PrefixExplanation> {
        ensure!(!token_ids.is_empty(), "token_ids must hold at least one id");
        let unserved = match (self.enable_prefix_caching(), self.has_state()) {
            (false, _) => Some(MissReason::PrefixCachingOff),
            (true, true) if !self.keeps_state_checkpoints() => Some(MissReason::StateCheckpoint),
            (true, _) => None,
        };
        if let Some(reason) = unserved {
            let off = GroupPrefix {
                cached_tokens: 0,
                reason,
            };
            return Ok(PrefixExplanation {
                hit_tokens: 0,
                reason,
                limited_by: None,
                groups: vec![off; self.groups.len()],
                tiers: Vec::new(),
                partial_tokens: 0,
            });
        }
        let mut found = self.match_prefix(Tokens::Ids(token_ids), cache_salt);
        let block_size = self.block_size();
        // A partial hit that would not fit now is not what an admission now would get.
        let (num_blocks, free) = (token_ids.len().div_ceil(block_size), self.num_free_blocks());
        let scratch = (&mut self.scratch.partial, &mut self.scratch.checkpoint);
        found.need(
            num_blocks,
            self.groups.len(),
            free,
            self.states.blocks_per_seq,
            scratch,
        );
        let groups = (0..self.groups.len())
            .map(|group| {
                let (cached, missing) = match self.groups[group].kind.is_windowed() {
                    false => self.full_hit(group, found.queries, &mut []),
                    true => self.window_hit(group, found.queries),
                };
                GroupPrefix {
                    cached_tokens: cached * block_size,
                    reason: self.miss_reason(missing.map(|index| (group, index))),
                }
            })
            .collect();
        let mut tiers: Vec<(Medium, usize)> = Vec::new();
        let runs =
            (0..found.hits).map(
                |index| match self.host_hit_blocks_at(found.queries, index) {
                    true => (Medium::Host, block_size),
                    false => (Medium::Device, block_size),
                },
            );
        let partial = (found.partial > 0).then_some((Medium::Device, found.partial));
        for (medium, length) in runs.chain(partial) {
            match tiers.last_mut() {
                Some((last, tokens)) if *last == medium => *tokens += length,
                _ => tiers.push((medium, length)),
            }
        }
        // What the lookup found is no admission's to take.
        self.scratch.checkpoint.clear();
        Ok(PrefixExplanation {
            tiers,
            partial_tokens: found.partial,
            hit_tokens: found.hits * block_size + found.partial,
            reason: self.miss_reason(found.limited_by),
            limited_by: found
                .limited_by
                .map(|(group, _)| group)
                .filter(|&group| group != STATE_LIMIT),
            groups,
        })
    }

    /// Why a lookup stopped, from the group and block index that stopped it.
    pub(super) fn miss_reason(&self, limited_by: Option<(usize, usize)>) -> MissReason {
        let Some((group, index)) = limited_by else {
            return MissReason::BlockAlignment;
        };
        if group == STATE_LIMIT {
            return MissReason::StateCheckpoint;
        }
        if self.groups[group].kind.is_windowed() {
            return MissReason::WindowGone;
        }
        let key = group_key(self.scratch.hashes[index], group);
        match self.tiers.block_pool.was_evicted(key) {
            true => MissReason::Evicted,
            false => MissReason::NotCached,
        }
    }

    /// Counts an admission's miss (a hit short of what block alignment allows, or a prompt
    /// too short to hit at all) by reason.
    pub(super) fn count_miss(&mut self, queries: usize, hits: usize, by: Option<(usize, usize)>) {
        if hits < queries || queries == 0 {
            let reason = self.miss_reason(by);
            self.prefix_stats.count_miss(reason);
        }
    }

    /// Records a prefix lookup of token ids: `queries` full blocks asked, `hits` served, and
    /// (with prefix caching) the miss's reason.
    pub(super) fn record_lookup(
        &mut self,
        queries: usize,
        hits: usize,
        limited_by: Option<(usize, usize)>,
    ) {
        if self.enable_prefix_caching() {
            self.count_miss(queries, hits, limited_by);
        }
        self.tiers.block_pool.record_lookups(queries, hits);
        self.prefix_stats
            .count_lookup(queries, hits, self.tiers.block_pool.block_size());
    }
}

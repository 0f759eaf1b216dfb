//! What a request asks the prefix cache to keep: token ranges with a retention priority and
//! a duration, and one for the tokens it generates (TensorRT-LLM's `KvCacheRetentionConfig`).
//!
//! A token asks for the highest priority of the ranges that hold it (the config's default
//! where none does); a full block takes its least wanted token's when it joins the cache,
//! and raises cached blocks the sequence hits to it. The `priority` eviction policy (the
//! default) evicts the lowest priority first; the other policies keep no priorities and
//! refuse a config that asks for any.

use super::KvCache;
use crate::alloc::{EvictionPolicy, DEFAULT_PRIORITY, MAX_PRIORITY, NULL_BLOCK};
use crate::error::CoreResult;

/// Tokens `start..end` (`end: None`: to the end of the prompt) get `priority` for
/// `duration_ns` (`None`: as long as the block is cached).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenRetention {
    pub start: usize,
    pub end: Option<usize>,
    pub priority: u8,
    pub duration_ns: Option<u64>,
}

/// A request's retention: its token ranges, the priority (and duration) of the tokens from
/// `decode_from` on (generated ones), and the priority of tokens nothing else covers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetentionConfig {
    pub ranges: Vec<TokenRetention>,
    pub decode: Option<(u8, Option<u64>)>,
    pub decode_from: usize,
    pub default_priority: u8,
}

/// What a sequence that asked for nothing keeps.
pub(super) static NO_RETENTION: RetentionConfig = RetentionConfig {
    ranges: Vec::new(),
    decode: None,
    decode_from: usize::MAX,
    default_priority: DEFAULT_PRIORITY,
};

impl Default for RetentionConfig {
    fn default() -> Self {
        NO_RETENTION.clone()
    }
}

/// Most token ranges one request's retention takes: each block that joins the cache looks
/// at every range, under the cache's lock.
pub const MAX_RETENTION_RANGES: usize = 64;

impl RetentionConfig {
    pub fn validate(&self) -> CoreResult<()> {
        ensure!(
            self.ranges.len() <= MAX_RETENTION_RANGES,
            "a retention takes at most {MAX_RETENTION_RANGES} token ranges, got {}",
            self.ranges.len()
        );
        let priorities = self.ranges.iter().map(|range| range.priority);
        let decode = self.decode.map(|(priority, _)| priority);
        for priority in priorities.chain(decode).chain([self.default_priority]) {
            ensure!(
                priority <= MAX_PRIORITY,
                "retention priorities run from 0 to {MAX_PRIORITY}, got {priority}"
            );
        }
        for range in &self.ranges {
            ensure!(
                range.end.is_none_or(|end| end > range.start),
                "a retention range ends after it starts, got {}..{:?}",
                range.start,
                range.end
            );
        }
        Ok(())
    }

    /// Whether it asks for anything a cache without priorities would not do anyway.
    pub fn asks_for_retention(&self) -> bool {
        !self.ranges.is_empty()
            || self.decode.is_some()
            || self.default_priority != DEFAULT_PRIORITY
    }

    fn has_durations(&self) -> bool {
        let ranges = self.ranges.iter().map(|range| range.duration_ns);
        let decode = self.decode.map(|(_, duration)| duration);
        ranges.chain(decode).any(|duration| duration.is_some())
    }

    /// What token `t` asks for: the highest of the ranges (and the decode retention) that
    /// hold it, the longest of those on a tie, the default where none does.
    fn for_token(&self, t: usize) -> (u8, Option<u64>) {
        let mut best: Option<(u8, Option<u64>)> = None;
        let mut consider = |priority: u8, duration: Option<u64>| {
            if best.is_none_or(|top| wanted((priority, duration)) > wanted(top)) {
                best = Some((priority, duration));
            }
        };
        for range in &self.ranges {
            if range.start <= t && range.end.map_or(t < self.decode_from, |end| t < end) {
                consider(range.priority, range.duration_ns);
            }
        }
        if let Some((priority, duration)) = self.decode {
            if t >= self.decode_from {
                consider(priority, duration);
            }
        }
        best.unwrap_or((self.default_priority, None))
    }

    /// The priority and duration for the block of tokens `start..end`: its least wanted
    /// token's. A block is reused only whole, so a block a system prompt's pin ends in
    /// (with every request's own message after it) is worth no more than that message.
    fn for_tokens(&self, start: usize, end: usize) -> (u8, Option<u64>) {
        // What a token asks for changes only where a range (or the decode) starts or ends.
        let bounds = self
            .ranges
            .iter()
            .flat_map(|range| [Some(range.start), range.end.or(Some(self.decode_from))]);
        let decode = self.decode.map(|_| self.decode_from);
        let pieces = bounds
            .flatten()
            .chain(decode)
            .filter(|&t| start < t && t < end);
        let mut least = self.for_token(start);
        for t in pieces {
            let asked = self.for_token(t);
            if wanted(asked) < wanted(least) {
                least = asked;
            }
        }
        least
    }
}

/// How much a priority for a duration is wanted: the higher priority, then the longer
/// duration (none: for as long as the block is cached).
fn wanted((priority, duration): (u8, Option<u64>)) -> (u8, u64) {
    (priority, duration.unwrap_or(u64::MAX))
}

impl KvCache {
    /// Sets what `seq_id` asks the cache to keep (see the module docs); the cached blocks
    /// it holds take it now (a hit raises them), the rest when they join the cache.
    /// `decode_from` past the sequence's length means its current length.
    pub fn set_retention(&mut self, seq_id: u64, config: &RetentionConfig) -> CoreResult<()> {
        self.prepare_retention(config)?;
        let slab = self.slab_of(seq_id)?;
        let KvCache {
            sequences, tiers, ..
        } = self;
        let block_pool = &mut tiers.block_pool;
        let seq = &mut sequences[slab];
        seq.keep_retention(config);
        if seq.is_swapped() || block_pool.eviction_policy() != EvictionPolicy::Priority {
            return Ok(());
        }
        let retention = seq.retention().unwrap_or(&NO_RETENTION);
        let block_size = block_pool.block_size();
        let named = seq.num_registered().min(seq.hashes().len());
        for table in seq.tables() {
            for (index, &block) in table.blocks()[..named].iter().enumerate() {
                if block != NULL_BLOCK {
                    let (priority, duration) =
                        retention.for_tokens(index * block_size, (index + 1) * block_size);
                    block_pool.retain(block, priority, duration, false);
                }
            }
        }
        Ok(())
    }

    /// Refuses a bad `config`, or one that asks for retention from a cache whose eviction
    /// policy keeps no priorities (a request that asks to be kept is kept, or told why
    /// not); reserves what its durations will take, so that no later step allocates for it.
    pub fn prepare_retention(&mut self, config: &RetentionConfig) -> CoreResult<()> {
        config.validate()?;
        let policy = self.eviction_policy();
        ensure!(
            policy == EvictionPolicy::Priority || !config.asks_for_retention(),
            "retention needs eviction_policy='priority' (the default); this cache evicts by \
             '{}', which keeps no priorities",
            policy.name()
        );
        if config.asks_for_retention() {
            self.tiers.block_pool.keep_priorities()?;
        }
        if config.has_durations() {
            self.tiers.block_pool.reserve_expiries()?;
        }
        Ok(())
    }

    /// Moves the retention clock to `now_ns` (it never goes back): priorities given for a
    /// duration that has ended fall back to the default.
    pub fn advance_clock(&mut self, now_ns: u64) {
        self.tiers.block_pool.advance_clock(now_ns);
    }
}

/// Gives `block`, just cached as block `index` of a sequence with `config`, its priority.
pub(super) fn retain_joined(
    block_pool: &mut crate::alloc::BlockPool,
    config: Option<&RetentionConfig>,
    index: usize,
    block: u32,
) {
    // Without a config it keeps the default priority its last contents left it with: the
    // default policy's common case costs nothing here.
    let Some(config) = config else {
        return;
    };
    if block_pool.eviction_policy() == EvictionPolicy::Priority {
        let block_size = block_pool.block_size();
        let (priority, duration) = config.for_tokens(index * block_size, (index + 1) * block_size);
        block_pool.retain(block, priority, duration, true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_takes_its_least_wanted_tokens_priority() {
        let config = RetentionConfig {
            ranges: vec![
                TokenRetention {
                    start: 0,
                    end: Some(20),
                    priority: 100,
                    duration_ns: None,
                },
                TokenRetention {
                    start: 16,
                    end: Some(24),
                    priority: 10,
                    duration_ns: Some(5),
                },
            ],
            decode: Some((60, Some(7))),
            decode_from: 32,
            default_priority: 35,
        };
        // Tokens 0..20 ask for 100; 16..24 for the higher of what holds them (100 to 20,
        // then 10); 24..32 for the default; from 32 on for the decode retention.
        assert_eq!(config.for_tokens(0, 8), (100, None));
        assert_eq!(config.for_tokens(8, 16), (100, None));
        assert_eq!(config.for_tokens(16, 24), (10, Some(5)));
        assert_eq!(config.for_tokens(24, 32), (35, None));
        assert_eq!(config.for_tokens(28, 36), (35, None));
        assert_eq!(config.for_tokens(32, 40), (60, Some(7)));
        assert_eq!(RetentionConfig::default().for_tokens(0, 8), (35, None));
    }

    #[test]
    fn on_a_tie_the_longer_duration_holds() {
        let range = |duration_ns| TokenRetention {
            start: 0,
            end: Some(16),
            priority: 100,
            duration_ns,
        };
        for ranges in [
            vec![range(Some(300)), range(None)],
            vec![range(None), range(Some(300))],
            vec![range(Some(300)), range(Some(900))],
        ] {
            let longest = ranges
                .iter()
                .map(|range| wanted((100, range.duration_ns)))
                .max();
            let config = RetentionConfig {
                ranges,
                ..RetentionConfig::default()
            };
            assert_eq!(Some(wanted(config.for_tokens(0, 8))), longest);
        }
    }
}

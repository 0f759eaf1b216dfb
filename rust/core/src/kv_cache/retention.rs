//! What a request asks the prefix cache to keep: token ranges with a retention priority and
//! a duration, and one for the tokens it generates (TensorRT-LLM's `KvCacheRetentionConfig`).
//!
//! A sequence's full blocks take the highest priority of the ranges that touch them (the
//! config's default where none does) when they join the cache, and raise cached blocks the
//! sequence hits. The `priority` eviction policy evicts the lowest priority first; the other
//! policies keep no priorities, and a config changes nothing there.

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

impl RetentionConfig {
    pub fn validate(&self) -> CoreResult<()> {
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

    /// The priority and duration for the block of tokens `start..end`: the highest of what
    /// touches it.
    fn for_tokens(&self, start: usize, end: usize) -> (u8, Option<u64>) {
        let mut best = (self.default_priority, None);
        let mut consider = |priority: u8, duration: Option<u64>| {
            if priority > best.0 {
                best = (priority, duration);
            }
        };
        for range in &self.ranges {
            let range_end = range.end.unwrap_or(self.decode_from);
            if range.start < end && start < range_end {
                consider(range.priority, range.duration_ns);
            }
        }
        if let Some((priority, duration)) = self.decode {
            if end > self.decode_from {
                consider(priority, duration);
            }
        }
        best
    }
}

impl KvCache {
    /// Sets what `seq_id` asks the cache to keep (see the module docs); the cached blocks
    /// it holds take it now (a hit raises them), the rest when they join the cache.
    /// `decode_from` past the sequence's length means its current length.
    pub fn set_retention(&mut self, seq_id: u64, config: &RetentionConfig) -> CoreResult<()> {
        config.validate()?;
        let slab = self.slab_of(seq_id)?;
        let KvCache {
            sequences,
            block_pool,
            ..
        } = self;
        let seq = &mut sequences[slab];
        let kept = match seq.retention.as_mut() {
            Some(kept) => {
                RetentionConfig::clone_from(kept, config);
                kept
            }
            None => seq.retention.insert(Box::new(config.clone())),
        };
        kept.decode_from = config.decode_from.min(seq.num_tokens);
        if seq.swapped || block_pool.eviction_policy() != EvictionPolicy::Priority {
            return Ok(());
        }
        let retention = seq.retention.as_deref().unwrap_or(&NO_RETENTION);
        let block_size = block_pool.block_size();
        let named = seq.num_registered.min(seq.hashes.len());
        for table in &seq.tables {
            for (index, &block) in table.blocks[..named].iter().enumerate() {
                if block != NULL_BLOCK {
                    let (priority, duration) =
                        retention.for_tokens(index * block_size, (index + 1) * block_size);
                    block_pool.retain(block, priority, duration, false);
                }
            }
        }
        Ok(())
    }

    /// Moves the retention clock to `now_ns` (it never goes back): priorities given for a
    /// duration that has ended fall back to the default.
    pub fn advance_clock(&mut self, now_ns: u64) {
        self.block_pool.advance_clock(now_ns);
    }
}

/// Gives `block`, just cached as block `index` of a sequence with `config`, its priority.
pub(super) fn retain_joined(
    block_pool: &mut crate::alloc::BlockPool,
    config: Option<&RetentionConfig>,
    index: usize,
    block: u32,
) {
    if block_pool.eviction_policy() == EvictionPolicy::Priority {
        let config = config.unwrap_or(&NO_RETENTION);
        let block_size = block_pool.block_size();
        let (priority, duration) = config.for_tokens(index * block_size, (index + 1) * block_size);
        block_pool.retain(block, priority, duration, true);
    }
}

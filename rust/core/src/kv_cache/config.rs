//! Everything a cache is built with, in one value: `KvCache::from_config` applies it in the
//! order the parts need (the block pool with its eviction policy first, then what is set once
//! before any sequence exists), so no caller has to know that order.

use super::{AttentionKind, KvCache, LayerKind};
use crate::alloc::EvictionPolicy;
use crate::error::CoreResult;
use crate::layout::KvLayout;

#[derive(Debug, Clone)]
pub struct KvCacheConfig {
    pub num_blocks: usize,
    pub block_size: usize,
    pub layout: KvLayout,
    pub enable_prefix_caching: bool,
    /// What each layer keeps (`None`: every layer attends to every earlier position).
    pub layer_kinds: Option<Vec<LayerKind>>,
    pub eviction_policy: EvictionPolicy,
    /// Prefix keys every this many tokens, a divisor of `block_size` (`None`: per block).
    pub hash_block_size: Option<usize>,
    /// Blocks between two checkpoints of a sequence's recurrent states (`None`: the default).
    pub state_checkpoint_interval: Option<usize>,
    /// A host tier of this many blocks (swaps, and with `host_prefix_cache` evicted prefixes).
    pub num_host_blocks: Option<usize>,
    pub host_prefix_cache: bool,
    pub enable_kv_events: bool,
}

impl KvCacheConfig {
    /// `num_blocks` blocks of `block_size` tokens for `layout`, every other setting at its
    /// default.
    pub fn new(num_blocks: usize, block_size: usize, layout: KvLayout) -> Self {
        KvCacheConfig {
            num_blocks,
            block_size,
            layout,
            enable_prefix_caching: true,
            layer_kinds: None,
            eviction_policy: EvictionPolicy::default(),
            hash_block_size: None,
            state_checkpoint_interval: None,
            num_host_blocks: None,
            host_prefix_cache: false,
            enable_kv_events: false,
        }
    }
}

impl KvCache {
    /// The cache `config` describes. Fails, with the setting named, on the first setting it
    /// refuses.
    pub fn from_config(config: &KvCacheConfig) -> CoreResult<Self> {
        let all_full;
        let kinds = match &config.layer_kinds {
            Some(kinds) => kinds.as_slice(),
            None => {
                let layers = config.layout.num_layers;
                all_full = vec![LayerKind::Attention(AttentionKind::Full); layers];
                all_full.as_slice()
            }
        };
        // Built with its policy, not rebuilt: a block pool replaced after the fact sat apart
        // from the rest, and cost the decode step a quarter (benches/ab_compare.py).
        let mut cache = KvCache::with_policy(
            config.num_blocks,
            config.block_size,
            config.layout,
            config.enable_prefix_caching,
            kinds,
            config.eviction_policy,
        )?;
        if let Some(hash_block_size) = config.hash_block_size {
            cache.set_hash_block_size(hash_block_size)?;
        }
        if let Some(interval) = config.state_checkpoint_interval {
            cache.set_state_checkpoint_interval(interval)?;
        }
        if let Some(num_host_blocks) = config.num_host_blocks {
            cache.enable_host_tier(num_host_blocks)?;
        }
        if config.host_prefix_cache {
            cache.enable_host_prefix_cache()?;
        }
        if config.enable_kv_events {
            cache.enable_kv_events()?;
        }
        Ok(cache)
    }
}

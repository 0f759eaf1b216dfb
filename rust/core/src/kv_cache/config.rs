//! Everything a cache is built with, in one value, and the one way to build a cache:
//! `KvCache::from_config` (or [`KvCacheConfig::build`]) builds the block pool with its
//! eviction policy, then applies what is set once before any sequence exists, in the order
//! the parts need, so no caller has to know that order.
//!
//! ```
//! use atb_mem_core::{AttentionKind, EvictionPolicy, KvCacheConfig, KvLayout};
//!
//! let layout = KvLayout { num_layers: 2, ..KvLayout::default() };
//! let cache = KvCacheConfig::new(64, 16, layout)
//!     .layer_kinds(&[AttentionKind::Full, AttentionKind::SlidingWindow { window: 32 }])
//!     .eviction_policy(EvictionPolicy::Lru)
//!     .host_blocks(32)
//!     .host_prefix_cache(true)
//!     .kv_events(true)
//!     .build()
//!     .unwrap();
//! assert_eq!(cache.num_host_blocks(), 32);
//! ```

use super::state::{self, RecurrentStates};
use super::stats::PrefixStats;
use super::{
    group_hybrid_layers, AttentionKind, KvCache, LayerGroups, LayerKind, SequenceTable, Tiers,
};
use crate::alloc::{BlockPool, EvictionPolicy};
use crate::error::{CoreError, CoreResult};
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
    /// default: prefix caching on, every layer attending fully, the default eviction policy,
    /// no host tier, no KV events.
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

    /// Whether full blocks are cached by their tokens' hashes and found again.
    pub fn prefix_caching(mut self, enable: bool) -> Self {
        self.enable_prefix_caching = enable;
        self
    }

    /// Layer `l` attends (or keeps a state) as `kinds[l]` says: layers are grouped by kind
    /// (see [`group_hybrid_layers`]), and a block holds the K/V (or states) of one group's
    /// layers.
    pub fn layer_kinds<K: Copy + Into<LayerKind>>(mut self, kinds: &[K]) -> Self {
        self.layer_kinds = Some(kinds.iter().map(|&kind| kind.into()).collect());
        self
    }

    /// The prefix cache evicts by `policy` (see [`EvictionPolicy`]).
    pub fn eviction_policy(mut self, policy: EvictionPolicy) -> Self {
        self.eviction_policy = policy;
        self
    }

    /// Prefix hits at every `tokens` tokens, not only at block boundaries (see
    /// `partial_hits`): `tokens` must divide the block size, and every group attend fully.
    pub fn hash_block_size(mut self, tokens: usize) -> Self {
        self.hash_block_size = Some(tokens);
        self
    }

    /// Checkpoints of a sequence's recurrent states every `blocks` blocks (see
    /// `state_checkpoints`).
    pub fn state_checkpoint_interval(mut self, blocks: usize) -> Self {
        self.state_checkpoint_interval = Some(blocks);
        self
    }

    /// A host tier of `blocks` blocks that `swap_out` moves sequences to.
    pub fn host_blocks(mut self, blocks: usize) -> Self {
        self.num_host_blocks = Some(blocks);
        self
    }

    /// Whether the host tier keeps the cached blocks the device evicts, where a later prefix
    /// lookup finds them (needs a host tier and prefix caching).
    pub fn host_prefix_cache(mut self, enable: bool) -> Self {
        self.host_prefix_cache = enable;
        self
    }

    /// Whether prefix-cache membership changes are recorded (see `KvCache::take_kv_events`).
    pub fn kv_events(mut self, enable: bool) -> Self {
        self.enable_kv_events = enable;
        self
    }

    /// The cache this config describes: [`KvCache::from_config`].
    pub fn build(&self) -> CoreResult<KvCache> {
        KvCache::from_config(self)
    }
}

impl KvCache {
    /// The cache `config` describes. Fails, with the setting named, on the first setting it
    /// refuses.
    pub fn from_config(config: &KvCacheConfig) -> CoreResult<Self> {
        // Built with its policy, never rebuilt: a block pool replaced after the fact sat
        // apart from the rest, and cost the decode step a quarter (benches/ab_compare.py).
        let mut cache = KvCache::with_pool(config)?;
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

    /// The cache of `config`'s blocks, layout, layer kinds and eviction policy, before the
    /// settings made once on top of them.
    fn with_pool(config: &KvCacheConfig) -> CoreResult<Self> {
        let &KvCacheConfig {
            num_blocks,
            block_size,
            layout,
            enable_prefix_caching,
            eviction_policy,
            ..
        } = config;
        layout.validate()?;
        let all_full;
        let kinds = match &config.layer_kinds {
            Some(kinds) => kinds.as_slice(),
            None => {
                all_full = vec![LayerKind::Attention(AttentionKind::Full); layout.num_layers];
                all_full.as_slice()
            }
        };
        ensure!(
            kinds.len() == layout.num_layers,
            "layer_types names {} layers; the model has num_layers = {}",
            kinds.len(),
            layout.num_layers
        );
        let LayerGroups {
            attention: groups,
            recurrent,
            layers_per_block,
        } = group_hybrid_layers(kinds)?;
        let block_pool = BlockPool::with_policy(
            num_blocks,
            block_size,
            enable_prefix_caching,
            eviction_policy,
        )?;
        let block_layout = KvLayout {
            num_layers: layers_per_block,
            ..layout
        };
        let bytes_per_block = block_layout.bytes_per_block(block_size).ok_or_else(|| {
            CoreError::invalid(
                "bytes per block (2 × layers × block_size × heads × head_dim × itemsize) overflows",
            )
        })?;
        let state_groups = state::state_groups(recurrent, bytes_per_block / layers_per_block);
        let state_blocks: usize = state_groups.iter().map(|group| group.num_blocks).sum();
        ensure!(
            state_blocks < num_blocks - 1,
            "one sequence's recurrent states take {state_blocks} blocks of this pool, which has \
             {} usable: give it more blocks, or larger ones",
            num_blocks - 1
        );
        // A checkpoint per as many blocks of K/V as it takes (see `state_checkpoints`).
        let checkpoint_interval = state_blocks.div_ceil(groups.len().max(1)).max(1);
        let mut cache = KvCache {
            tiers: Tiers::new(block_pool),
            layout,
            groups,
            layers_per_block,
            bytes_per_block,
            max_seq_tokens: 0,
            states: RecurrentStates {
                groups: state_groups,
                blocks_per_seq: state_blocks,
                checkpoint_interval,
            },
            sequences: SequenceTable::default(),
            prefix_stats: PrefixStats::default(),
            deferred_sub_blocks: Default::default(),
            scratch: Default::default(),
            undo: Default::default(),
        };
        cache.max_seq_tokens = cache.tokens_in_blocks(num_blocks - 1);
        Ok(cache)
    }
}

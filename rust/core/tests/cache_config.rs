//! A cache built from one `KvCacheConfig` is the cache the setters build in their order, and
//! a setting it refuses is named.

use atb_mem_core::{
    AttentionKind, EvictionPolicy, KvCache, KvCacheConfig, KvDtype, KvLayout, LayerKind,
};

#[path = "support/state.rs"]
mod state;
use state::cache_state;

fn layout() -> KvLayout {
    KvLayout {
        num_layers: 4,
        num_kv_heads: 2,
        head_dim: 8,
        dtype: KvDtype::BFloat16,
    }
}

fn kinds() -> Vec<LayerKind> {
    let state = LayerKind::Recurrent { state_bytes: 512 };
    let window = LayerKind::Attention(AttentionKind::SlidingWindow { window: 16 });
    let full = LayerKind::Attention(AttentionKind::Full);
    vec![state, window, full, full]
}

#[test]
fn a_config_builds_what_the_setters_build() {
    let config = KvCacheConfig {
        layer_kinds: Some(kinds()),
        eviction_policy: EvictionPolicy::Lfu,
        state_checkpoint_interval: Some(2),
        num_host_blocks: Some(32),
        host_prefix_cache: true,
        enable_kv_events: true,
        ..KvCacheConfig::new(256, 8, layout())
    };
    let built = KvCache::from_config(&config).unwrap();
    let mut by_hand =
        KvCache::with_policy(256, 8, layout(), true, &kinds(), EvictionPolicy::Lfu).unwrap();
    by_hand.set_state_checkpoint_interval(2).unwrap();
    by_hand.enable_host_tier(32).unwrap();
    by_hand.enable_host_prefix_cache().unwrap();
    by_hand.enable_kv_events().unwrap();
    assert_eq!(cache_state(&built), cache_state(&by_hand));
    // Keys finer than a block serve full-attention layers only.
    let pieces = KvCacheConfig {
        hash_block_size: Some(4),
        num_host_blocks: Some(8),
        host_prefix_cache: true,
        ..KvCacheConfig::new(64, 16, KvLayout::default())
    };
    let mut by_hand = KvCache::new(64, 16, KvLayout::default(), true).unwrap();
    by_hand.set_hash_block_size(4).unwrap();
    by_hand.enable_host_tier(8).unwrap();
    by_hand.enable_host_prefix_cache().unwrap();
    assert_eq!(
        cache_state(&KvCache::from_config(&pieces).unwrap()),
        cache_state(&by_hand)
    );
}

#[test]
fn a_refused_setting_is_named() {
    let base = KvCacheConfig::new(64, 8, layout());
    let refused = [
        (
            KvCacheConfig {
                hash_block_size: Some(3),
                ..base.clone()
            },
            "hash_block_size",
        ),
        (
            KvCacheConfig {
                host_prefix_cache: true,
                ..base.clone()
            },
            "host",
        ),
        (
            KvCacheConfig {
                layer_kinds: Some(vec![LayerKind::Attention(AttentionKind::Full)]),
                ..base.clone()
            },
            "layer",
        ),
    ];
    for (config, named) in refused {
        let error = KvCache::from_config(&config).unwrap_err().to_string();
        assert!(error.contains(named), "{named}: {error}");
    }
}

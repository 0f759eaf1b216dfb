//! A cache built from a `KvCacheConfig`'s chained settings is the cache its fields
//! describe, with every setting applied, and a setting it refuses is named.

use atb_mem_core::{
    AttentionKind, EvictionPolicy, KvCache, KvCacheConfig, KvCacheDtype, KvDtype, KvLayout,
    LayerKind,
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
        cache_dtype: KvCacheDtype::Auto,
    }
}

fn kinds() -> Vec<LayerKind> {
    let state = LayerKind::Recurrent { state_bytes: 512 };
    let window = LayerKind::Attention(AttentionKind::SlidingWindow { window: 16 });
    let full = LayerKind::Attention(AttentionKind::Full);
    vec![state, window, full, full]
}

#[test]
fn a_config_builds_what_its_settings_say() {
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
    let chained = KvCacheConfig::new(256, 8, layout())
        .layer_kinds(&kinds())
        .eviction_policy(EvictionPolicy::Lfu)
        .state_checkpoint_interval(2)
        .host_blocks(32)
        .host_prefix_cache(true)
        .kv_events(true)
        .build()
        .unwrap();
    assert_eq!(cache_state(&built), cache_state(&chained));
    assert_eq!(built.eviction_policy(), EvictionPolicy::Lfu);
    assert_eq!(built.state_checkpoint_interval(), 2);
    assert_eq!(built.num_host_blocks(), 32);
    assert!(built.host_prefix_cache() && built.kv_events_enabled());
    // Keys finer than a block serve full-attention layers only.
    let pieces = KvCacheConfig {
        hash_block_size: Some(4),
        num_host_blocks: Some(8),
        host_prefix_cache: true,
        ..KvCacheConfig::new(64, 16, KvLayout::default())
    };
    let chained = KvCacheConfig::new(64, 16, KvLayout::default())
        .hash_block_size(4)
        .host_blocks(8)
        .host_prefix_cache(true)
        .build()
        .unwrap();
    let built = KvCache::from_config(&pieces).unwrap();
    assert_eq!(cache_state(&built), cache_state(&chained));
    assert_eq!(built.hash_block_size(), 4);
    assert_eq!(built.num_host_blocks(), 8);
    assert!(built.host_prefix_cache() && !built.kv_events_enabled());
    // Every setting left out is at its default.
    let plain = KvCacheConfig::new(64, 16, KvLayout::default())
        .build()
        .unwrap();
    assert!(plain.enable_prefix_caching());
    assert_eq!(plain.eviction_policy(), EvictionPolicy::default());
    assert_eq!((plain.hash_block_size(), plain.num_host_blocks()), (16, 0));
    assert!(!plain.host_prefix_cache() && !plain.kv_events_enabled());
    let off = KvCacheConfig::new(64, 16, KvLayout::default()).prefix_caching(false);
    assert!(!off.build().unwrap().enable_prefix_caching());
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
        (
            base.clone().state_checkpoint_interval(0),
            "state_checkpoint_interval",
        ),
        (base.clone().host_blocks(0), "num_host_blocks"),
        (
            base.clone()
                .prefix_caching(false)
                .host_blocks(4)
                .host_prefix_cache(true),
            "prefix caching",
        ),
    ];
    for (config, named) in refused {
        let error = KvCache::from_config(&config).unwrap_err().to_string();
        assert!(error.contains(named), "{named}: {error}");
    }
}

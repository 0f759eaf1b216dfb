//! A hybrid cache with recurrent states, as the directed tests of states share it.

use atb_mem_core::{
    AttentionKind, KvCache, KvCacheConfig, KvCacheDtype, KvDtype, KvLayout, LayerKind,
};

pub const BLOCK_SIZE: usize = 4;
/// Bytes of one layer's K/V slot in a block: 2 × 4 tokens × 1 head × 2 dims × 2 bytes.
pub const SLOT_BYTES: usize = 32;

/// Layers `[recurrent, recurrent, full, recurrent, recurrent, full]`, each state 2.5 slots:
/// groups of two layers, two state groups of three blocks each (6 state blocks a sequence),
/// a checkpoint at every block, and a host tier of 32 blocks.
pub fn hybrid(num_blocks: usize) -> KvCache {
    hybrid_config(num_blocks).build().unwrap()
}

/// The config `hybrid` builds, to change a setting of it.
pub fn hybrid_config(num_blocks: usize) -> KvCacheConfig {
    let state = LayerKind::Recurrent {
        state_bytes: SLOT_BYTES * 5 / 2,
    };
    let full = LayerKind::Attention(AttentionKind::Full);
    let kinds = [state, state, full, state, state, full];
    let layout = KvLayout {
        num_layers: kinds.len(),
        num_kv_heads: 1,
        head_dim: 2,
        dtype: KvDtype::Float16,
        cache_dtype: KvCacheDtype::Auto,
    };
    let config = KvCacheConfig::new(num_blocks, BLOCK_SIZE, layout).layer_kinds(&kinds);
    // A checkpoint takes 6 blocks, one group's K/V one: by default one per 6 blocks.
    assert_eq!(config.build().unwrap().state_checkpoint_interval(), 6);
    config.state_checkpoint_interval(1).host_blocks(32)
}

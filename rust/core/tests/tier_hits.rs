//! Prefix hits a tier below the host served (its load landed after the admission's lookup):
//! `stats` counts them as hits, with their tier, and an admission they filled as no miss.

use atb_mem_core::{KvCacheConfig, KvLayout, Medium, MissReason, Tokens};

const BLOCK_SIZE: usize = 4;

#[test]
fn a_load_that_landed_counts_as_hits_with_its_tier() {
    let mut cache = KvCacheConfig::new(16, BLOCK_SIZE, KvLayout::default())
        .build()
        .unwrap();
    let prompt: Vec<u32> = (0..13).collect();
    cache.alloc_sequence(1, Tokens::Ids(&prompt), None).unwrap();
    let before = cache.stats();
    assert_eq!(before.prefix_cache_queries, 3);
    assert_eq!(
        (before.prefix_cache_hits, before.prefix_cache_hit_tokens),
        (0, 0)
    );
    assert_eq!(
        before.prefix_cache_misses[MissReason::NotCached as usize],
        1
    );

    cache.record_tier_hits(Medium::Disk, 2, None).unwrap();
    cache
        .record_tier_hits(Medium::Store, 1, Some(MissReason::NotCached))
        .unwrap();
    let after = cache.stats();
    assert_eq!(
        (after.prefix_cache_queries, after.prefix_cache_hits),
        (3, 3)
    );
    assert_eq!(after.prefix_cache_hit_tokens, 12);
    assert_eq!(after.prefix_cache_disk_hit_tokens, 8);
    assert_eq!(after.prefix_cache_store_hit_tokens, 4);
    assert_eq!(after.prefix_cache_hit_rate(), 1.0);
    assert_eq!(after.prefix_cache_misses, [0; 6], "filled: no miss");
}

#[test]
fn hits_from_a_tier_that_loads_nothing_are_errors_that_change_nothing() {
    let mut cache = KvCacheConfig::new(16, BLOCK_SIZE, KvLayout::default())
        .build()
        .unwrap();
    cache
        .alloc_sequence(1, Tokens::Ids(&(0..9).collect::<Vec<_>>()), None)
        .unwrap();
    let before = cache.stats();
    for medium in [Medium::Device, Medium::Host] {
        let error = cache.record_tier_hits(medium, 1, None).unwrap_err();
        assert!(error.to_string().contains("disk or a store"), "{error}");
    }
    let error = cache
        .record_tier_hits(Medium::Disk, 1, Some(MissReason::PrefixCachingOff))
        .unwrap_err();
    assert!(
        error.to_string().contains("never counted missed"),
        "{error}"
    );
    assert_eq!(cache.stats(), before);
}

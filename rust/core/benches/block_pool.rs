//! Core micro-benchmarks: `cargo bench -p atb-mem-core`.

use std::hint::black_box;

use atb_mem_core::{BlockHash, BlockPool, KvCacheConfig, KvLayout, Tokens};
use criterion::{criterion_group, criterion_main, Criterion};

fn block_allocate_free(c: &mut Criterion) {
    let mut pool = BlockPool::new(65_536, 16, true).unwrap();
    c.bench_function("block_pool/allocate+release", |b| {
        b.iter(|| {
            let block = pool.allocate().unwrap();
            pool.release(black_box(block));
        })
    });
    // With half the pool cached, allocation evicts: the prefix table is updated too.
    let mut pool = BlockPool::new(65_536, 16, true).unwrap();
    let blocks: Vec<u32> = (0..65_535).map(|_| pool.allocate().unwrap()).collect();
    for (i, &block) in blocks.iter().enumerate() {
        if i % 2 == 0 {
            pool.register(block, BlockHash::root(None).chain(&[i as u32]), true);
        }
    }
    for block in blocks {
        pool.release(block);
    }
    c.bench_function("block_pool/allocate+release, evicting", |b| {
        let mut i = 1u32 << 20;
        b.iter(|| {
            let block = pool.allocate().unwrap();
            i += 1;
            pool.register(block, BlockHash::root(None).chain(&[i]), true);
            pool.release(black_box(block));
        })
    });
}

fn sequence_churn(c: &mut Criterion) {
    let mut cache = KvCacheConfig::new(65_536, 16, KvLayout::default())
        .build()
        .unwrap();
    c.bench_function("kv_cache/alloc_sequence+free_sequence (16 tokens)", |b| {
        b.iter(|| {
            cache
                .alloc_sequence(black_box(7), Tokens::Count(16), None)
                .unwrap();
            cache.free_sequence(black_box(7)).unwrap();
        })
    });
    c.bench_function("block_hash/chain (16 tokens)", |b| {
        let tokens: Vec<u32> = (0..16).collect();
        b.iter(|| black_box(BlockHash::root(None)).chain(black_box(&tokens)))
    });
}

/// W3 in the core: a request of a shared 1,024-token prompt plus 256 unique tokens is
/// admitted with its ids, computed and freed, with KV events off and on (drained every
/// request, as an engine drains every step).
fn prefix_request_events(c: &mut Criterion) {
    for events in [false, true] {
        let mut cache = KvCacheConfig::new(65_536, 16, KvLayout::default())
            .kv_events(events)
            .build()
            .unwrap();
        let mut prompt: Vec<u32> = (0..1_280).collect();
        let mut request = 0u32;
        let name = format!(
            "kv_cache/W3 request (KV events {})",
            if events { "on" } else { "off" }
        );
        c.bench_function(&name, |b| {
            b.iter(|| {
                request += 1;
                prompt[1_024] = 100_000 + request; // a unique suffix: only the prefix hits
                cache
                    .alloc_sequence(7, Tokens::Ids(black_box(&prompt)), None)
                    .unwrap();
                cache.mark_computed(7, Some(prompt.len())).unwrap();
                cache.free_sequence(7).unwrap();
                black_box(cache.take_kv_events(|log| log.events().len()));
            })
        });
    }
}

criterion_group!(
    benches,
    block_allocate_free,
    sequence_churn,
    prefix_request_events
);
criterion_main!(benches);

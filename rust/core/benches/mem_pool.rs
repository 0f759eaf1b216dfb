//! MemPool micro-benchmarks: `cargo bench -p atb-mem-core --bench mem_pool`.

use std::hint::black_box;

use atb_mem_core::{AlignmentPolicy, MemPool};
use criterion::{criterion_group, criterion_main, Criterion};

fn malloc_free(c: &mut Criterion) {
    // A pool with a few hundred live allocations of mixed sizes, so bins are populated.
    let mut pool = MemPool::new(1 << 30, 64, AlignmentPolicy::Default, 1 << 16).unwrap();
    let mut size = 4096u64;
    for i in 0..400 {
        let allocation = pool.malloc(size).unwrap();
        if i % 3 == 0 {
            pool.free(allocation.pool_id, allocation.node, allocation.generation)
                .unwrap();
        }
        size = (size * 7 + 4096) % (1 << 21) + 4096;
    }
    c.bench_function("mem_pool/malloc+free (256 KiB)", |b| {
        b.iter(|| {
            let allocation = pool.malloc(black_box(256 * 1024)).unwrap();
            pool.free(allocation.pool_id, allocation.node, allocation.generation)
                .unwrap();
        })
    });
    c.bench_function("mem_pool/malloc+free_offset (256 KiB)", |b| {
        b.iter(|| {
            let allocation = pool.malloc(black_box(256 * 1024)).unwrap();
            pool.free_offset(allocation.offset).unwrap();
        })
    });
}

criterion_group!(benches, malloc_free);
criterion_main!(benches);

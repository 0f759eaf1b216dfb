"""MemPool benchmarks (pytest-benchmark).

    python -m pytest benches/test_bench_mem_pool.py --benchmark-enable --benchmark-only -s

The churn-at-high-occupancy comparison with a first-fit allocator is a Rust benchmark:
``cargo bench -p atb-mem-core --bench churn``.
"""

from __future__ import annotations

import atb_mem

PAIRS = 1_000_000


def test_malloc_free_pair(benchmark) -> None:
    """malloc + free of 256 KiB from Python, 1,000,000 times."""
    pool = atb_mem.MemPool(1 << 30, backing=None)
    keep = [pool.malloc(4096 * (i % 7 + 1)) for i in range(64)]  # a few ranges in the bins

    def churn() -> None:
        malloc, free = pool.malloc, pool.free
        for _ in range(PAIRS):
            free(malloc(262_144))

    benchmark.pedantic(churn, rounds=5, iterations=1, warmup_rounds=1)
    assert len(pool) == len(keep)
    if benchmark.stats is not None:
        median = benchmark.stats.stats.median
        print(f"\nMemPool malloc+free pair from Python: {median / PAIRS * 1e9:.0f} ns "
              "(median of 5 rounds)")


def test_malloc_free_by_pointer(benchmark) -> None:
    """The acl-style path: malloc, then free by the returned pointer."""
    pool = atb_mem.MemPool(1 << 30, backing=None)

    def churn() -> None:
        malloc, free = pool.malloc, pool.free
        for _ in range(PAIRS // 4):
            free(malloc(262_144).ptr)

    benchmark.pedantic(churn, rounds=5, iterations=1, warmup_rounds=1)
    assert len(pool) == 0
    if benchmark.stats is not None:
        median = benchmark.stats.stats.median
        print(f"\nMemPool malloc + free(ptr) from Python: {median / (PAIRS // 4) * 1e9:.0f} ns")

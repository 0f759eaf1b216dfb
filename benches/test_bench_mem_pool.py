"""MemPool benchmarks (pytest-benchmark); the workload is atb_mem.tools.workloads'.

    python -m pytest benches/test_bench_mem_pool.py --benchmark-enable --benchmark-only -s

The churn-at-high-occupancy comparison with a first-fit allocator is a Rust benchmark:
``cargo bench -p atb-mem-core --bench churn``.
"""

from __future__ import annotations

from atb_mem.tools import workloads


def test_malloc_free_pair(benchmark) -> None:
    """malloc + free of 256 KiB from Python, 1,000,000 times."""
    run, pairs = workloads.mem_pool_workload(1_000_000)
    benchmark.pedantic(run, rounds=5, iterations=1, warmup_rounds=1)
    if benchmark.stats is not None:
        median = benchmark.stats.stats.median
        print(f"\nMemPool malloc+free pair from Python: {median / pairs * 1e9:.0f} ns "
              "(median of 5 rounds)")

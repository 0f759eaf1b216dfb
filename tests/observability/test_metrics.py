"""The Prometheus collector, scraped through prometheus_client's own text exposition."""

from __future__ import annotations

import os

import pytest

import atb_mem


def scrape(collector) -> dict[str, dict[tuple, float]]:
    try:
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("prometheus_client is required in CI")
        pytest.skip("prometheus_client is not installed")
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def test_kv_cache_mem_pool_and_scheduler_metrics() -> None:
    from atb_mem.observability.metrics import AtbMemCollector

    pool = atb_mem.MemPool(1 << 20)
    kv = atb_mem.KVCachePool(33, 4, pool=pool)
    scheduler = atb_mem.ContinuousBatchScheduler(kv, max_num_batched_tokens=64)
    prompt = list(range(9))
    kv.alloc_sequence(100, prompt)
    kv.mark_computed(100)
    kv.free_sequence(100)
    scheduler.add_request(1, prompt, 3)
    scheduler.add_request(2, 6, 3)
    plan = scheduler.step(now=0.0)
    collector = AtbMemCollector(kv_cache=kv, mem_pool=pool, scheduler=scheduler,
                                labels={"model": "test"})
    samples = scrape(collector)
    model = (("model", "test"),)
    stats = kv.stats()
    assert samples["atb_mem_kv_cache_usage_ratio"][model] == pytest.approx(
        stats["blocks_used"] / 32)
    assert samples["atb_mem_kv_cache_blocks"][(("model", "test"), ("state", "used"))] == \
        stats["blocks_used"]
    assert samples["atb_mem_kv_cache_prefix_cache_hits_total"][model] == 2
    assert samples["atb_mem_kv_cache_prefix_cache_hit_ratio"][model] == pytest.approx(
        stats["prefix_cache_hit_rate"])
    assert samples["atb_mem_kv_cache_sequences"][model] == 2
    assert samples["atb_mem_mem_pool_allocated_bytes"][model] == kv.region.size
    assert samples["atb_mem_mem_pool_allocations_total"][model] == 1
    assert samples["atb_mem_scheduler_requests"][(("model", "test"), ("state", "running"))] == 2
    assert samples["atb_mem_scheduler_batch_size"][model] == len(plan)
    assert samples["atb_mem_scheduler_preemptions_total"][model] == 0
    # The first admission of the prompt missed (nothing cached yet); the prompt of 6
    # tokens by count looks nothing up.
    misses = samples["atb_mem_kv_cache_prefix_cache_misses_total"]
    assert misses[(("model", "test"), ("reason", "not_cached"))] == 1
    assert misses[(("model", "test"), ("reason", "window"))] == 0


def test_batcher_metrics_and_bad_arguments() -> None:
    from atb_mem.observability.metrics import AtbMemCollector

    batcher = atb_mem.DynamicBatchScheduler(max_batch_size=2, timeout_ms=1000)
    for item in range(3):
        batcher.submit(item)
    batch = batcher.next_batch(timeout=0)
    samples = scrape(AtbMemCollector(batcher=batcher))
    assert samples["atb_mem_batcher_queue_length"][()] == 1
    assert samples["atb_mem_batcher_batch_size"][()] == 2
    assert samples["atb_mem_batcher_batches_total"][()] == 1
    batch.set_results([0, 1])
    with pytest.raises(ValueError, match="at least one"):
        AtbMemCollector()


def test_host_prefix_tier_metrics_count_hits_and_bytes_per_tier() -> None:
    """A prompt evicted from a 4-block device comes back from the host tier: its hit tokens
    are the host's, and the bytes moved are a block each way."""
    from atb_mem.observability.metrics import AtbMemCollector

    kv = atb_mem.KVCachePool(5, 4, num_host_blocks=8, host_prefix_cache=True, device=None)
    first, second = list(range(9)), list(range(100, 109))
    for seq_id, prompt in enumerate((first, second, first)):
        kv.alloc_sequence(seq_id, prompt)
        kv.execute_pending_moves(lambda moves: None)  # no bytes here
        kv.mark_computed(seq_id)
        kv.free_sequence(seq_id)
    samples = scrape(AtbMemCollector(kv_cache=kv))
    hits = samples["atb_mem_kv_cache_prefix_cache_hit_tokens_total"]
    assert hits[(("tier", "host"),)] == 4 and hits[(("tier", "device"),)] == 4
    moved = samples["atb_mem_kv_cache_tier_moved_bytes_total"]
    per_block = kv.bytes_per_block
    assert moved[(("direction", "promoted"),)] == per_block
    assert moved[(("direction", "demoted"),)] >= per_block
    assert samples["atb_mem_kv_cache_tier_dropped_blocks_total"][()] == 0

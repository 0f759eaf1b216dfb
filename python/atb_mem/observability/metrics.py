"""Prometheus metrics for a KV cache, a MemPool and the schedulers.

    from prometheus_client import REGISTRY, start_http_server
    from atb_mem.observability.metrics import AtbMemCollector
    REGISTRY.register(AtbMemCollector(kv_cache=kv, mem_pool=pool, scheduler=sched))
    start_http_server(9400)

The collector reads each object's ``stats()`` at scrape time (one lock each), so it adds no
work to the serving path. Needs ``prometheus_client`` (``pip install 'atb-mem[metrics]'``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

try:
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        Metric,
    )
    from prometheus_client.registry import Collector
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "atb_mem.observability.metrics needs prometheus_client: pip install 'atb-mem[metrics]'"
    ) from error

from atb_mem._types import MISS_REASONS

if TYPE_CHECKING:
    from atb_mem import ContinuousBatchScheduler, DynamicBatchScheduler, KVCachePool, MemPool
    from atb_mem._types import (
        ContinuousBatchSchedulerStats,
        DynamicBatchSchedulerStats,
        KVCachePoolStats,
        MemPoolStats,
    )
    from atb_mem.kv.tiers import TierConnector

__all__ = ["AtbMemCollector"]


def _gauge(name: str, documentation: str, value: float, labels: dict[str, str]) -> Metric:
    family = GaugeMetricFamily(name, documentation, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def _counter(name: str, documentation: str, value: float, labels: dict[str, str]) -> Metric:
    family = CounterMetricFamily(name, documentation, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


class AtbMemCollector(Collector):
    """Collects from any of: a ``KVCachePool``, a ``MemPool``, a ``ContinuousBatchScheduler``
    and a ``DynamicBatchScheduler``; with ``tiers`` (an engine's ``TierConnector``), the tiers
    below the host too. ``labels`` are added to every sample (e.g. a model name)."""

    def __init__(self, *, kv_cache: KVCachePool | None = None, mem_pool: MemPool | None = None,
                 scheduler: ContinuousBatchScheduler | None = None,
                 batcher: DynamicBatchScheduler | None = None,
                 tiers: TierConnector | None = None, namespace: str = "atb_mem",
                 labels: dict[str, str] | None = None) -> None:
        if all(source is None for source in (kv_cache, mem_pool, scheduler, batcher)):
            raise ValueError("give at least one of kv_cache, mem_pool, scheduler, batcher")
        self.kv_cache, self.mem_pool = kv_cache, mem_pool
        self.scheduler, self.batcher, self.tiers = scheduler, batcher, tiers
        self.namespace = namespace
        self.labels = dict(labels or {})

    def describe(self) -> list[Metric]:
        return []  # collected lazily; no fixed description needed at registration

    def collect(self) -> Iterator[Metric]:
        if self.kv_cache is not None:
            yield from self._kv_cache(self.kv_cache.stats())
        if self.mem_pool is not None:
            yield from self._mem_pool(self.mem_pool.stats())
        if self.scheduler is not None:
            yield from self._scheduler(self.scheduler.stats())
        if self.batcher is not None:
            yield from self._batcher(self.batcher.stats())

    def _kv_cache(self, stats: KVCachePoolStats) -> Iterator[Metric]:
        prefix, labels = self.namespace, self.labels
        usable = max(1, stats["num_blocks"] - 1)
        yield _gauge(f"{prefix}_kv_cache_usage_ratio",
                     "Share of the usable KV blocks held by sequences.",
                     stats["blocks_used"] / usable, labels)
        blocks = GaugeMetricFamily(f"{prefix}_kv_cache_blocks",
                                   "KV blocks by state (used, free, cached).",
                                   labels=[*labels, "state"])
        for state, count in (("used", stats["blocks_used"]), ("free", stats["blocks_free"]),
                             ("cached", stats["blocks_cached"])):
            blocks.add_metric([*labels.values(), state], count)
        yield blocks
        yield _gauge(f"{prefix}_kv_cache_fragmentation_ratio",
                     "Allocated but unused slots over allocated slots.",
                     stats["fragmentation"], labels)
        yield _gauge(f"{prefix}_kv_cache_sequences", "Live sequences.",
                     stats["num_sequences"], labels)
        # A block loaded from a tier below the host is a hit too (the cache's stats count it
        # once the load landed).
        hits, queries = stats["prefix_cache_hits"], stats["prefix_cache_queries"]
        yield _gauge(f"{prefix}_kv_cache_prefix_cache_hit_ratio",
                     "Prefix-cache block hits (from any tier) over lookups since start.",
                     hits / queries if queries else 0.0, labels)
        yield _counter(f"{prefix}_kv_cache_prefix_cache_queries",
                       "Full blocks looked up in the prefix cache.", queries, labels)
        yield _counter(f"{prefix}_kv_cache_prefix_cache_hits",
                       "Full blocks found in the prefix cache or loaded from a tier below "
                       "the host (prefix_cache_hit_tokens says which tier).", hits, labels)
        yield _counter(f"{prefix}_kv_cache_evictions", "Cached blocks reused for other data.",
                       stats["evictions"], labels)
        misses = CounterMetricFamily(f"{prefix}_kv_cache_prefix_cache_misses",
                                     "Admissions whose prefix hit, from every tier, fell "
                                     "short, by reason (explain_prefix says which).",
                                     labels=[*labels, "reason"])
        for reason in MISS_REASONS:
            missed = stats[f"prefix_cache_misses_{reason}"]  # type: ignore[literal-required]
            misses.add_metric([*labels.values(), reason], missed)
        yield misses
        yield from self._tiers(stats)

    def _tiers(self, stats: KVCachePoolStats) -> Iterator[Metric]:
        """Per tier (``device``, ``host``): the hit tokens each served, the bytes the host
        prefix tier moved each way, and the device evictions it could not keep."""
        prefix, labels = self.namespace, self.labels
        host_hits = stats["prefix_cache_host_hit_tokens"]
        hits = CounterMetricFamily(f"{prefix}_kv_cache_prefix_cache_hit_tokens",
                                   "Prompt tokens served from the prefix cache, by tier.",
                                   labels=[*labels, "tier"])
        lower = stats["prefix_cache_disk_hit_tokens"] + stats["prefix_cache_store_hit_tokens"]
        hits.add_metric([*labels.values(), "device"],
                        stats["prefix_cache_hit_tokens"] - host_hits - lower)
        hits.add_metric([*labels.values(), "host"], host_hits)
        if self.tiers is not None:
            for tier, blocks in self.tiers.counters.loaded_by_tier.items():
                hits.add_metric([*labels.values(), tier], blocks * stats["block_size"])
        yield hits
        partial = CounterMetricFamily(
            f"{prefix}_kv_cache_prefix_cache_partial_hit_tokens",
            "Of the hit tokens, those copied from a partly shared block (hash_block_size).",
            labels=list(labels))
        partial.add_metric(list(labels.values()), stats["prefix_cache_partial_hit_tokens"])
        yield partial
        if self.tiers is not None:
            yield from self._lower_tiers(self.tiers, stats["bytes_per_block"])
        moved = CounterMetricFamily(f"{prefix}_kv_cache_tier_moved_bytes",
                                    "Bytes the host prefix tier moved: demoted (device to "
                                    "host) and promoted (host to device).",
                                    labels=[*labels, "direction"])
        for direction, blocks in (("demoted", stats["host_prefix_demoted"]),
                                  ("promoted", stats["host_prefix_promoted"])):
            moved.add_metric([*labels.values(), direction], blocks * stats["bytes_per_block"])
        yield moved
        yield _counter(f"{prefix}_kv_cache_tier_dropped_blocks",
                       "Device evictions the host prefix tier could not keep (every host "
                       "block held by a swapped sequence).",
                       stats["host_prefix_demotions_dropped"], labels)
        yield _gauge(f"{prefix}_kv_cache_host_cached_blocks",
                     "Evicted prefix blocks the host tier keeps.",
                     stats["host_blocks_cached"], labels)

    def _lower_tiers(self, tiers: TierConnector, bytes_per_block: int) -> Iterator[Metric]:
        """The disk tier and the shared store: bytes each way per tier, failed loads and
        their damaged blocks, failed store calls, and the load latency histogram."""
        from atb_mem.kv.tiers.counters import LOAD_SECONDS_BUCKETS

        prefix, labels = self.namespace, self.labels
        counters = tiers.counters
        moved = CounterMetricFamily(f"{prefix}_kv_tier_bytes",
                                    "Bytes loaded from and written to the tiers below the host.",
                                    labels=[*labels, "tier", "direction"])
        for direction, by_tier in (("loaded", counters.loaded_by_tier),
                                   ("saved", counters.saved_by_tier)):
            for tier, blocks in by_tier.items():
                moved.add_metric([*labels.values(), tier, direction], blocks * bytes_per_block)
        yield moved
        yield _counter(f"{prefix}_kv_tier_load_failures",
                       "Loads that failed (a block missing, damaged or late, or the copy "
                       "to the device): recomputed.",
                       counters.load_failures, labels)
        yield _counter(f"{prefix}_kv_tier_damaged_blocks",
                       "Blocks a load found missing, truncated or corrupted.",
                       counters.corrupt_blocks, labels)
        yield _counter(f"{prefix}_kv_tier_store_errors",
                       "Calls to a tier that failed (unreachable, refusing, a failed write).",
                       counters.store_errors, labels)
        latency = HistogramMetricFamily(f"{prefix}_kv_tier_load_seconds",
                                        "Time from admission to a load's blocks in place.",
                                        labels=list(labels))
        buckets = [("+Inf" if bound == float("inf") else str(bound), count)
                   for bound, count in zip(LOAD_SECONDS_BUCKETS,
                                           counters.load_seconds_buckets, strict=True)]
        latency.add_metric(list(labels.values()), buckets, counters.load_seconds_sum)
        yield latency

    def _mem_pool(self, stats: MemPoolStats) -> Iterator[Metric]:
        prefix, labels = self.namespace, self.labels
        for value, name, text in (
                (stats["allocated_bytes.current"], "allocated_bytes", "Bytes in live allocations."),
                (stats["reserved_bytes.current"], "reserved_bytes", "Bytes the pool manages."),
                (stats["free_bytes"], "free_bytes", "Free bytes."),
                (stats["largest_free"], "largest_free_bytes", "The largest free range.")):
            yield _gauge(f"{prefix}_mem_pool_{name}", text, value, labels)
        yield _gauge(f"{prefix}_mem_pool_fragmentation_ratio",
                     "1 - largest free range / free bytes.", stats["fragmentation"], labels)
        yield _counter(f"{prefix}_mem_pool_allocations", "malloc calls that succeeded.",
                       stats["num_allocs"], labels)
        yield _counter(f"{prefix}_mem_pool_ooms", "malloc calls that ran out of memory.",
                       stats["num_ooms"], labels)

    def _scheduler(self, stats: ContinuousBatchSchedulerStats) -> Iterator[Metric]:
        prefix, labels = self.namespace, self.labels
        requests = GaugeMetricFamily(f"{prefix}_scheduler_requests",
                                     "Requests by state (waiting, running, swapped).",
                                     labels=[*labels, "state"])
        for state, count in (("waiting", stats["waiting"]), ("running", stats["running"]),
                             ("swapped", stats["swapped"])):
            requests.add_metric([*labels.values(), state], count)
        yield requests
        yield _counter(f"{prefix}_scheduler_preemptions", "Sequences preempted.",
                       stats["preemptions"], labels)
        yield _counter(f"{prefix}_scheduler_finished", "Requests finished.",
                       stats["finished"], labels)
        yield _gauge(f"{prefix}_scheduler_batch_size", "Sequences in the last step.",
                     stats["last_batch_size"], labels)
        yield _gauge(f"{prefix}_scheduler_batch_tokens", "Tokens in the last step.",
                     stats["last_batch_tokens"], labels)

    def _batcher(self, stats: DynamicBatchSchedulerStats) -> Iterator[Metric]:
        prefix, labels = self.namespace, self.labels
        yield _gauge(f"{prefix}_batcher_queue_length", "Requests waiting for a batch.",
                     stats["queue_length"], labels)
        yield _gauge(f"{prefix}_batcher_batch_size", "Requests in the last batch.",
                     stats["last_batch_size"], labels)
        yield _counter(f"{prefix}_batcher_batches", "Batches released.",
                       stats["batches"], labels)

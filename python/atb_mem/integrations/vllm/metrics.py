"""What ``AtbMemConnector`` reports to vLLM: ``AtbMemConnectorStats`` (vLLM's KV connector
stats, summed over workers and the scheduler side, logged as "KV Transfer metrics") and
Prometheus counters beside vLLM's own, per engine:

- ``vllm:atb_mem_loaded_blocks{tier}`` / ``vllm:atb_mem_saved_blocks{tier}``: blocks moved
  from / to each tier (``HOST``, ``DISK``, ``MOONCAKE``);
- ``vllm:atb_mem_moved_bytes{direction}``: ``load`` and ``save`` bytes;
- ``vllm:atb_mem_load_failures`` and ``vllm:atb_mem_corrupt_blocks``: loads that failed
  (vLLM recomputed them) and blocks whose frame did not check;
- ``vllm:atb_mem_loads`` and ``vllm:atb_mem_load_seconds``: disk and store loads and their
  summed latency (their ratio is the mean);
- ``vllm:atb_mem_hit_tokens``: tokens the tiers served (vLLM's own
  ``vllm:external_prefix_cache_hits`` counts them too);
- ``vllm:atb_mem_store_errors``: calls to the disk or the store that failed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

__all__ = ["AtbMemConnectorStats", "AtbMemPromMetrics"]

_TIERS = ("HOST", "DISK", "MOONCAKE")
_PLAIN = {"load_failures": "loads that failed; vLLM recomputed their blocks",
          "corrupt_blocks": "blocks read from the disk or the store whose frame did not check",
          "loads": "loads from the disk or the store",
          "load_seconds": "seconds the loads from the disk or the store took, summed",
          "hit_tokens": "prompt tokens the tiers served",
          "store_errors": "calls to the disk or the store that failed"}


@dataclass
class AtbMemConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """Counts since the last report: ``loaded_blocks_TIER``, ``saved_blocks_TIER``,
    ``loaded_bytes``, ``saved_bytes``, ``load_failures``, ``corrupt_blocks``, ``loads``,
    ``load_seconds_sum``, ``hit_tokens``, ``lookups``, ``host_full``, ..."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> AtbMemConnectorStats:
        for name, amount in other.data.items():
            self.data[name] = self.data.get(name, 0) + amount
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class AtbMemPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """The counters above, one set per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                 ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter = self._counter_cls
        blocks = {direction: counter(name=f"vllm:atb_mem_{direction}_blocks",
                                     documentation=f"KV blocks {direction} per atb-mem tier",
                                     labelnames=[*labelnames, "tier"])
                  for direction in ("loaded", "saved")}
        moved = counter(name="vllm:atb_mem_moved_bytes",
                        documentation="KV bytes atb-mem's tiers loaded and saved",
                        labelnames=[*labelnames, "direction"])
        plain = {name: counter(name=f"vllm:atb_mem_{name}", documentation=text,
                               labelnames=labelnames) for name, text in _PLAIN.items()}
        self._bound: dict[tuple[int, str], Any] = {}
        for engine, values in per_engine_labelvalues.items():
            for direction, metric in blocks.items():
                for tier in _TIERS:
                    self._bound[engine, f"{direction}_blocks_{tier}"] = \
                        metric.labels(*values, tier)
            self._bound[engine, "loaded_bytes"] = moved.labels(*values, "load")
            self._bound[engine, "saved_bytes"] = moved.labels(*values, "save")
            for name, metric in plain.items():
                key = "load_seconds_sum" if name == "load_seconds" else name
                self._bound[engine, key] = metric.labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, amount in transfer_stats_data.items():
            metric = self._bound.get((engine_idx, name))
            if metric is not None and amount:
                metric.inc(amount)

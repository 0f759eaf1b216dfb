"""What ``GET /metrics`` exports: the KV cache's and the scheduler's figures (the existing
collector, read at scrape time) and the server's own request counters and latencies."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from atb_mem.observability.metrics import AtbMemCollector
from atb_mem.serving.config_guard import ROLLBACK_REASONS
from atb_mem.serving.engine import Engine
from atb_mem.serving.engine_loop import RequestStream
from atb_mem.serving.params import RequestOutput

__all__ = ["DeviceUtilization", "ServerMetrics", "device_utilization_reader"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def device_utilization_reader(device: str) -> Callable[[], float] | None:
    """How to read ``device``'s utilisation in percent (the share of time a kernel ran, as
    nvidia-smi / npu-smi report it), or None where torch cannot tell: the CPU, or a CUDA build
    without pynvml."""
    import torch

    kind, _, index_text = device.partition(":")
    index = int(index_text) if index_text else None
    module: Any = {"cuda": torch.cuda, "npu": getattr(torch, "npu", None)}.get(kind)
    if module is None or not hasattr(module, "utilization"):
        return None
    try:
        module.utilization(index)
    except Exception:  # pynvml missing, a driver that refuses: not reported
        return None
    return lambda: float(module.utilization(index))


class DeviceUtilization(Collector):
    """``atb_mem_device_utilization_ratio``, exported only where the device reports it (a
    scrape that cannot read it leaves it out rather than exporting a made-up 0)."""

    def __init__(self, read: Callable[[], float], labels: dict[str, str]) -> None:
        self._read = read
        self._labels = labels

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            percent = self._read()
        except Exception:  # a failed read is a gap in the series, not a 500
            return
        family = GaugeMetricFamily(
            "atb_mem_device_utilization_ratio", "Share of time a kernel ran on the device "
            "(healthy 0.7-0.9).", labels=list(self._labels))
        family.add_metric(list(self._labels.values()), percent / 100.0)
        yield family


class ServerMetrics:
    """A registry of its own; ``observe`` runs in the engine loop for each delivered output."""

    def __init__(self, engine: Engine, model_name: str,
                 device_utilization: Callable[[], float] | None = None) -> None:
        """``device_utilization`` reads the device's utilisation in percent (default: what
        :func:`device_utilization_reader` finds for the engine's device)."""
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self.registry.register(AtbMemCollector(kv_cache=engine.kv_cache,
                                               scheduler=engine.scheduler, tiers=engine.tiers,
                                               labels=labels))
        read = device_utilization or device_utilization_reader(str(engine.runner.device))
        if read is not None:
            self.registry.register(DeviceUtilization(read, labels))
        self.requests = Counter("atb_mem_requests", "Requests finished, by finish reason.",
                                ["model_name", "finish_reason"], registry=self.registry)
        self.generated = Counter("atb_mem_generated_tokens", "Tokens sampled for requests.",
                                 ["model_name"], registry=self.registry)
        self.time_to_first_token = Histogram(
            "atb_mem_time_to_first_token_seconds", "From arrival to the first token.",
            ["model_name"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.inter_token_latency = Histogram(
            "atb_mem_inter_token_latency_seconds", "Between a request's consecutive tokens.",
            ["model_name"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.rollbacks = Counter("atb_mem_config_rollbacks", "Configuration changes the guard "
                                 "rolled back, by reason.", ["reason"], registry=self.registry)
        for reason in ROLLBACK_REASONS:  # exported at 0 from the start, for alerting rules
            self.rollbacks.labels(reason)
        self.model_time_ratio = Gauge(
            "atb_mem_engine_model_time_ratio", "Share of step time in the model forward over "
            "the guard's window (the kernels' share; healthy >= 0.65).", registry=self.registry)
        self.model_name = model_name

    def observe(self, stream: RequestStream, output: RequestOutput, now: float) -> None:
        # Tokens per sequence this step (a request's n samples advance together).
        new = max((len(one.token_ids) for one in output.outputs), default=0)
        if new:
            self.generated.labels(self.model_name).inc(
                sum(len(one.token_ids) for one in output.outputs))
            if stream.last_token_time is None:
                self.time_to_first_token.labels(self.model_name).observe(now - stream.arrival)
            else:
                gap = (now - stream.last_token_time) / new
                for _ in range(new):
                    self.inter_token_latency.labels(self.model_name).observe(gap)
            stream.last_token_time = now
        if output.finished:
            reasons = {one.finish_reason for one in output.outputs} or {"abort"}
            reason = "abort" if "abort" in reasons else "stop" if "stop" in reasons else "length"
            self.requests.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

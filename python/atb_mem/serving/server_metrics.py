"""What ``GET /metrics`` exports: the KV cache's and the scheduler's figures (the existing
collector, read at scrape time) and the server's own request counters and latencies."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from atb_mem.observability.metrics import AtbMemCollector
from atb_mem.serving.config_guard import ROLLBACK_REASONS
from atb_mem.serving.engine import Engine
from atb_mem.serving.engine_loop import RequestStream
from atb_mem.serving.params import RequestOutput

__all__ = ["ServerMetrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ServerMetrics:
    """A registry of its own; ``observe`` runs in the engine loop for each delivered output."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self.registry.register(AtbMemCollector(kv_cache=engine.kv_cache,
                                               scheduler=engine.scheduler, labels=labels))
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

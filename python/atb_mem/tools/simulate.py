"""Replaying request traces through continuous batching, to compare KV memory strategies on
the same memory budget (`atb-mem bench fragmentation`).

Strategies:
- ``paged``: atb-mem's KV blocks at a block size, scheduled by ``ContinuousBatchScheduler``;
- ``contiguous-max``: each admitted request reserves ``max_model_len`` tokens up front (how
  Orca/FasterTransformer-era servers work);
- ``contiguous-exact``: each request reserves exactly ``prompt + output`` tokens as one
  variable-size allocation from a ``MemPool``, so external fragmentation shows.

All use one cost model (step time = ``base + per_token × batched tokens``) and the same
token budget per step; no model runs.
"""

from __future__ import annotations

import csv
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

import atb_mem
from atb_mem._core import kv_cache_groups, kv_layout_bytes

__all__ = ["CostModel", "ReplayResult", "Request", "load_trace", "replay_paged",
           "replay_reserved", "synthetic_workload"]

TRACE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


@dataclass(frozen=True)
class Request:
    arrival: float  # seconds from the first request
    prompt: int
    output: int


@dataclass(frozen=True)
class CostModel:
    base: float = 0.005
    per_token: float = 2e-5

    def step_seconds(self, tokens: int) -> float:
        return self.base + self.per_token * tokens


@dataclass
class ReplayResult:
    strategy: str
    block_size: int | None
    requests: int
    output_tokens: int
    makespan: float
    throughput: float  # output tokens per second of wall-clock time
    busy_seconds: float  # time spent in steps (the rest is waiting for arrivals)
    capacity: float  # output tokens per busy second: what the configuration can serve
    latency_p50: float
    latency_p90: float
    latency_p99: float
    peak_concurrency: int
    mean_concurrency: float  # time-weighted
    internal_fragmentation: float  # 1 - ∫used / ∫reserved over time
    external_fragmentation: float | None  # time-weighted, where it exists
    preemptions: int
    used_token_seconds: float
    reserved_token_seconds: float
    timeline: list[tuple[float, float, int]] = field(default_factory=list, repr=False)
    latencies: list[float] = field(default_factory=list, repr=False)

    def summary(self) -> dict[str, object]:
        values = dict(self.__dict__)
        values.pop("timeline")
        values.pop("latencies")
        return values


def load_trace(path: str | Path, limit: int | None = None) -> list[Request]:
    """Reads an Azure-format trace (``TIMESTAMP,ContextTokens,GeneratedTokens``). Any bad row
    refuses the whole trace with its line number: valid rows are never silently dropped."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"trace {str(path)!r} does not exist")
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        if reader.fieldnames is None or tuple(reader.fieldnames[:3]) != TRACE_COLUMNS:
            raise ValueError(f"trace {path.name}: expected columns {','.join(TRACE_COLUMNS)}, "
                             f"got {','.join(reader.fieldnames or [])}")
        requests: list[Request] = []
        start = previous = None
        for line, row in enumerate(reader, start=2):
            if limit is not None and len(requests) >= limit:
                break
            try:
                stamp = datetime.fromisoformat(row["TIMESTAMP"].strip()[:26])
                prompt, output = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except (TypeError, ValueError, AttributeError) as error:
                raise ValueError(f"trace {path.name} line {line}: cannot parse {row}") from error
            if prompt < 1 or output < 1:
                raise ValueError(f"trace {path.name} line {line}: lengths must be >= 1, got "
                                 f"prompt {prompt}, output {output}")
            if previous is not None and stamp < previous:
                raise ValueError(f"trace {path.name} line {line}: timestamps are not sorted")
            start = start or stamp
            previous = stamp
            requests.append(Request((stamp - start).total_seconds(), prompt, output))
    if not requests:
        raise ValueError(f"trace {path.name} has no requests")
    return requests


def synthetic_workload(count: int = 500, rate: float = 4.0, seed: int = 20240607) -> list[Request]:
    """Poisson arrivals; prompts lognormal around 300 tokens, outputs around 200."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, count))
    prompts = np.clip(np.rint(rng.lognormal(np.log(300), 1.0, count)), 8, 4096).astype(int)
    outputs = np.clip(np.rint(rng.lognormal(np.log(200), 1.0, count)), 1, 2048).astype(int)
    return [Request(float(a - arrivals[0]), int(p), int(o))
            for a, p, o in zip(arrivals, prompts, outputs, strict=True)]


class _Timeline:
    """Time integrals of used and reserved KV slots and of concurrency over the steps."""

    def __init__(self) -> None:
        self.points: list[tuple[float, float, int]] = []
        self.seconds = self.used = self.reserved = self.external = self.concurrency = 0.0
        self.peak = 0

    def record(self, now: float, seconds: float, used: int, reserved: int, running: int,
               external: float = 0.0) -> None:
        self.points.append((now, 1 - used / reserved if reserved else 0.0, running))
        self.seconds += seconds
        self.used += seconds * used
        self.reserved += seconds * reserved
        self.external += seconds * external
        self.concurrency += seconds * running
        self.peak = max(self.peak, running)

    def mean(self, total: float) -> float:
        return total / self.seconds if self.seconds else 0.0


def _result(strategy: str, block_size: int | None, requests: list[Request],
            finish: dict[int, float], now: float, timeline: _Timeline, preemptions: int,
            external: bool) -> ReplayResult:
    latencies = np.array([finish[i] - r.arrival for i, r in enumerate(requests)])
    p50, p90, p99 = np.percentile(latencies, [50, 90, 99])
    outputs = sum(r.output for r in requests)
    return ReplayResult(strategy, block_size, len(requests), outputs, now,
                        outputs / now if now else 0.0, timeline.seconds,
                        outputs / timeline.seconds if timeline.seconds else 0.0,
                        float(p50), float(p90), float(p99),
                        timeline.peak, timeline.mean(timeline.concurrency),
                        1 - timeline.used / timeline.reserved if timeline.reserved else 0.0,
                        timeline.mean(timeline.external) if external else None, preemptions,
                        timeline.used, timeline.reserved, timeline.points, latencies.tolist())


def replay_paged(requests: list[Request], memory_bytes: int, bytes_per_token: int,
                 block_size: int, *, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, cost: CostModel | None = None,
                 watermark: float = 0.01, num_layers: int = 1,
                 groups: dict[str, Any] | None = None) -> ReplayResult:
    """Paged blocks; with ``groups`` (``layer_types`` and window of the ``num_layers``
    layers), KV-cache groups: blocks of one group's layers, windowed groups keeping only
    their window."""
    cost = cost or CostModel()
    layers_per_block = (kv_cache_groups(num_layers, **groups)[1] if groups else num_layers)
    block_bytes = bytes_per_token // num_layers * layers_per_block * block_size
    kv = atb_mem.KVCachePool(memory_bytes // block_bytes, block_size, device=None,
                             num_layers=num_layers, **(groups or {}))
    scheduler = atb_mem.ContinuousBatchScheduler(
        kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        watermark=watermark)
    finish: dict[int, float] = {}
    timeline = _Timeline()
    now, next_request = 0.0, 0
    while len(finish) < len(requests):
        while next_request < len(requests) and requests[next_request].arrival <= now:
            request = requests[next_request]
            scheduler.add_request(next_request, request.prompt, request.output,
                                  arrival_time=request.arrival)
            next_request += 1
        plan = scheduler.step(now=now)
        if len(plan):
            seconds = cost.step_seconds(plan.num_batched_tokens)
            stats = kv.stats()
            timeline.record(now, seconds, stats["used_slots"], stats["allocated_slots"],
                            stats["num_sequences"])
            now += seconds
        elif next_request < len(requests):
            now = max(now, requests[next_request].arrival)
        for seq_id in scheduler.on_tokens(plan.sample_seq_ids, plan.sample_seq_ids % 1000):
            finish[int(seq_id)] = now
    return _result("paged, groups" if groups else "paged", block_size, requests, finish, now,
                   timeline, scheduler.stats()["preemptions"], external=False)


def replay_reserved(requests: list[Request], memory_bytes: int, bytes_per_token: int, *,
                    exact: bool, max_model_len: int, max_num_seqs: int = 256,
                    max_num_batched_tokens: int = 8192,
                    cost: CostModel | None = None) -> ReplayResult:
    """Contiguous reservations, first come first served; a reservation covers a request's
    whole life, so nothing is ever preempted."""
    cost = cost or CostModel()
    largest = max_model_len if not exact else max_length(requests)
    if largest * bytes_per_token > memory_bytes:
        raise ValueError(f"a {largest}-token reservation needs {largest * bytes_per_token} "
                         f"bytes; the memory budget is {memory_bytes}")
    pool = atb_mem.MemPool(memory_bytes, alignment=bytes_per_token, backing=None,
                           max_allocations=max(1, min(1 << 20, memory_bytes // bytes_per_token)))
    core = pool.core  # a malloc or free per request, the stats per step: no Python frame each
    waiting: deque[int] = deque()
    running: dict[int, list[Any]] = {}  # id -> [allocation, reserved tokens, computed, sampled]
    finish: dict[int, float] = {}
    timeline = _Timeline()
    now, next_request = 0.0, 0
    while len(finish) < len(requests):
        while next_request < len(requests) and requests[next_request].arrival <= now:
            waiting.append(next_request)
            next_request += 1
        while waiting and len(running) < max_num_seqs:
            request = requests[waiting[0]]
            tokens = request.prompt + request.output if exact else max_model_len
            try:
                allocation = core.malloc(tokens * bytes_per_token)
            except atb_mem.OutOfMemoryError:
                break  # head of line waits for memory
            running[waiting.popleft()] = [allocation, tokens, 0, 0]
        budget, batched, done = max_num_batched_tokens, 0, []
        for seq_id, state in running.items():
            request = requests[seq_id]
            if budget == 0:
                break
            remaining_prompt = request.prompt - state[2]
            tokens = min(remaining_prompt, budget) if remaining_prompt > 0 else 1
            state[2] += tokens
            budget -= tokens
            batched += tokens
            if state[2] >= request.prompt:
                state[3] += 1
                if state[3] == request.output:
                    done.append(seq_id)
        if batched:
            used = sum(min(s[2] + (s[3] > 0), s[1]) for s in running.values())
            reserved = sum(s[1] for s in running.values())
            seconds = cost.step_seconds(batched)
            timeline.record(now, seconds, used, reserved, len(running),
                            core.stats()["fragmentation"])
            now += seconds
        elif next_request < len(requests):
            now = max(now, requests[next_request].arrival)
        for seq_id in done:
            core.free(running.pop(seq_id)[0])
            finish[seq_id] = now
    name = "contiguous-exact" if exact else "contiguous-max"
    return _result(name, None, requests, finish, now, timeline, 0, external=exact)


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: str) -> int:
    return kv_layout_bytes(num_layers, num_kv_heads, head_dim, dtype, 1)[1]


def max_length(requests: list[Request]) -> int:
    return max(r.prompt + r.output for r in requests)



"""Scheduler benchmarks (issue 5).

    python -m pytest benches/test_bench_scheduling.py --benchmark-enable --benchmark-only -s

- step() overhead with 256 and 4,096 running sequences (linear: 4,096 costs about 16x);
- a replay of the Azure code trace under a cost model (step time = 5 ms + 0.02 ms per batched
  token), continuous batching against static batching of the same requests;
- request batching's added latency (submit to batch release) at 10%, 50% and 90% load.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import atb_mem
from atb_mem.tools import simulate, workloads

# The first 1,000 requests of the Azure code trace (tests/data/README.md says whence).
TRACE = Path(__file__).resolve().parents[1] / "tests" / "data" / "azure_llm_code_2023.csv"
STEP_BASE, STEP_PER_TOKEN = 0.005, 2e-5


@pytest.mark.parametrize("running", [256, 4096])
def test_step_overhead(benchmark, running: int) -> None:
    """step() + on_tokens() with `running` decoding sequences: the cost must stay linear."""
    run, _ = workloads.scheduler_step_workload(running)
    rounds = 300 if running <= 256 else 60
    benchmark.pedantic(run, rounds=rounds, iterations=1)
    if benchmark.stats is not None:
        print(f"\nstep()+on_tokens() with {running} running: "
              f"{benchmark.stats.stats.median * 1e6:.1f} us (median of {rounds})")


def load_trace(limit: int, speedup: float) -> list[tuple[float, int, int]]:
    return [(r.arrival / speedup, r.prompt, r.output) for r in simulate.load_trace(TRACE, limit)]


def continuous(trace: list[tuple[float, int, int]]) -> tuple[float, list[float]]:
    requests = [simulate.Request(*row) for row in trace]
    # 8,192 blocks of 16 tokens: bytes_per_token=1 makes the budget a token count.
    result = simulate.replay_paged(requests, 8192 * 16, 1, 16, max_num_seqs=64,
                                   max_num_batched_tokens=8192,
                                   cost=simulate.CostModel(STEP_BASE, STEP_PER_TOKEN))
    return result.makespan, result.latencies


def static(trace: list[tuple[float, int, int]], batch_size: int = 64) -> tuple[float, list[float]]:
    """Classic static batching: take up to `batch_size` waiting requests, prefill them all,
    decode until the longest is done (finished rows still occupy the batch), answer all."""
    now, next_request, latencies = 0.0, 0, [0.0] * len(trace)
    while next_request < len(trace):
        now = max(now, trace[next_request][0])
        batch = [i for i in range(next_request, len(trace)) if trace[i][0] <= now][:batch_size]
        next_request = batch[-1] + 1
        prompt_tokens = sum(trace[i][1] for i in batch)
        now += (prompt_tokens // 8192 + 1) * STEP_BASE + STEP_PER_TOKEN * prompt_tokens
        longest = max(trace[i][2] for i in batch)
        now += (longest - 1) * (STEP_BASE + STEP_PER_TOKEN * len(batch))
        for i in batch:
            latencies[i] = now - trace[i][0]
    return now, latencies


@pytest.mark.parametrize("speedup", [1.0, 4.0])
def test_trace_replay_continuous_against_static(benchmark, speedup: float) -> None:
    """The first 1,000 requests, arriving as recorded or `speedup` times faster."""
    trace = load_trace(1000, speedup=speedup)
    results = benchmark.pedantic(lambda: (continuous(trace), static(trace)), rounds=1,
                                 iterations=1)
    outputs = sum(generated for _, _, generated in trace)
    for name, (makespan, latencies) in zip(("continuous", "static"), results, strict=True):
        p50, p90, p99 = np.percentile(latencies, [50, 90, 99])
        print(f"\n{name:>10} (arrivals x{speedup:g}): {outputs / makespan:8.1f} output "
              f"tokens/s over {makespan:7.1f} s; "
              f"latency p50 {p50:6.2f} s, p90 {p90:6.2f} s, p99 {p99:6.2f} s")
    assert results[0][0] <= results[1][0]  # continuous batching is never slower here


@pytest.mark.parametrize("load", [0.1, 0.5, 0.9])
def test_request_batching_added_latency(benchmark, load: float) -> None:
    """A server that takes 20 ms + 2 ms per item serves full batches of 8 at 222 requests/s;
    Poisson arrivals at `load` of that. Added latency = batch release - submit."""
    capacity = 8 / (0.020 + 0.002 * 8)
    rng = np.random.default_rng(20240607)
    arrivals = np.cumsum(rng.exponential(1 / (load * capacity), 3000))

    def simulate() -> list[float]:
        clock = [0.0]
        batcher = atb_mem.DynamicBatchScheduler(max_batch_size=8, timeout_ms=50,
                                                clock=lambda: clock[0])
        submitted: dict[int, float] = {}
        waits: list[float] = []
        busy_until, next_arrival = 0.0, 0
        futures = []
        while len(waits) < len(arrivals):
            clock[0] = min(a for a in (arrivals[next_arrival] if next_arrival < len(arrivals)
                                       else np.inf, max(busy_until, clock[0] + 0.001)))
            while next_arrival < len(arrivals) and arrivals[next_arrival] <= clock[0]:
                futures.append(batcher.submit(next_arrival))
                submitted[next_arrival] = arrivals[next_arrival]
                next_arrival += 1
            if clock[0] >= busy_until and (batch := batcher.next_batch(timeout=0)):
                waits.extend(clock[0] - submitted[i] for i in batch.items)
                busy_until = clock[0] + 0.020 + 0.002 * len(batch)
                batch.set_results(batch.items)
        return waits

    waits = benchmark.pedantic(simulate, rounds=1, iterations=1)
    p50, p90, p99 = np.percentile(waits, [50, 90, 99]) * 1000
    print(f"\nrequest batching at {load:.0%} load: added latency p50 {p50:.1f} ms, "
          f"p90 {p90:.1f} ms, p99 {p99:.1f} ms")
    assert len(waits) == 3000

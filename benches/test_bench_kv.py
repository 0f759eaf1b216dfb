"""Workloads W1-W3 of issue 2 (pytest-benchmark); the workloads are atb_mem.tools.workloads'.

    python -m pytest benches --benchmark-enable --benchmark-only --benchmark-columns=median,rounds

Each test prints its per-operation figure (median over rounds). A pool of 65,536 blocks of
16 tokens, numpy seed 20240607.
"""

from __future__ import annotations

import pytest

from atb_mem.tools import workloads


def report(benchmark, name: str, per: float, unit: str, count: int) -> None:
    if benchmark.stats is None:  # --benchmark-disable: ran once as a test, nothing timed
        return
    median = benchmark.stats.stats.median
    benchmark.extra_info[name] = median / count * per
    print(f"\n{name}: {median / count * per:.1f} {unit} (median of "
          f"{benchmark.stats.stats.rounds} rounds)")


def test_w1_churn(benchmark) -> None:
    """Allocate one block's worth of tokens for a sequence and free it, 1,000,000 times,
    calling the pool's core (``kv.core``)."""
    run, pairs = workloads.churn_workload(1_000_000)
    benchmark.pedantic(run, rounds=5, iterations=1, warmup_rounds=1)
    report(benchmark, "W1 ns per alloc+free pair", 1e9, "ns", pairs)


def test_w1_churn_through_wrapper(benchmark) -> None:
    """W1 through ``KVCachePool``'s forwarding methods: less W1 is what their two Python
    frames cost."""
    run, pairs = workloads.churn_workload(1_000_000, through_wrapper=True)
    benchmark.pedantic(run, rounds=5, iterations=1, warmup_rounds=1)
    report(benchmark, "W1 ns per alloc+free pair, through KVCachePool", 1e9, "ns", pairs)


@pytest.mark.parametrize("kv_events", [False, True], ids=["events_off", "events_on"])
@pytest.mark.parametrize("mode", ["batch_table", "rebuild"])
def test_w2_decode(benchmark, mode: str, kv_events: bool) -> None:
    """256 running sequences, 2,000 steps; finished ones freed and replaced."""
    run, steps = workloads.decode_workload(2000, batch_table=mode == "batch_table",
                                           kv_events=kv_events)
    benchmark.pedantic(run, rounds=5, iterations=1, warmup_rounds=1)
    events = "events on" if kv_events else "events off"
    report(benchmark, f"W2 us per decode step ({mode}, {events}, incl. replacing finished)",
           1e6, "us", steps)


@pytest.mark.parametrize("kv_events", [False, True], ids=["events_off", "events_on"])
def test_w3_prefix(benchmark, kv_events: bool) -> None:
    """10,000 requests sharing a 1,024-token system prompt; allocate with ids, free (and, with
    events, drain them after each request)."""
    prompts = workloads.prefix_prompts(10_000)
    run, requests = workloads.prefix_workload(prompts, kv_events=kv_events)
    # The exact possible hit rate: every request but the first hits the 64 system blocks.
    queries = sum((len(p) - 1) // workloads.BLOCK_SIZE for p in prompts)
    exact = (len(prompts) - 1) * (1024 // workloads.BLOCK_SIZE) / queries
    stats = benchmark.pedantic(run, rounds=5, iterations=1, warmup_rounds=1)
    assert stats["prefix_cache_queries"] == queries
    assert stats["prefix_cache_hit_rate"] == pytest.approx(exact, abs=1e-12)
    report(benchmark, f"W3 us per request (events {'on' if kv_events else 'off'})", 1e6, "us",
           requests)
    print(f"W3 block hit rate {stats['prefix_cache_hit_rate']:.6f} (exact possible {exact:.6f})")


def test_w2_batch_table_call_alone(benchmark) -> None:
    """Just the per-step call: 256 rows, one BatchTable.append_tokens()."""
    import atb_mem

    prompts, _ = workloads.decode_lengths(256)
    kv = atb_mem.KVCachePool(workloads.NUM_BLOCKS, workloads.BLOCK_SIZE, device=None)
    table = kv.batch_table(256, (4096 + 2048) // workloads.BLOCK_SIZE)
    for seq_id, prompt in enumerate(prompts):
        kv.alloc_sequence(seq_id, prompt)
        table.add(seq_id)
    benchmark.pedantic(table.append_tokens, rounds=2000, iterations=1)
    steps = benchmark.stats.stats.rounds if benchmark.stats else 1
    assert int(table.context_lens.sum()) == sum(prompts) + 256 * steps
    if benchmark.stats is not None:
        print(f"\nW2 BatchTable.append_tokens() alone: "
              f"{benchmark.stats.stats.median * 1e6:.2f} us (median step)")

"""Workloads W1-W3 of issue 2 (pytest-benchmark).

    python -m pytest benches --benchmark-enable --benchmark-only --benchmark-columns=median,rounds

Each test prints its per-operation figure (median over rounds). A pool of 65,536 blocks of
16 tokens, numpy seed 20240607.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

import atb_mem

NUM_BLOCKS = 65_536
BLOCK_SIZE = 16
SEED = 20240607


def report(benchmark, name: str, per: float, unit: str, count: int) -> None:
    if benchmark.stats is None:  # --benchmark-disable: ran once as a test, nothing timed
        return
    median = benchmark.stats.stats.median
    benchmark.extra_info[name] = median / count * per
    print(f"\n{name}: {median / count * per:.1f} {unit} (median of "
          f"{benchmark.stats.stats.rounds} rounds)")


def test_w1_churn(benchmark) -> None:
    """Allocate one block's worth of tokens for a sequence and free it, 1,000,000 times."""
    kv = atb_mem.KVCachePool(NUM_BLOCKS, BLOCK_SIZE)
    pairs = 1_000_000

    def churn() -> None:
        alloc, free = kv.alloc_sequence, kv.free_sequence
        for seq_id in range(pairs):
            alloc(seq_id, BLOCK_SIZE)
            free(seq_id)

    benchmark.pedantic(churn, rounds=5, iterations=1, warmup_rounds=1)
    assert len(kv) == 0 and kv.num_free_blocks == NUM_BLOCKS - 1
    report(benchmark, "W1 ns per alloc+free pair", 1e9, "ns", pairs)


@dataclass
class DecodeWorkload:
    prompts: np.ndarray
    outputs: np.ndarray


def decode_workload(num_requests: int = 20_000) -> DecodeWorkload:
    rng = np.random.default_rng(SEED)
    prompts = np.clip(np.rint(rng.lognormal(np.log(300), 1.0, num_requests)), 8, 4096)
    outputs = np.clip(np.rint(rng.lognormal(np.log(200), 1.0, num_requests)), 1, 2048)
    return DecodeWorkload(prompts.astype(np.int64), outputs.astype(np.int64))


RUNNING = 256
STEPS = 2_000
MAX_BLOCKS = (4096 + 2048) // BLOCK_SIZE


def run_decode(workload: DecodeWorkload, step: Callable[..., None], use_batch_table: bool) -> int:
    """256 running sequences; every step appends one token to each; finished sequences are
    freed and replaced (prefill allocates the whole prompt). Returns the tokens appended."""
    kv = atb_mem.KVCachePool(NUM_BLOCKS, BLOCK_SIZE)
    batch = kv.batch_table(RUNNING, MAX_BLOCKS)
    # Row i of `running` holds a sequence id; a replacement takes its predecessor's row.
    running = np.zeros(RUNNING, dtype=np.int64)
    finishing: dict[int, list[int]] = {}  # step -> rows whose sequence ends after it
    prompts, outputs = workload.prompts.tolist(), workload.outputs.tolist()
    next_request = 0

    def admit(row: int, now: int) -> None:
        nonlocal next_request
        seq_id = next_request
        next_request += 1
        kv.alloc_sequence(seq_id, prompts[seq_id])
        running[row] = seq_id
        finishing.setdefault(now + outputs[seq_id], []).append(row)
        if use_batch_table:
            batch.add(seq_id)

    for row in range(RUNNING):
        admit(row, 0)
    for now in range(1, STEPS + 1):
        step(kv, batch, running)
        for row in finishing.pop(now, ()):
            seq_id = int(running[row])
            if use_batch_table:
                batch.remove(seq_id)
            kv.free_sequence(seq_id)
            admit(row, now)
    return STEPS * RUNNING


def step_batch_table(kv, batch, running) -> None:
    batch.append_tokens()


def step_rebuild(kv, batch, running) -> None:
    kv.append_tokens(running)
    kv.block_tables(running)
    kv.context_lens(running)


@pytest.mark.parametrize("mode", ["batch_table", "rebuild"])
def test_w2_decode(benchmark, mode: str) -> None:
    workload = decode_workload()
    use_batch_table = mode == "batch_table"
    step = step_batch_table if use_batch_table else step_rebuild
    appended = benchmark.pedantic(run_decode, args=(workload, step, use_batch_table),
                                  rounds=5, iterations=1, warmup_rounds=1)
    assert appended == RUNNING * STEPS
    report(benchmark, f"W2 us per decode step ({mode}, incl. replacing finished)", 1e6, "us",
           STEPS)


def test_w2_decode_step_only(benchmark) -> None:
    """Just the per-step call: 256 rows, one BatchTable.append_tokens()."""
    workload = decode_workload()
    kv = atb_mem.KVCachePool(NUM_BLOCKS, BLOCK_SIZE)
    batch = kv.batch_table(RUNNING, MAX_BLOCKS)
    for seq_id in range(RUNNING):
        kv.alloc_sequence(seq_id, int(workload.prompts[seq_id]))
        batch.add(seq_id)
    benchmark.pedantic(batch.append_tokens, rounds=STEPS, iterations=1)
    assert int(batch.context_lens.sum()) > int(workload.prompts[:RUNNING].sum())
    if benchmark.stats is None:
        return
    print(f"\nW2 BatchTable.append_tokens() alone: {benchmark.stats.stats.median * 1e6:.2f} us "
          "(median step)")


def prefix_requests(num_requests: int = 10_000) -> list[np.ndarray]:
    rng = np.random.default_rng(SEED)
    system = rng.integers(0, 32_000, 1024, dtype=np.int32)
    requests = []
    for i in range(num_requests):
        suffix = rng.integers(0, 32_000, int(rng.integers(64, 513)), dtype=np.int32)
        suffix[0] = 100_000 + i  # unique, so the only possible hits are the system prompt's
        requests.append(np.concatenate([system, suffix]))
    return requests


def test_w3_prefix(benchmark) -> None:
    """10,000 requests sharing a 1,024-token system prompt; allocate with ids, free."""
    requests = prefix_requests()
    # The exact possible hit rate: every request but the first hits the 64 system blocks.
    queries = sum((len(r) - 1) // BLOCK_SIZE for r in requests)
    exact = (len(requests) - 1) * (1024 // BLOCK_SIZE) / queries

    def serve() -> dict:
        kv = atb_mem.KVCachePool(NUM_BLOCKS, BLOCK_SIZE)
        for seq_id, tokens in enumerate(requests):
            kv.alloc_sequence(seq_id, tokens)
            kv.free_sequence(seq_id)
        return kv.stats()

    stats = benchmark.pedantic(serve, rounds=5, iterations=1, warmup_rounds=1)
    assert stats["prefix_cache_queries"] == queries
    assert stats["prefix_cache_hit_rate"] == pytest.approx(exact, abs=1e-12)
    report(benchmark, "W3 us per request", 1e6, "us", len(requests))
    print(f"W3 block hit rate {stats['prefix_cache_hit_rate']:.6f} (exact possible {exact:.6f})")

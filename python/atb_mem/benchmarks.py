"""The operation benchmarks of the earlier issues as plain functions, so that `atb-mem bench
ops` runs them without pytest. Each returns the median per-operation time of a few rounds."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np

import atb_mem

SEED = 20240607


def _median_seconds(run: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def w1_churn(pairs: int = 1_000_000, rounds: int = 3) -> float:
    """ns per alloc+free pair of one block's worth of tokens, from Python."""
    kv = atb_mem.KVCachePool(65_536, 16, device=None)

    def churn() -> None:
        alloc, free = kv.alloc_sequence, kv.free_sequence
        for seq_id in range(pairs):
            alloc(seq_id, 16)
            free(seq_id)

    return _median_seconds(churn, rounds) / pairs * 1e9


def w2_decode(steps: int = 2000, rounds: int = 3) -> float:
    """µs per decode step of 256 running sequences through a BatchTable, finished sequences
    freed and replaced."""
    rng = np.random.default_rng(SEED)
    prompts = np.clip(np.rint(rng.lognormal(np.log(300), 1.0, 20_000)), 8, 4096).astype(int)
    outputs = np.clip(np.rint(rng.lognormal(np.log(200), 1.0, 20_000)), 1, 2048).astype(int)

    def run() -> None:
        kv = atb_mem.KVCachePool(65_536, 16, device=None)
        batch = kv.batch_table(256, (4096 + 2048) // 16)
        finishing: dict[int, list[int]] = {}
        running = [0] * 256
        next_request = 0

        def admit(row: int, now: int) -> None:
            nonlocal next_request
            seq_id, next_request = next_request, next_request + 1
            kv.alloc_sequence(seq_id, int(prompts[seq_id]))
            running[row] = seq_id
            finishing.setdefault(now + int(outputs[seq_id]), []).append(row)
            batch.add(seq_id)

        for row in range(256):
            admit(row, 0)
        for now in range(1, steps + 1):
            batch.append_tokens()
            for row in finishing.pop(now, ()):
                batch.remove(running[row])
                kv.free_sequence(running[row])
                admit(row, now)

    return _median_seconds(run, rounds) / steps * 1e6


def w3_prefix(requests: int = 10_000, rounds: int = 3) -> tuple[float, float]:
    """(µs per request, block hit rate): a shared 1,024-token system prompt plus a unique
    suffix of 64 to 512 tokens, allocated with token ids and freed."""
    rng = np.random.default_rng(SEED)
    system = rng.integers(0, 32_000, 1024, dtype=np.int32)
    prompts = []
    for i in range(requests):
        suffix = rng.integers(0, 32_000, int(rng.integers(64, 513)), dtype=np.int32)
        suffix[0] = 100_000 + i
        prompts.append(np.concatenate([system, suffix]))
    hit_rate = 0.0

    def run() -> None:
        nonlocal hit_rate
        kv = atb_mem.KVCachePool(65_536, 16, device=None)
        for seq_id, tokens in enumerate(prompts):
            kv.alloc_sequence(seq_id, tokens)
            kv.free_sequence(seq_id)
        hit_rate = kv.stats()["prefix_cache_hit_rate"]

    return _median_seconds(run, rounds) / requests * 1e6, hit_rate


def mem_pool_pair(pairs: int = 1_000_000, rounds: int = 3) -> float:
    """ns per MemPool malloc+free pair of 256 KiB, from Python."""
    pool = atb_mem.MemPool(1 << 30, backing=None)

    def churn() -> None:
        malloc, free = pool.malloc, pool.free
        for _ in range(pairs):
            free(malloc(262_144))

    return _median_seconds(churn, rounds) / pairs * 1e9


def scheduler_step(steps: int = 300) -> float:
    """µs per ContinuousBatchScheduler step + on_tokens with 256 running decodes."""
    rng = np.random.default_rng(SEED)
    kv = atb_mem.KVCachePool(65_536, 16, device=None)
    scheduler = atb_mem.ContinuousBatchScheduler(kv, max_num_seqs=256,
                                                 max_num_batched_tokens=8192)
    for seq_id, prompt in enumerate(np.clip(np.rint(rng.lognormal(np.log(300), 1.0, 256)),
                                            8, 4096).astype(int).tolist()):
        scheduler.add_request(seq_id, prompt, 1_000_000)
    while True:
        plan = scheduler.step(now=0.0)
        scheduler.on_tokens(plan.sample_seq_ids, plan.sample_seq_ids % 1000)
        if len(plan.decode_seq_ids) == 256:
            break
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        plan = scheduler.step(now=0.0)
        scheduler.on_tokens(plan.sample_seq_ids, plan.sample_seq_ids % 1000)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6

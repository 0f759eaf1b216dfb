"""The operation workloads of the earlier issues, shared by `atb-mem bench ops` (which times
them itself) and the pytest-benchmark suite in ``benches/`` (which times them with
pytest-benchmark). Each ``*_workload`` function prepares what it needs and returns the
callable to time and how many operations one call performs."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np

import atb_mem
from atb_mem._types import KVCachePoolStats

SEED = 20240607
NUM_BLOCKS, BLOCK_SIZE = 65_536, 16
_Result = TypeVar("_Result")
# What to time, and how many operations one call of it performs.
Workload = tuple[Callable[[], _Result], int]


def churn_workload(pairs: int = 1_000_000, *, through_wrapper: bool = False) -> Workload[None]:
    """W1: allocate one block's worth of tokens for a sequence and free it.

    The calls go to ``kv.core`` (the Rust object, as a hot loop makes them), so W1 times the
    core; with ``through_wrapper`` they go through ``KVCachePool``'s forwarding methods, which
    add a Python frame per call (the difference is that frame)."""
    kv = atb_mem.KVCachePool(NUM_BLOCKS, BLOCK_SIZE, device=None)
    calls = kv if through_wrapper else kv.core

    def churn() -> None:
        alloc, free = calls.alloc_sequence, calls.free_sequence
        for seq_id in range(pairs):
            alloc(seq_id, BLOCK_SIZE)
            free(seq_id)

    return churn, pairs


def decode_lengths(count: int = 20_000) -> tuple[list[int], list[int]]:
    """W2's prompt and output lengths (lognormal around 300 and 200 tokens)."""
    rng = np.random.default_rng(SEED)
    prompts = np.clip(np.rint(rng.lognormal(np.log(300), 1.0, count)), 8, 4096)
    outputs = np.clip(np.rint(rng.lognormal(np.log(200), 1.0, count)), 1, 2048)
    return prompts.astype(int).tolist(), outputs.astype(int).tolist()


def decode_workload(steps: int = 2000, *, batch_table: bool = True, running: int = 256,
                    kv_events: bool = False) -> Workload[None]:
    """W2: `running` sequences each get a token per step, through a BatchTable (one call) or
    through append_tokens plus a full block_tables/context_lens rebuild; finished sequences
    are freed and replaced (prefill allocates the whole prompt). With ``kv_events`` the pool
    records KV-cache events and each step drains them, as an engine does. The calls go to
    the pool's core (as W1's)."""
    prompts, outputs = decode_lengths()

    def run() -> None:
        pool = atb_mem.KVCachePool(NUM_BLOCKS, BLOCK_SIZE, device=None,
                                   enable_kv_events=kv_events)
        kv = pool.core
        table = kv.batch_table(running, (4096 + 2048) // BLOCK_SIZE)
        rows = np.zeros(running, dtype=np.int64)  # a replacement takes its predecessor's row
        finishing: dict[int, list[int]] = {}
        next_request = 0

        def admit(row: int, now: int) -> None:
            nonlocal next_request
            seq_id, next_request = next_request, next_request + 1
            kv.alloc_sequence(seq_id, prompts[seq_id])
            rows[row] = seq_id
            finishing.setdefault(now + outputs[seq_id], []).append(row)
            if batch_table:
                table.add(seq_id)

        for row in range(running):
            admit(row, 0)
        for now in range(1, steps + 1):
            if batch_table:
                table.append_tokens()
            else:
                kv.append_tokens(rows)
                kv.block_tables(rows)
                kv.context_lens(rows)
            for row in finishing.pop(now, ()):
                seq_id = int(rows[row])
                if batch_table:
                    table.remove(seq_id)
                kv.free_sequence(seq_id)
                admit(row, now)
            if kv_events:
                kv.take_events()

    return run, steps


def prefix_prompts(requests: int = 10_000) -> list[np.ndarray]:
    """W3's prompts: a shared 1,024-token system prompt plus a unique 64-512-token suffix."""
    rng = np.random.default_rng(SEED)
    system = rng.integers(0, 32_000, 1024, dtype=np.int32)
    prompts = []
    for i in range(requests):
        suffix = rng.integers(0, 32_000, int(rng.integers(64, 513)), dtype=np.int32)
        suffix[0] = 100_000 + i  # unique, so the only possible hits are the system prompt's
        prompts.append(np.concatenate([system, suffix]))
    return prompts


def prefix_workload(prompts: list[np.ndarray], *, kv_events: bool = False,
                    typed: bool = False) -> Workload[KVCachePoolStats]:
    """W3: allocate each prompt with its token ids, then free it. Returns the stats. With
    ``kv_events`` the pool records KV-cache events, drained after each request (and with
    ``typed`` read as named tuples there too, rather than where they are published). The
    calls go to the pool's core (as W1's)."""

    def run() -> KVCachePoolStats:
        kv = atb_mem.KVCachePool(NUM_BLOCKS, BLOCK_SIZE, device=None,
                                 enable_kv_events=kv_events)
        core = kv.core
        for seq_id, tokens in enumerate(prompts):
            core.alloc_sequence(seq_id, tokens)
            core.mark_computed(seq_id)  # the prefill ran
            core.free_sequence(seq_id)
            if kv_events:
                events = core.take_events()
                if typed:
                    list(events)
        return kv.stats()

    return run, len(prompts)


def mem_pool_workload(pairs: int = 1_000_000) -> Workload[None]:
    """MemPool malloc + free of 256 KiB, with a few other ranges in the bins; the calls go
    to the pool's core (as W1's)."""
    pool = atb_mem.MemPool(1 << 30, backing=None)
    keep = [pool.malloc(4096 * (i % 7 + 1)) for i in range(64)]

    def churn() -> None:
        malloc, free = pool.core.malloc, pool.core.free
        for _ in range(pairs):
            free(malloc(262_144))
        assert len(pool) == len(keep)

    return churn, pairs


def scheduler_step_workload(running: int = 256, *, host_prefix: bool = False,
                            after_fork: bool = False, hash_block_size: int | None = None,
                            token_ids: bool = False) -> Workload[None]:
    """One ContinuousBatchScheduler step plus on_tokens with `running` decoding sequences;
    with `host_prefix`, over a cache with a host prefix tier (with nothing to load); with
    `after_fork`, once a request of two samples has run and finished; with
    `hash_block_size`, prefix keys that fine and one request waiting for a seat; prompts
    are given as token ids with `token_ids` or `hash_block_size`, as counts otherwise."""
    prompts, _ = decode_lengths(running)
    # Room for every prompt and a few thousand decode steps, whatever `running` is.
    needed = sum(-(-prompt // BLOCK_SIZE) for prompt in prompts) + running * 256 // BLOCK_SIZE
    kv = atb_mem.KVCachePool(max(NUM_BLOCKS, needed), BLOCK_SIZE, device=None,
                             num_host_blocks=4096 if host_prefix else None,
                             host_prefix_cache=host_prefix, hash_block_size=hash_block_size)
    scheduler = atb_mem.ContinuousBatchScheduler(kv, max_num_seqs=running,
                                                 max_num_batched_tokens=8192)
    if after_fork:
        _run_one_forked_request(scheduler, seq_id=running + 1)
    for seq_id, prompt in enumerate(prompts):
        tokens = [(seq_id * 7919 + t) % 32000 for t in range(prompt)]
        with_ids = token_ids or hash_block_size is not None
        scheduler.add_request(seq_id, tokens if with_ids else prompt, 1_000_000)
    if hash_block_size:
        scheduler.add_request(running + 2, list(range(3 * BLOCK_SIZE)), 1_000_000)
    while True:  # until every sequence decodes
        plan = scheduler.step(now=0.0)
        scheduler.on_tokens(plan.sample_seq_ids, plan.sample_seq_ids % 1000)
        if len(plan.decode_seq_ids) == running:
            break

    def step() -> None:
        plan = scheduler.step(now=0.0)
        scheduler.on_tokens(plan.sample_seq_ids, plan.sample_seq_ids % 1000)

    return step, 1


def _run_one_forked_request(scheduler: atb_mem.ContinuousBatchScheduler, seq_id: int) -> None:
    """Serves one request of two samples to its end, its fork included."""
    scheduler.add_request(seq_id, 2 * BLOCK_SIZE + 1, 3, num_samples=2)
    child, live = seq_id + 1, {seq_id}
    for _ in range(16):
        plan = scheduler.step(now=0.0)
        sampled = [s for s in plan.sample_seq_ids.tolist() if s in live]
        if seq_id in sampled and child not in live:
            scheduler.fork(seq_id, child)
            live.add(child)
            sampled.append(child)
        if sampled:
            live -= set(scheduler.on_tokens(sampled, [1] * len(sampled)).tolist())
        if not live:
            return
    raise RuntimeError("the forked request did not finish")


def median_per_operation(workload: Workload[object], rounds: int, *, warmup: bool = False,
                         synchronize: Callable[[], object] | None = None) -> float:
    """Median seconds per operation over `rounds` calls (after one untimed call with
    `warmup`); `synchronize` waits for a device to finish inside each timed call."""
    run, operations = workload
    sync = synchronize or (lambda: None)
    if warmup:
        run()
        sync()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / operations

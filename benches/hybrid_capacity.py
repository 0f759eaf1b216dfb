"""A Gemma-3-shaped model at 32k context on a fixed KV byte budget: how many sequences run
at once with KV-cache groups against a cache that keeps every block for every layer, and
what a scheduler step and a prefix lookup cost in each.

    python benches/hybrid_capacity.py [--memory-gib 40] [--context 32768] [--repeats 5]

The model: 32 layers, 5 sliding-window (1024) to 1 full, 8 KV heads × 128, bf16. Requests
are admitted until the scheduler stops admitting (the byte budget is full): prompts of
``context - 2048`` tokens prefilled in 8192-token chunks, then decoding (up to 4096 tokens, so
none ends while the cache fills); the mean context when it is full is reported. No model runs; the
scheduler plans the steps a server would run. Step and lookup costs are medians of
``--repeats`` timings (steps and lookups), measured in the same run for both caches.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import atb_mem
from atb_mem.kv.planning import block_bytes

LAYERS, KV_HEADS, HEAD_DIM, WINDOW = 32, 8, 128, 1024
LAYER_TYPES = ["full_attention" if (layer + 1) % 6 == 0 else "sliding_attention"
               for layer in range(LAYERS)]


def make_cache(memory: int, grouped: bool, block_size: int = 16) -> atb_mem.KVCachePool:
    groups = {"layer_types": LAYER_TYPES, "sliding_window": WINDOW} if grouped else {}
    shape = {"num_layers": LAYERS, "num_kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
             "dtype": "bfloat16", **groups}
    bytes_per_block, _ = block_bytes(block_size, **shape)  # type: ignore[arg-type]
    return atb_mem.KVCachePool(memory // bytes_per_block, block_size, device=None,
                               **shape)  # type: ignore[arg-type]


def fill(kv: atb_mem.KVCachePool, context: int, limit: int = 4096
         ) -> tuple[atb_mem.ContinuousBatchScheduler, int]:
    """Adds requests until none more is admitted and all admitted ones decode; returns the
    scheduler (ready to step) and how many sequences run at once."""
    scheduler = atb_mem.ContinuousBatchScheduler(kv, max_num_seqs=limit,
                                                 max_num_batched_tokens=8192)
    rng = np.random.default_rng(0)
    next_id = 0
    while True:
        if scheduler.stats()["waiting"] == 0:
            prompt = rng.integers(0, 32000, context - 2048).tolist()
            scheduler.add_request(next_id, prompt, 4096)
            next_id += 1
        plan = scheduler.step()
        scheduler.on_tokens(plan.sample_seq_ids, np.ones(len(plan.sample_seq_ids), np.int32))
        stats = scheduler.stats()
        if stats["waiting"] and len(plan.prefill_seq_ids) == 0:
            # Timed steps decode only: the request left waiting would be looked up (its
            # prompt hashed) every step, the same in both caches.
            scheduler.abort(next_id - 1)
            return scheduler, stats["running"]


def step(scheduler: atb_mem.ContinuousBatchScheduler) -> float:
    """Seconds of one decode step of every running sequence (plan + tokens)."""
    start = time.perf_counter()
    plan = scheduler.step()
    scheduler.on_tokens(plan.sample_seq_ids, np.ones(len(plan.sample_seq_ids), np.int32))
    return time.perf_counter() - start


def time_steps(schedulers: list[atb_mem.ContinuousBatchScheduler],
               repeats: int) -> list[float]:
    """Median seconds of a decode step of each scheduler, stepped in turn (the machine's
    noise hits all alike), once past the first steps after the prefills (where windowed
    groups release the blocks the last prefill chunk read: a one-time cost per sequence,
    like freeing it)."""
    for _ in range(100):
        for scheduler in schedulers:
            step(scheduler)
    times: list[list[float]] = [[] for _ in schedulers]
    for _ in range(repeats):
        for scheduler, timed in zip(schedulers, times, strict=True):
            timed.append(step(scheduler))
    return [statistics.median(timed) for timed in times]


def time_lookup(kv: atb_mem.KVCachePool, context: int, repeats: int) -> float:
    """Median seconds to look up a cached ``context``-token prompt (``can_allocate``)."""
    prompt = np.random.default_rng(1).integers(0, 32000, context).tolist()
    kv.alloc_sequence(1 << 40, prompt)
    kv.mark_computed(1 << 40)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        kv.can_allocate(prompt)
        times.append(time.perf_counter() - start)
    kv.free_sequence(1 << 40)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory-gib", type=float, default=40.0)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    memory = int(args.memory_gib * 2**30)
    rows = {}
    for grouped in (False, True):
        kv = make_cache(memory, grouped)
        lookup = time_lookup(kv, args.context, args.repeats)
        scheduler, running = fill(kv, args.context)
        mean_context = kv.stats()["num_tokens"] / running
        rows[grouped] = [running, 0.0, lookup, len(kv.groups), mean_context, scheduler, kv]
    # Each cache full, stepped in turn.
    rows[False][1], rows[True][1] = time_steps([rows[False][5], rows[True][5]], args.repeats)
    # The same batch in both: the grouped cache keeps as many sequences as the other holds.
    plain_running = rows[False][0]
    scheduler, kv = rows[True][5], rows[True][6]
    for seq_id in sorted(kv.seq_ids())[plain_running:]:
        scheduler.abort(seq_id)
    plain_step, same_batch_step = time_steps([rows[False][5], scheduler], args.repeats)
    print(f"{args.memory_gib:g} GiB of bf16 K/V, {args.context}-token contexts, Gemma-3 shape")
    print(f"{'cache':<22}{'groups':>7}{'running':>9}{'context':>9}{'step ms':>10}"
          f"{'per seq us':>12}{'lookup ms':>11}")
    for grouped, (running, step_time, lookup, groups, context, *_) in rows.items():
        name = "KV-cache groups" if grouped else "every block kept"
        print(f"{name:<22}{groups:>7}{running:>9}{context:>9.0f}{step_time * 1e3:>10.2f}"
              f"{step_time / running * 1e6:>12.1f}{lookup * 1e3:>11.2f}")
    hybrid, step_time, lookup = rows[True][:3]
    print(f"concurrency x{hybrid / plain_running:.2f}; decode step at {plain_running} "
          f"sequences x{same_batch_step / plain_step:.2f} ({same_batch_step * 1e3:.3f} ms); "
          f"per sequence at full concurrency "
          f"x{(step_time / hybrid) / (rows[False][1] / plain_running):.2f}"
          f"; prefix lookup x{lookup / rows[False][2]:.2f}")


if __name__ == "__main__":
    main()

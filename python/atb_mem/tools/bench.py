"""``atb-mem bench``: the operation benchmarks (``ops``) and the KV memory strategies compared
on a replayed trace (``fragmentation``)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import click
from rich.progress import Progress
from rich.table import Table

from atb_mem._core import EVICTION_POLICIES
from atb_mem.tools.options import (
    SIZE,
    CommaList,
    console,
    model_dimensions,
    model_options,
    require_matplotlib,
    write_json,
)

# The model the fragmentation replay sizes its tokens for when no --model-config is given.
FRAGMENTATION_MODEL = {"layers": 32, "kv_heads": 8, "head_dim": 128}


@click.group()
def bench() -> None:
    """Benchmarks."""


@bench.command("ops")
@click.option("--quick", is_flag=True, help="Smaller workloads (seconds, not a minute).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
def bench_ops(quick: bool, json_path: str | None) -> None:
    """W1/W2/W3, MemPool and scheduler-step benchmarks as one table."""
    from atb_mem.tools import workloads

    scale = 20 if quick else 1
    rounds = 1 if quick else 3
    prompts = workloads.prefix_prompts(10_000 // scale)
    measured: list[tuple[str, str, str, Callable[[], Any]]] = [
        ("W1 alloc+free pair", "ns", "<= 150", lambda: 1e9 * workloads.median_per_operation(
            workloads.churn_workload(1_000_000 // scale), rounds)),
        ("W2 decode step via BatchTable (256 seqs)", "us", "<= 15",
         lambda: 1e6 * workloads.median_per_operation(
             workloads.decode_workload(2000 // scale), rounds)),
        ("W3 prefix request", "us", "<= 30", lambda: (
            1e6 * workloads.median_per_operation(workloads.prefix_workload(prompts), rounds),
            workloads.prefix_workload(prompts)[0]()["prefix_cache_hit_rate"])),
        ("MemPool malloc+free pair", "ns", "<= 300", lambda: 1e9 * workloads.median_per_operation(
            workloads.mem_pool_workload(1_000_000 // scale), rounds)),
        ("scheduler step + on_tokens (256 running)", "us", "<= 50",
         lambda: 1e6 * workloads.median_per_operation(
             workloads.scheduler_step_workload(), 300 // scale)),
    ]
    results = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("benchmarks", total=len(measured))
        for name, unit, target, run in measured:
            progress.update(task, description=name)
            value = run()
            extra = {}
            if isinstance(value, tuple):
                value, extra = value[0], {"block_hit_rate": value[1]}
            results.append({"name": name, "value": value, "unit": unit, "target": target,
                            **extra})
            progress.advance(task)
    table = Table(title="atb-mem operation benchmarks" + (" (quick)" if quick else ""))
    for column in ("workload", "median", "unit", "target"):
        table.add_column(column, justify="right" if column != "workload" else "left")
    for row in results:
        table.add_row(row["name"], f"{row['value']:.1f}", row["unit"], row["target"])
    console.print(table)
    write_json(json_path, {"quick": quick, "results": results})


@bench.command("fragmentation")
@click.option("--trace", type=click.Path(dir_okay=False), default=None,
              help="TIMESTAMP,ContextTokens,GeneratedTokens CSV (default: a synthetic workload).")
@click.option("--requests", "limit", type=click.IntRange(min=1), default=None,
              help="Replay only the first N requests (default: the whole trace, or 500 "
                   "synthetic ones).")
@click.option("--block-sizes", type=CommaList(int, "ints"), default="1,8,16,32,64,128,256",
              show_default=True)
@click.option("--memory", type=SIZE, default="8GiB", show_default=True,
              help="KV memory budget shared by every strategy.")
@model_options(FRAGMENTATION_MODEL)
@click.option("--max-model-len", type=click.IntRange(min=1), default=None,
              help="Reservation of contiguous-max (default: the longest request).")
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--max-num-batched-tokens", type=click.IntRange(min=1), default=8192,
              show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="PNG of fragmentation and concurrency over time and per block size.")
def bench_fragmentation(trace: str | None, limit: int, block_sizes: list[int], memory: int,
                        model_config: str | None, layers: int | None, kv_heads: int | None,
                        head_dim: int | None, dtype: str | None, max_model_len: int | None,
                        max_num_seqs: int, max_num_batched_tokens: int, json_path: str | None,
                        plot_path: str | None) -> None:
    """Replays requests through continuous batching for each KV memory strategy on the same
    memory budget: paged blocks per block size, contiguous max-length and exact-size
    reservations."""
    from atb_mem.tools import simulate

    layers, kv_heads, head_dim, dtype, model = model_dimensions(model_config, layers, kv_heads,
                                                                head_dim, dtype,
                                                                FRAGMENTATION_MODEL)
    groups = model.group_arguments() if model is not None else {}
    if plot_path:
        require_matplotlib()
    if any(size < 1 for size in block_sizes):
        raise click.BadParameter("block sizes must be >= 1", param_hint="--block-sizes")
    requests = (simulate.load_trace(trace, limit) if trace
                else simulate.synthetic_workload(limit or 500))
    token_bytes = simulate.bytes_per_token(layers, kv_heads, head_dim, dtype)
    longest = simulate.max_length(requests)
    max_model_len = max_model_len or longest
    if max_model_len < longest:
        raise click.BadParameter(f"the trace has a {longest}-token request",
                                 param_hint="--max-model-len")
    runs: list[tuple[str, Callable[[], simulate.ReplayResult]]] = [
        (f"paged, block size {size}",
         partial(simulate.replay_paged, requests, memory, token_bytes, size,
                 max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens))
        for size in block_sizes]
    # A hybrid model: the same blocks as KV-cache groups, windows keeping only their window.
    runs += [(f"paged with groups, block size {size}",
              partial(simulate.replay_paged, requests, memory, token_bytes, size,
                      max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                      num_layers=layers, groups=groups))
             for size in block_sizes if groups]
    runs += [(f"contiguous {kind}",
              partial(simulate.replay_reserved, requests, memory, token_bytes, exact=exact,
                      max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=max_num_batched_tokens))
             for kind, exact in (("max", False), ("exact", True))]
    results = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("replay", total=len(runs))
        for name, run in runs:
            progress.update(task, description=name)
            results.append(run())
            progress.advance(task)
    table = Table(title=f"{len(requests)} requests, {memory / 2**30:.2f} GiB of KV memory, "
                        f"{token_bytes // 1024} KiB per token")
    for column in ("strategy", "block", "internal frag", "external frag", "peak seqs",
                   "mean seqs", "preempt", "tok/s", "p50 s", "p99 s"):
        table.add_column(column, justify="left" if column == "strategy" else "right")
    for result in results:
        table.add_row(result.strategy, str(result.block_size or "-"),
                      f"{result.internal_fragmentation:.3f}",
                      "-" if result.external_fragmentation is None
                      else f"{result.external_fragmentation:.3f}",
                      str(result.peak_concurrency), f"{result.mean_concurrency:.1f}",
                      str(result.preemptions), f"{result.throughput:.1f}",
                      f"{result.latency_p50:.2f}", f"{result.latency_p99:.2f}")
    console.print(table)
    write_json(json_path, {"requests": len(requests), "memory_bytes": memory,
                           "bytes_per_token": token_bytes, "max_model_len": max_model_len,
                           "results": [result.summary() for result in results]})
    if plot_path:
        plot_fragmentation(results, plot_path)


def plot_fragmentation(results: list[Any], path: str) -> None:
    plt = require_matplotlib()
    figure, (over_time, concurrency, per_size) = plt.subplots(1, 3, figsize=(16, 4.5))
    for result in results:
        label = result.strategy + (f" {result.block_size}" if result.block_size else "")
        times = [point[0] for point in result.timeline]
        # Step plots: a value holds until the next step (idle gaps stay flat).
        over_time.plot(times, [point[1] for point in result.timeline], label=label, lw=0.7,
                       alpha=0.8, drawstyle="steps-post")
        concurrency.plot(times, [point[2] for point in result.timeline], label=label, lw=0.7,
                         alpha=0.8, drawstyle="steps-post")
    paged = [r for r in results if r.block_size]
    per_size.plot([r.block_size for r in paged], [r.internal_fragmentation for r in paged],
                  marker="o")
    per_size.set_xscale("log", base=2)
    over_time.set(title="KV fragmentation over time", xlabel="s", ylabel="internal")
    concurrency.set(title="concurrent sequences", xlabel="s")
    per_size.set(title="paged: fragmentation by block size", xlabel="block size",
                 ylabel="time-weighted internal")
    over_time.legend(fontsize=6)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


@bench.command("prefix")
@click.option("--trace", type=click.Path(dir_okay=False, exists=True), required=True,
              help="TIMESTAMP,ContextTokens,GeneratedTokens CSV: its lengths shape the prompts.")
@click.option("--requests", "limit", type=click.IntRange(min=1), default=None,
              help="Replay only the first N requests.")
@click.option("--policies", type=CommaList(str, "eviction policies"),
              default=",".join(EVICTION_POLICIES), show_default=True,
              help="priority: each request pins its system prompt at 100.")
@click.option("--block-sizes", type=CommaList(int, "ints"), default="16,128", show_default=True)
@click.option("--hash-block-sizes", type=CommaList(int, "ints"), default="16", show_default=True,
              help="Prefix keys finer than a block: each also replays every block size it "
                   "divides with hits every that many tokens (shown as block/hash).")
@click.option("--cache-blocks", type=CommaList(int, "ints"), default="256,1024,4096",
              show_default=True, help="Cache sizes, in blocks of the smallest block size "
                                      "(larger blocks get as many tokens).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="PNG of the hit rate by cache size, per policy and block size.")
def bench_prefix(trace: str, limit: int | None, policies: list[str], block_sizes: list[int],
                 hash_block_sizes: list[int], cache_blocks: list[int], json_path: str | None,
                 plot_path: str | None) -> None:
    """Replays prompts with shared prefixes (system prompts, multi-turn histories), shaped by
    the trace, through the prefix cache per eviction policy, block size and cache size:
    hit rate, prefill tokens saved, evictions. Pick the policy by what it measures."""
    from atb_mem.tools.prefix_replay import prefix_requests, replay_prefixes

    if plot_path:
        require_matplotlib()
    if any(size < 1 for size in [*block_sizes, *hash_block_sizes]) \
            or any(size < 2 for size in cache_blocks):
        raise click.BadParameter("block sizes must be >= 1 and cache sizes >= 2 blocks")
    requests = prefix_requests(trace, limit)
    smallest = min(block_sizes)
    keyed = [(block, None) for block in block_sizes] + [
        (block, piece) for block in block_sizes for piece in hash_block_sizes
        if piece < block and block % piece == 0]
    rows: list[dict[str, Any]] = []
    for tokens in sorted(size * smallest for size in cache_blocks):
        for block_size, piece in keyed:
            for policy in policies:
                result = replay_prefixes(requests, max(2, tokens // block_size), block_size,
                                         policy, piece)
                label = f"{block_size}" if piece is None else f"{block_size}/{piece}"
                rows.append({"cache_tokens": tokens, "block_size": block_size,
                             "hash_block_size": piece or block_size, "block": label,
                             "policy": policy, **result})
    table = Table(title=f"{len(requests)} requests: the prefix cache by eviction policy")
    for column in ("cache tokens", "block", "policy", "hit rate", "prefill saved",
                   "evictions", "too long"):
        table.add_column(column, justify="left" if column == "policy" else "right")
    for row in rows:
        table.add_row(f"{row['cache_tokens']:,}", row["block"], row["policy"],
                      f"{row['hit_rate']:.3f}", f"{row['prefill_tokens_saved']:,}",
                      f"{row['evictions']:,}", str(row["skipped"]))
    console.print(table)
    write_json(json_path, {"requests": len(requests), "rows": rows})
    if plot_path:
        plt = require_matplotlib()
        figure, axes = plt.subplots(figsize=(7, 4.5))
        for label in dict.fromkeys(row["block"] for row in rows):
            for policy in policies:
                mine = [row for row in rows if row["block"] == label and row["policy"] == policy]
                axes.plot([row["cache_tokens"] for row in mine],
                          [row["hit_rate"] for row in mine], marker="o",
                          label=f"{policy}, block {label}")
        axes.set_xscale("log", base=2)
        axes.set(title="prefix-cache hit rate", xlabel="cache tokens", ylabel="hit rate")
        axes.legend(fontsize=7)
        figure.tight_layout()
        figure.savefig(plot_path, dpi=120)

"""The `atb-mem` command: capacity planning and benchmarks.

    atb-mem plan --total-memory 80GiB --model-memory 16GiB --layers 32 --kv-heads 8 \\
        --head-dim 128 --dtype float16 --max-model-len 8192
    atb-mem bench ops [--quick] [--json out.json]

Every subcommand takes ``--json PATH`` for machine-readable results. Errors are one line on
stderr and a non-zero exit code: 2 for a bad command line, 1 for anything else.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import click
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

import atb_mem
from atb_mem.kv.planning import DTYPE_ITEMSIZE, plan_kv_cache

_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1024**3, "gb": 1000**3, "gib": 1024**3, "t": 1024**4,
          "tb": 1000**4, "tib": 1024**4}


def parse_size(text: str) -> int:
    """``"64GiB"`` → bytes. KB/MB/GB/TB are decimal, KiB/MiB/GiB/TiB and bare K/M/G/T binary."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size (e.g. 64GiB, 14GB, 1048576)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


class _Size(click.ParamType):
    name = "SIZE"

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_size(value)
        except ValueError as error:
            self.fail(str(error), param, ctx)


class _List(click.ParamType):
    def __init__(self, kind: Callable[[str], Any], name: str) -> None:
        self.kind, self.name = kind, name

    def convert(self, value: Any, param: Any, ctx: Any) -> list[Any]:
        if isinstance(value, list):
            return value
        try:
            items = [self.kind(part) for part in str(value).split(",") if part.strip()]
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of {self.name}", param, ctx)
        if not items:
            self.fail("the list is empty", param, ctx)
        return items


SIZE = _Size()
DTYPES = list(DTYPE_ITEMSIZE)
# Wide tables when the output is not a terminal (a file, a CI log): rich would use 80 columns.
console = Console(width=None if sys.stdout.isatty() else 160)


def _write_json(path: str | None, payload: Any) -> None:
    if path:
        with open(path, "w") as handle:
            json.dump(payload, handle, indent=2)
            handle.write("\n")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(atb_mem.__version__, prog_name="atb-mem")
def cli() -> None:
    """atb-mem: the KV-cache memory layer of an LLM inference server."""


@cli.command()
@click.option("--total-memory", type=SIZE, required=True, help="Device memory, e.g. 80GiB.")
@click.option("--model-memory", type=SIZE, required=True, help="Weights, e.g. 16GiB.")
@click.option("--layers", type=click.IntRange(min=1), required=True)
@click.option("--kv-heads", type=click.IntRange(min=1), required=True)
@click.option("--head-dim", type=click.IntRange(min=1), required=True)
@click.option("--dtype", type=click.Choice(DTYPES),
              default="float16", show_default=True)
@click.option("--max-model-len", type=click.IntRange(min=1), required=True)
@click.option("--utilization", "utilizations", type=_List(float, "numbers"),
              default="0.8,0.85,0.9,0.95", show_default=True,
              help="gpu_memory_utilization values to tabulate.")
@click.option("--block-sizes", type=_List(int, "ints"), default="16,32,64,128",
              show_default=True)
@click.option("--safety", type=click.FloatRange(0, 1, min_open=True), default=0.9,
              show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
def plan(total_memory: int, model_memory: int, layers: int, kv_heads: int, head_dim: int,
         dtype: str, max_model_len: int, utilizations: list[float], block_sizes: list[int],
         safety: float, json_path: str | None) -> None:
    """Capacity table: blocks, bytes per block and max_num_seqs by utilization and block size."""
    rows, errors = [], []
    for utilization in utilizations:
        for block_size in block_sizes:
            try:
                result = plan_kv_cache(total_memory, model_memory,
                                       gpu_memory_utilization=utilization,
                                       block_size=block_size, num_layers=layers,
                                       num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                                       max_model_len=max_model_len, safety=safety)
            except ValueError as error:
                errors.append(f"utilization {utilization}, block size {block_size}: {error}")
                continue
            rows.append({"gpu_memory_utilization": utilization, "block_size": block_size,
                         "num_blocks": result.num_blocks,
                         "bytes_per_block": result.bytes_per_block,
                         "usable_bytes": result.usable_bytes,
                         "bytes_per_seq": result.bytes_per_seq,
                         "max_num_seqs": result.max_num_seqs})
    if not rows:
        raise click.ClickException(errors[0])
    table = Table(title=f"KV-cache capacity ({dtype}, max_model_len {max_model_len})")
    for column in ("utilization", "block size", "blocks", "bytes/block", "usable GiB",
                   "max_num_seqs"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(f"{row['gpu_memory_utilization']:.2f}", str(row["block_size"]),
                      f"{row['num_blocks']:,}", f"{row['bytes_per_block']:,}",
                      f"{row['usable_bytes'] / 2**30:.2f}", f"{row['max_num_seqs']:,}")
    console.print(table)
    for error in errors:
        console.print(f"[yellow]skipped[/yellow] {error}")
    _write_json(json_path, {"rows": rows, "skipped": errors})


@cli.group()
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
    _write_json(json_path, {"quick": quick, "results": results})


@bench.command("fragmentation")
@click.option("--trace", type=click.Path(dir_okay=False), default=None,
              help="TIMESTAMP,ContextTokens,GeneratedTokens CSV (default: a synthetic workload).")
@click.option("--requests", "limit", type=click.IntRange(min=1), default=None,
              help="Replay only the first N requests (default: the whole trace, or 500 "
                   "synthetic ones).")
@click.option("--block-sizes", type=_List(int, "ints"), default="1,8,16,32,64,128,256",
              show_default=True)
@click.option("--memory", type=SIZE, default="8GiB", show_default=True,
              help="KV memory budget shared by every strategy.")
@click.option("--layers", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--kv-heads", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--head-dim", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--dtype", type=click.Choice(DTYPES),
              default="float16", show_default=True)
@click.option("--max-model-len", type=click.IntRange(min=1), default=None,
              help="Reservation of contiguous-max (default: the longest request).")
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--max-num-batched-tokens", type=click.IntRange(min=1), default=8192,
              show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="PNG of fragmentation and concurrency over time and per block size.")
def bench_fragmentation(trace: str | None, limit: int, block_sizes: list[int], memory: int,
                        layers: int, kv_heads: int, head_dim: int, dtype: str,
                        max_model_len: int | None, max_num_seqs: int,
                        max_num_batched_tokens: int, json_path: str | None,
                        plot_path: str | None) -> None:
    """Replays requests through continuous batching for each KV memory strategy on the same
    memory budget: paged blocks per block size, contiguous max-length and exact-size
    reservations."""
    from atb_mem.tools import simulate

    if plot_path:
        _require_matplotlib()
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
    runs: list[tuple[str, Callable[[], Any]]] = [
        (f"paged, block size {size}",
         lambda size=size: simulate.replay_paged(requests, memory, token_bytes, size,
                                                 max_num_seqs=max_num_seqs,
                                                 max_num_batched_tokens=max_num_batched_tokens))
        for size in block_sizes]
    runs += [(f"contiguous {kind}",
              lambda exact=exact: simulate.replay_reserved(
                  requests, memory, token_bytes, exact=exact, max_model_len=max_model_len,
                  max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens))
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
    _write_json(json_path, {"requests": len(requests), "memory_bytes": memory,
                            "bytes_per_token": token_bytes, "max_model_len": max_model_len,
                            "results": [result.summary() for result in results]})
    if plot_path:
        _plot_fragmentation(results, plot_path)


@cli.command()
@click.option("--trace", type=click.Path(dir_okay=False), default=None,
              help="TIMESTAMP,ContextTokens,GeneratedTokens CSV (default: a synthetic workload).")
@click.option("--requests", "limit", type=click.IntRange(min=1), default=300, show_default=True)
@click.option("--total-memory", type=SIZE, default="80GiB", show_default=True)
@click.option("--model-memory", type=SIZE, default="16GiB", show_default=True)
@click.option("--activation-bytes-per-token", type=SIZE, default="256KiB", show_default=True,
              help="Memory a batched token needs outside the KV cache: what a higher "
                   "gpu_memory_utilization leaves less room for.")
@click.option("--layers", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--kv-heads", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--head-dim", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--dtype", type=click.Choice(DTYPES),
              default="float16", show_default=True)
@click.option("--latency-p99", type=click.FloatRange(min=0, min_open=True), required=True,
              help="Latency bound in seconds: configurations above it are infeasible.")
@click.option("--speedup", type=click.FloatRange(min=0, min_open=True), default=1.0,
              show_default=True, help="Replay arrivals this many times faster than recorded: "
              "a trace that does not load the system cannot tell configurations apart.")
@click.option("--trials", type=click.IntRange(min=1), default=30, show_default=True)
@click.option("--seed", type=int, default=20240607, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="PNG of the parameter-vs-throughput surface.")
def tune(trace: str | None, limit: int, total_memory: int, model_memory: int,
         activation_bytes_per_token: int, layers: int, kv_heads: int, head_dim: int,
         dtype: str, latency_p99: float, speedup: float, trials: int, seed: int,
         json_path: str | None, plot_path: str | None) -> None:
    """Searches block_size, max_num_seqs, max_num_batched_tokens and gpu_memory_utilization
    (Optuna's TPE) for the most throughput with p99 latency under the bound, replaying the
    trace as the objective. Throughput is output tokens per second of step time (serving
    capacity), so an arrival-bound trace still tells configurations apart."""
    from atb_mem.tools import simulate

    try:
        import optuna
    except ImportError as error:
        raise click.ClickException("tune needs optuna: pip install 'atb-mem[tune]'") from error
    if plot_path:
        _require_matplotlib()
    if model_memory >= total_memory:
        raise click.BadParameter("the model does not fit in the total memory",
                                 param_hint="--model-memory")
    requests = (simulate.load_trace(trace, limit) if trace
                else simulate.synthetic_workload(limit))
    requests = [simulate.Request(r.arrival / speedup, r.prompt, r.output) for r in requests]
    token_bytes = simulate.bytes_per_token(layers, kv_heads, head_dim, dtype)
    longest = simulate.max_length(requests)

    def objective(trial: Any) -> float:
        block_size = trial.suggest_categorical("block_size", [8, 16, 32, 64, 128])
        max_num_seqs = trial.suggest_int("max_num_seqs", 8, 512, log=True)
        max_batched = trial.suggest_int("max_num_batched_tokens", 512, 16384, log=True)
        utilization = trial.suggest_float("gpu_memory_utilization", 0.5, 0.99)
        kv_bytes = int(total_memory * utilization) - model_memory
        activations = max_batched * activation_bytes_per_token
        if kv_bytes <= 0 or total_memory - int(total_memory * utilization) < activations:
            trial.set_user_attr("infeasible", "activations or the model do not fit")
            return 0.0
        if kv_bytes // token_bytes < longest + 2 * block_size:
            trial.set_user_attr("infeasible", "the cache cannot hold the longest request")
            return 0.0
        result = simulate.replay_paged(requests, kv_bytes, token_bytes, block_size,
                                       max_num_seqs=max_num_seqs,
                                       max_num_batched_tokens=max_batched)
        trial.set_user_attr("latency_p99", result.latency_p99)
        trial.set_user_attr("throughput", result.capacity)
        if result.latency_p99 > latency_p99:
            trial.set_user_attr("infeasible", "p99 latency above the bound")
            return 0.0
        return result.capacity

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize",
                                sampler=optuna.samplers.TPESampler(seed=seed))
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("tuning", total=trials)
        study.optimize(objective, n_trials=trials,
                       callbacks=[lambda *_: progress.advance(task)])
    rows = [{"number": t.number, "value": t.value, **t.params, **t.user_attrs}
            for t in study.trials]
    feasible = [row for row in rows if "infeasible" not in row]
    if not feasible:
        raise click.ClickException(f"no configuration met p99 <= {latency_p99} s in "
                                   f"{trials} trials")
    best = max(feasible, key=lambda row: row["value"])
    table = Table(title=f"best of {trials} trials (p99 <= {latency_p99} s)")
    table.add_column("parameter")
    table.add_column("value", justify="right")
    for key in ("block_size", "max_num_seqs", "max_num_batched_tokens",
                "gpu_memory_utilization", "throughput", "latency_p99"):
        value = best[key]
        table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    console.print(table)
    values = [row["value"] for row in feasible]
    if len(values) > 1 and max(values) - min(values) <= 1e-9 * max(values):
        console.print("[yellow]every configuration scored the same: the workload does not load "
                      "the system; try a larger --speedup[/yellow]")
    _write_json(json_path, {"latency_p99_bound": latency_p99, "speedup": speedup, "best": best,
                            "trials": rows})
    if plot_path:
        plt = _require_matplotlib()
        figure, axes = plt.subplots(1, 4, figsize=(16, 4))
        for axis, key in zip(axes, ("block_size", "max_num_seqs", "max_num_batched_tokens",
                                    "gpu_memory_utilization"), strict=True):
            axis.scatter([row[key] for row in rows], [row["value"] for row in rows], s=12)
            axis.set(xlabel=key, ylabel="tok/s of step time (0 = infeasible)")
            if key in ("max_num_seqs", "max_num_batched_tokens"):
                axis.set_xscale("log")
        figure.tight_layout()
        figure.savefig(plot_path, dpi=120)


def _require_matplotlib() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise click.ClickException(
            "--plot needs matplotlib: pip install 'atb-mem[plot]'") from error
    return plt


def _plot_fragmentation(results: list[Any], path: str) -> None:
    plt = _require_matplotlib()
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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: click's errors and any failure become one line on stderr."""
    try:
        cli.main(args=list(argv) if argv is not None else None, prog_name="atb-mem",
                 standalone_mode=False)
    except click.exceptions.Exit as done:
        return done.exit_code
    except click.ClickException as error:
        print(f"atb-mem: error: {error.format_message()}", file=sys.stderr)
        return error.exit_code
    except click.exceptions.Abort:
        print("atb-mem: aborted", file=sys.stderr)
        return 130
    except (ValueError, TypeError, OSError, atb_mem.AtbMemError) as error:
        print(f"atb-mem: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

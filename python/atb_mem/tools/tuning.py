"""``atb-mem tune``: Optuna's search over the serving settings, with a trace replay as the
objective."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click
from rich.progress import Progress
from rich.table import Table

from atb_mem._core import EVICTION_POLICIES
from atb_mem.tools.options import (
    DTYPES,
    SIZE,
    CommaList,
    console,
    require_matplotlib,
    write_json,
)


@click.command()
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
@click.option("--apply-to", "apply_to", default=None, metavar="URL",
              help="A running atb-mem serve: apply the best max_num_batched_tokens, then "
                   "max_num_seqs, as guarded live steps (block_size and "
                   "gpu_memory_utilization size a cache at start: reported, not applied).")
@click.option("--watch", "watch", default="300s", show_default=True,
              help="With --apply-to: how long the server watches each step.")
@click.option("--token", envvar="ATB_MEM_ADMIN_TOKEN", default=None,
              help="With --apply-to: the server's --admin-token.")
@click.option("--policies", type=CommaList(str, "eviction policies"),
              default=",".join(EVICTION_POLICIES), show_default=True,
              help="Eviction policies to replay the best configuration's cache with "
                   "(prompts with shared prefixes shaped by the trace; see bench prefix).")
def tune(trace: str | None, limit: int, total_memory: int, model_memory: int,
         activation_bytes_per_token: int, layers: int, kv_heads: int, head_dim: int,
         dtype: str, latency_p99: float, speedup: float, trials: int, seed: int,
         json_path: str | None, plot_path: str | None, apply_to: str | None, watch: str,
         token: str | None, policies: list[str]) -> None:
    """Searches block_size, max_num_seqs, max_num_batched_tokens and gpu_memory_utilization
    (Optuna's TPE) for the most throughput with p99 latency under the bound, replaying the
    trace as the objective. Throughput is output tokens per second of step time (serving
    capacity), so an arrival-bound trace still tells configurations apart. Then replays
    prompts with shared prefixes through the best configuration's cache under every
    eviction policy (and hash_block_size=16 where it divides the block) and names the one
    that saves the most prefill."""
    from atb_mem.tools import simulate
    from atb_mem.tools.ctl import AdminClient, seconds

    watch_s = seconds(watch)
    server = AdminClient(apply_to, token) if apply_to else None
    if server is not None:
        server.call()  # unreachable or refusing: say so before the search, not after it
    try:
        import optuna
    except ImportError as error:
        raise click.ClickException("tune needs optuna: pip install 'atb-mem[tune]'") from error
    from atb_mem.tools.prefix_replay import EVICTION_POLICIES

    unknown = [policy for policy in policies if policy not in EVICTION_POLICIES]
    if unknown:  # before the search, not after it
        raise click.BadParameter(f"unknown eviction policies {unknown}: one of "
                                 f"{', '.join(EVICTION_POLICIES)}", param_hint="--policies")
    if plot_path:
        require_matplotlib()
    if model_memory >= total_memory:
        raise click.BadParameter("the model does not fit in the total memory",
                                 param_hint="--model-memory")
    requests = (simulate.load_trace(trace, limit) if trace
                else simulate.synthetic_workload(limit))
    requests = [simulate.Request(r.arrival / speedup, r.prompt, r.output) for r in requests]
    objective = _objective(requests, simulate.bytes_per_token(layers, kv_heads, head_dim, dtype),
                           total_memory, model_memory, activation_bytes_per_token, latency_p99)

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
    _print_best(best, feasible, trials, latency_p99)
    cache_tokens = (int(total_memory * best["gpu_memory_utilization"]) - model_memory) \
        // simulate.bytes_per_token(layers, kv_heads, head_dim, dtype)
    policy_rows = _best_policy(requests, cache_tokens, best["block_size"], policies)
    result: dict[str, Any] = {"latency_p99_bound": latency_p99, "speedup": speedup,
                              "best": {**best, "eviction_policy": policy_rows[0][
                                  "eviction_policy"], "hash_block_size": policy_rows[0][
                                  "hash_block_size"]},
                              "trials": rows, "eviction_policies": policy_rows}
    try:
        if server is not None:
            result["applied"] = []  # filled step by step: a rollback keeps what ran
            _apply(server, best, watch_s, result["applied"])
    finally:
        write_json(json_path, result)
    if plot_path:
        _plot(rows, plot_path)


def _apply(server: Any, best: dict[str, Any], watch_s: float, applied: list[Any]) -> None:
    """Applies the best configuration's live settings to the server, step by step, each
    step's outcome appended to ``applied``. The batch budget first: a larger max_num_seqs is
    only worth its memory once the step can hold its tokens. Each step is watched; a
    rollback stops the sequence."""
    from atb_mem.tools.ctl import apply_steps

    steps = [{"max_num_batched_tokens": best["max_num_batched_tokens"]},
             {"max_num_seqs": best["max_num_seqs"]}]
    apply_steps(server, steps, live=True, watch_s=watch_s, persist=False, results=applied)
    console.print(f"not applied live (they size the cache at start): block_size="
                  f"{best['block_size']}, gpu_memory_utilization="
                  f"{best['gpu_memory_utilization']:.3f}")


def _objective(requests: list[Any], token_bytes: int, total_memory: int, model_memory: int,
               activation_bytes_per_token: int, latency_p99: float) -> Callable[[Any], float]:
    """A trial's score: the replay's serving capacity, or 0 (with why) where it does not fit
    or misses the latency bound."""
    from atb_mem.tools import simulate

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

    return objective


def _best_policy(requests: list[Any], cache_tokens: int, block_size: int,
                 policies: list[str]) -> list[dict[str, Any]]:
    """The policies replayed at the best configuration's cache, best first, as a table."""
    from atb_mem.tools.prefix_replay import best_policy, prefix_requests

    rows = best_policy(prefix_requests(requests), cache_tokens, block_size, policies)
    table = Table(title=f"eviction policy at {cache_tokens:,} cache tokens, block {block_size}")
    for column in ("policy", "hash block", "hit rate", "prefill saved", "evictions"):
        table.add_column(column, justify="left" if column == "policy" else "right")
    for row in rows:
        table.add_row(str(row["eviction_policy"]), str(row["hash_block_size"]),
                      f"{row['hit_rate']:.3f}", f"{row['prefill_tokens_saved']:,}",
                      f"{row['evictions']:,}")
    console.print(table)
    if len({row["prefill_tokens_saved"] for row in rows}) == 1:
        console.print("[yellow]every policy saved the same: the cache holds every prefix of "
                      "this trace; policies differ only when it must evict[/yellow]")
    return rows


def _print_best(best: dict[str, Any], feasible: list[dict[str, Any]], trials: int,
                latency_p99: float) -> None:
    """The best configuration as a table, and a warning when every one scored the same."""
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


def _plot(rows: list[dict[str, Any]], plot_path: str) -> None:
    """Each searched parameter against the score, one panel each."""
    plt = require_matplotlib()
    figure, axes = plt.subplots(1, 4, figsize=(16, 4))
    for axis, key in zip(axes, ("block_size", "max_num_seqs", "max_num_batched_tokens",
                                "gpu_memory_utilization"), strict=True):
        axis.scatter([row[key] for row in rows], [row["value"] for row in rows], s=12)
        axis.set(xlabel=key, ylabel="tok/s of step time (0 = infeasible)")
        if key in ("max_num_seqs", "max_num_batched_tokens"):
            axis.set_xscale("log")
    figure.tight_layout()
    figure.savefig(plot_path, dpi=120)

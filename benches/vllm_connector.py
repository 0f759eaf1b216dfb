"""``AtbMemConnector`` inside vLLM's CPU build, against vLLM alone (its prefix caching on in
every configuration), each configuration in a fresh vLLM process, round after round in one
run so that the machine's noise hits all of them (each round starts with the next
configuration, since the machine drifts over minutes), vLLM run as its CPU guide advises
(``--as-installed``: as it installs, its engine core a process of its own):

    .venv-vllm/bin/python benches/vllm_connector.py [--rounds 3] [--out vllm_connector.json]

Run it with the python of vLLM's virtualenv (vLLM is not a dependency of atb-mem; pytest
does not collect this file). vLLM's CPU worker keeps one core off its OMP threads, and one
more when a KV connector is configured: on a small machine that would give the connector's
runs more cores than vLLM alone's, so every run gets ``VLLM_CPU_NUM_OF_RESERVED_CPU`` =
``--reserved-cpus`` (0 at its best: every core runs the forward). Three measurements:

1. **Multi-turn replay** (the shape of ``benches/multi_turn_offload.py``): conversation ``c``
   takes its turns' lengths from the Azure LLM code trace 2023 (``--trace``), rows
   ``c × turns`` onward, each new message its ``ContextTokens`` ÷ ``--scale`` and each reply
   its ``GeneratedTokens`` (both clipped). Turn ``k``'s prompt is the conversation's
   prompts and replies so far plus its new message. Conversations take turns round-robin,
   ``--concurrent`` at once, through ``LLMEngine.add_request`` / ``step``; vLLM's KV cache
   (``num_gpu_blocks_override``) is a fraction of what the conversations hold, so a history
   is evicted before its next turn. Configurations: vLLM alone; with the connector's host
   tier (``--host``, room for every history); with a small host tier (``--disk-host``) over
   a disk tier in a temporary folder, so that the disk serves what the host evicted.
   Reported: prefill tokens computed (prompt tokens − ``num_cached_tokens``), time to first
   token p50 / p99 (vLLM's own ``RequestOutput.metrics.first_token_latency``: from the
   request's arrival in ``add_request`` to its first token, wall clock), output and total
   tokens per second over the replay, and the blocks each tier loaded; beside them, the
   prefill left if every full block of a conversation's last turn hit.
2. **Nothing hits** (the connector's cost): ``--distinct-batches`` batches of ``--distinct``
   prompts of random tokens, none repeated, each batch submitted at once, in a fresh vLLM
   per configuration (nothing run before but a warm-up); wall time, its steps
   (``LLMEngine.step`` calls that returned output), the time per step and the seconds spent
   in the connector's hooks, the median over the batches.
3. **Hit rate at vLLM's 128-token blocks**: the prompts of ``atb-mem bench prefix``
   (``atb_mem.tools.prefix_replay.prefix_requests`` over ``--trace``), one at a time, one
   output token each, on a smaller model: vLLM alone, with the connector at
   ``hash_block_size`` 16, and at 128 (whole blocks: the tier's capacity without the finer
   keys). The host tier holds as many tokens as vLLM's KV cache. Beside each, what
   ``replay_prefixes`` (the bookkeeping replay of ``atb-mem bench prefix``) predicts.

Greedy, EOS ignored; replies are compared token for token with vLLM alone's of the same
round. Each figure is the median over ``--rounds``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_connector_child import distinct_prompts

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "tests" / "data" / "azure_llm_code_2023.csv"
BLOCK_SIZE = 128  # vLLM's CPU build

# ---- workloads (plain Python: no vLLM) ------------------------------------------------------

def conversations(trace: Path, count: int, turns: int, scale: int, message: tuple[int, int],
                  reply: tuple[int, int], vocab: int, seed: int = 0
                  ) -> list[list[tuple[list[int], int]]]:
    """Per conversation, its turns' (new message's tokens, reply length)."""
    rng = random.Random(seed)
    with trace.open() as handle:
        rows = list(csv.DictReader(handle))
    talks = []
    for c in range(count):
        turn_rows = rows[(c * turns) % len(rows):][:turns]
        talks.append([([rng.randrange(3, vocab) for _ in range(
            min(message[1], max(message[0], int(row["ContextTokens"]) // scale)))],
            min(reply[1], max(reply[0], int(row["GeneratedTokens"]))))
            for row in turn_rows])
    return talks


def least_prefill(talks: list[list[tuple[list[int], int]]]) -> int:
    """The prompt tokens the replay computes if every full block a conversation's last turn
    computed is served (its prompt's last token never is): the floor for any cache of whole
    blocks. Replies are as long as asked (EOS ignored); a reply's last token has no KV."""
    least = 0
    for talk in talks:
        history = full = 0
        for message, reply in talk:
            prompt = history + len(message)
            least += prompt - BLOCK_SIZE * min(full, (prompt - 1) // BLOCK_SIZE)
            history = prompt + reply
            full = (history - 1) // BLOCK_SIZE
    return least


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


# ---- the driver --------------------------------------------------------------------------------

def save_llama(folder: Path, *, vocab: int, hidden: int, layers: int, heads: int,
               kv_heads: int, head_dim: int) -> Path:
    """A random-weight fp32 Llama, saved with ``save_pretrained``."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, max_position_embeddings=16_384, torch_dtype="float32")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def vllm_environment(reserved_cpus: int, as_installed: bool) -> dict[str, str]:
    """What every vLLM of a run gets beyond this process's environment. vLLM's CPU worker
    keeps ``reserved_cpus`` cores off its OMP threads: by default one, and one more with any
    KV connector, which on 2 cores would give the connector's runs twice vLLM alone's cores.
    Unless ``as_installed``, vLLM runs as its CPU guide advises (``engine_vs_vllm``'s
    ``vllm_at_its_best``: tcmalloc and torch's OpenMP runtime preloaded, a thread per core, the
    engine core in the worker's process below 4 cores), every core its forward's."""
    environment = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING",
                   "VLLM_CPU_NUM_OF_RESERVED_CPU": str(reserved_cpus),
                   "PYTHONPATH": os.pathsep.join([str(ROOT / "python"), str(ROOT / "benches")])}
    if not as_installed:
        from engine_vs_vllm import vllm_at_its_best  # beside this script

        environment.update(vllm_at_its_best(sys.executable), VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    return environment


def spawn(job: dict[str, Any], work: Path, label: str, settings: dict[str, str],
          core: int | None = None) -> dict[str, Any]:
    """Runs ``job`` in a fresh process (``vllm_connector_child.py``) with ``settings``
    (``vllm_environment``); its result. With ``core``, the process and its one OpenMP thread
    stay on that core."""
    job_file = work / f"{label}.json"
    job_file.write_text(json.dumps(job))
    log = work / f"{label}.log"
    environment = {**os.environ, **settings}
    if core is not None:
        environment.update(OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND=str(core),
                           VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    started = time.perf_counter()
    with log.open("w") as stderr:
        done = subprocess.run([sys.executable, str(Path(__file__).with_name(
                                  "vllm_connector_child.py")), str(job_file)],
                              stdout=subprocess.PIPE, stderr=stderr, text=True,
                              env=environment, cwd=work, timeout=job.get("timeout_s", 900),
                              preexec_fn=None if core is None else
                              lambda: os.sched_setaffinity(0, {core}))
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise SystemExit(f"{label}: vLLM failed (exit {done.returncode}); its log:\n{tail}")
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT "):])
    print(f"  {label}: {time.perf_counter() - started:.0f} s", flush=True)
    return result


def replay_figures(run: dict[str, Any]) -> dict[str, float]:
    rows = list(run["requests"].values())
    prompt = sum(row["prompt"] for row in rows)
    cached = sum(row["cached"] for row in rows)
    output = sum(len(row["tokens"]) for row in rows)
    ttft = [row["ttft"] for row in rows]
    counters = run["counters"]
    return {"prompt_tokens": prompt, "prefill_tokens": prompt - cached,
            "connector_tokens": counters.get("vllm:external_prefix_cache_hits", 0),
            "ttft_p50_ms": 1e3 * statistics.median(ttft),
            "ttft_p99_ms": 1e3 * percentile(ttft, 0.99),
            "own_ttft_p50_ms": 1e3 * statistics.median(row["own_ttft"] for row in rows),
            "steps_to_first_p50": statistics.median(row.get("steps_to_first", 0)
                                                    for row in rows),
            "output_tokens_per_s": output / run["seconds"],
            "total_tokens_per_s": (prompt + output) / run["seconds"],
            "seconds": run["seconds"], "cpu_seconds": sum(run["cpu_seconds"].values()),
            "hook_seconds": sum(run["hook_seconds"].values()),
            "preemptions": sum(row["preemptions"] for row in rows),
            "host_blocks_loaded": counters.get("vllm:atb_mem_loaded_blocks{HOST}", 0),
            "disk_blocks_loaded": counters.get("vllm:atb_mem_loaded_blocks{DISK}", 0),
            "disk_blocks_saved": counters.get("vllm:atb_mem_saved_blocks{DISK}", 0),
            "load_failures": counters.get("vllm:atb_mem_load_failures", 0)}


def batch_figures(runs: list[dict[str, Any]]) -> dict[str, float]:
    """The median over one vLLM's batches."""
    figures = []
    for run in runs:
        rows = list(run["requests"].values())
        output = sum(len(row["tokens"]) for row in rows)
        figures.append({"seconds": run["seconds"], "steps": run["steps"],
                        "cpu_seconds": sum(run["cpu_seconds"].values()),
                        "hook_seconds": sum(run["hook_seconds"].values()),
                        "ms_per_step": 1e3 * run["seconds"] / run["steps"],
                        "output_tokens_per_s": output / run["seconds"],
                        "cached_tokens": sum(row["cached"] for row in rows)})
    return median_of(figures)


def same_tokens(run: dict[str, Any], alone: dict[str, Any]) -> float:
    """The share of requests whose reply equals vLLM alone's."""
    ids = alone["requests"]
    same = sum(row["tokens"] == ids[key]["tokens"] for key, row in run["requests"].items()
               if key in ids)
    return same / max(1, len(ids))


def divergences(run: dict[str, Any], alone: dict[str, Any]) -> tuple[int, int, float]:
    """(replies that differ from vLLM alone's, how many of them are the first in their
    conversation, the widest margin of vLLM alone's greedy token over the next one at such a
    reply's first differing token). A conversation's later turns carry its earlier replies,
    so one differing reply makes every later one differ: only the first says anything."""
    ids, differing, first, widest = alone["requests"], 0, 0, 0.0
    diverged: set[str] = set()
    for key in sorted(run["requests"], key=lambda key: tuple(map(int, key.split("-")))):
        if key not in ids or run["requests"][key]["tokens"] == ids[key]["tokens"]:
            continue
        differing += 1
        talk = key.split("-")[0]
        if talk in diverged:
            continue
        diverged.add(talk)
        first += 1
        mine, theirs = run["requests"][key]["tokens"], ids[key]["tokens"]
        at = next(at for at, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b)
        margins = ids[key].get("margins") or []
        widest = max(widest, margins[at] if at < len(margins) else float("inf"))
    return differing, first, widest


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--concurrent", type=int, default=4)
    parser.add_argument("--scale", type=int, default=8)
    parser.add_argument("--message", type=int, nargs=2, default=(32, 256), metavar=("MIN", "MAX"))
    parser.add_argument("--reply", type=int, nargs=2, default=(8, 48), metavar=("MIN", "MAX"))
    parser.add_argument("--num-blocks", type=int, default=72,
                        help="vLLM's KV cache, in blocks of 128 tokens")
    parser.add_argument("--host", default="1GiB", help="the host tier of the 'host' run")
    parser.add_argument("--disk-host", default="96MiB",
                        help="the host tier of the 'host+disk' run")
    parser.add_argument("--model", default="llama", choices=["llama", "qwen3-0.6b"],
                        help="the replay's model: the fp32 Llama of --hidden/--layers/"
                             "--kv-heads/--vocab, or Qwen3-0.6B's published shapes in bf16 "
                             "(random weights, benches/engine_vs_vllm.py's)")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--distinct", type=int, default=24, help="prompts that never hit")
    parser.add_argument("--distinct-length", type=int, default=512)
    parser.add_argument("--distinct-tokens", type=int, default=16)
    parser.add_argument("--distinct-batches", type=int, default=3,
                        help="batches of distinct prompts per vLLM (their median counts)")
    parser.add_argument("--prefix-requests", type=int, default=200,
                        help="requests of 'atb-mem bench prefix' (0: skip)")
    parser.add_argument("--prefix-blocks", type=int, default=136,
                        help="vLLM's KV cache in the prefix runs, in blocks")
    parser.add_argument("--prefix-host-blocks", type=int, default=None,
                        help="the host tier in the prefix runs, in blocks (default: as vLLM's)")
    parser.add_argument("--reserved-cpus", type=int, default=1,
                        help="VLLM_CPU_NUM_OF_RESERVED_CPU, the same in every run "
                             "(--as-installed only: at its best, vLLM's forward takes every "
                             "core)")
    parser.add_argument("--as-installed", action="store_true",
                        help="vLLM as it installs (its engine core a process of its own), "
                             "not as its CPU guide advises")
    parser.add_argument("--skip-replay", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help="JSON of every run")
    args = parser.parse_args()
    args.settings = vllm_environment(args.reserved_cpus, args.as_installed)
    print("every vLLM runs with " + " ".join(f"{key}={value}" for key, value in
                                             sorted(args.settings.items())), flush=True)
    work = Path(tempfile.mkdtemp(prefix="atb-mem-vllm-bench-"))
    report: dict[str, Any] = {"arguments": {key: str(value) if isinstance(value, Path)
                                            else value for key, value in vars(args).items()}}
    try:
        if not args.skip_replay:
            report["replay"] = replay_rounds(args, work)
        if args.prefix_requests:
            report["prefix"] = prefix_hit_rates(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


def replay_rounds(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    if args.model == "qwen3-0.6b":
        from engine_vs_vllm import MODELS, save_model  # beside this script

        model, vocab, dtype = work / "qwen3", MODELS["qwen3-0.6b"]["vocab"], "bfloat16"
        save_model(model, "qwen3-0.6b")
        shapes = "Qwen3-0.6B's shapes in bf16 (28 layers, 16 heads, 8 KV, of 128)"
    else:
        heads, vocab, dtype = args.hidden // 64, args.vocab, "float32"
        model = save_llama(work / "llama", vocab=vocab, hidden=args.hidden,
                           layers=args.layers, heads=heads, kv_heads=args.kv_heads, head_dim=64)
        shapes = (f"fp32 Llama, hidden {args.hidden}, {args.layers} layers, {heads} heads "
                  f"({args.kv_heads} KV) of 64")
    talks = conversations(args.trace, args.conversations, args.turns, args.scale,
                          tuple(args.message), tuple(args.reply), vocab)
    longest = max(sum(len(message) + reply for message, reply in talk) for talk in talks)
    room = max(longest, args.distinct_length + args.distinct_tokens)
    base = {"model": str(model), "vocab": vocab, "dtype": dtype,
            "max_model_len": -(-room // BLOCK_SIZE) * BLOCK_SIZE + BLOCK_SIZE,
            "max_num_seqs": args.concurrent, "num_blocks": args.num_blocks,
            "distinct_tokens": args.distinct_tokens}
    held = sum(sum(len(message) + reply for message, reply in talk) for talk in talks)
    print(f"multi-turn replay: {args.conversations} conversations × {args.turns} turns, "
          f"{args.concurrent} at once, longest {longest} tokens, {held:,} tokens of history "
          f"in all; vLLM's KV cache {args.num_blocks} blocks "
          f"({args.num_blocks * BLOCK_SIZE:,} tokens); {shapes}; prefill if every "
          f"full block of a conversation's last turn hit: {least_prefill(talks):,} tokens",
          flush=True)
    names = ("vLLM alone", "host", "host+disk")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    apart: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        distinct = [distinct_prompts(args.distinct, args.distinct_length, vocab,
                                     1 + round_ * args.distinct_batches + batch)
                    for batch in range(args.distinct_batches)]
        print(f"round {round_ + 1} of {args.rounds}", flush=True)
        # Each round starts with the next configuration: the machine drifts over minutes.
        order = names[round_ % len(names):] + names[:round_ % len(names)]
        # The replay, then the prompts that never hit in fresh vLLMs of their own.
        phases = [("replay", {"talks": talks}, runs)]
        if args.distinct_batches:  # 0: the replay alone (the paired script measures the cost)
            phases.append(("distinct", {"distinct": distinct}, apart))
        for phase, jobs, into in phases:
            for name in order:
                disk = work / f"disk-{phase}-{round_}"
                extras = {"vLLM alone": None, "host": {"host": args.host, "hash_block_size": 16},
                          "host+disk": {"host": args.disk_host, "hash_block_size": 16,
                                        "disk": [str(disk), "8GiB"]}}
                job = {**base, **jobs, "extra": extras[name], "seed": round_}
                into[name].append(spawn(job, work, f"{phase}-{name.replace(' ', '_')}-{round_}",
                                        args.settings))
                shutil.rmtree(disk, ignore_errors=True)
    replay = {name: [replay_figures(run["replay"]) for run in runs[name]] for name in names}
    distinct_runs = {name: [batch_figures(run["distinct"]) for run in apart[name]]
                     for name in names if apart[name]}
    agreement = {name: [same_tokens(run["replay"], alone["replay"]) for run, alone in
                        zip(runs[name], runs["vLLM alone"], strict=True)] for name in names}
    medians = {name: median_of(replay[name]) for name in names}
    costs = {name: median_of(runs_) for name, runs_ in distinct_runs.items()}
    alone = medians["vLLM alone"]
    print(f"\nmulti-turn replay, medians of {args.rounds}:")
    print(f"{'':>11} {'prefill tok':>11} {'connector tok':>13} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'out tok/s':>9} {'all tok/s':>9} {'host/disk blocks':>16} "
          f"{'same replies':>12}")
    for name in names:
        row = medians[name]
        print(f"{name:>11} {row['prefill_tokens']:>11,.0f} {row['connector_tokens']:>13,.0f} "
              f"{row['ttft_p50_ms']:>7,.0f}ms {row['ttft_p99_ms']:>7,.0f}ms "
              f"{row['output_tokens_per_s']:>9.1f} {row['total_tokens_per_s']:>9.0f} "
              f"{row['host_blocks_loaded']:>8.0f}/{row['disk_blocks_loaded']:<7.0f} "
              f"{min(agreement[name]):>12.0%}")
    for name in names:
        row = medians[name]
        print(f"  {name}: a turn's first token came {row['steps_to_first_p50']:.1f} engine "
              f"steps after it arrived (median)")
    for name in names[1:]:
        for run, alone_run in zip(runs[name], runs["vLLM alone"], strict=True):
            differing, first, widest = divergences(run["replay"], alone_run["replay"])
            if differing:
                print(f"  {name}: {differing} replies differ from vLLM alone's, {first} of them "
                      f"the first in their conversation; at their first differing token vLLM "
                      f"alone's greedy token led the next by at most {widest:.2g} (log-prob)")
    for name in names[1:]:
        row = medians[name]
        print(f"  {name}: TTFT p50 {alone['ttft_p50_ms'] / row['ttft_p50_ms']:.2f}× better "
              f"(target ≥ 2), output tokens/s ×"
              f"{row['output_tokens_per_s'] / alone['output_tokens_per_s']:.2f} (target ≥ 1)")
    if not args.distinct_batches:
        for name in names:
            print(f"  {name:>11} rounds, TTFT p50 (ms): "
                  + " ".join(f"{run['ttft_p50_ms']:.0f}" for run in replay[name]))
        return {"least_prefill_tokens": least_prefill(talks), "replay": replay,
                "replay_medians": medians, "same_replies": agreement}
    print(f"\nnothing hits: {args.distinct} distinct prompts of {args.distinct_length} tokens, "
          f"{args.distinct_tokens} output tokens each, all at once; medians of {args.rounds} "
          f"vLLMs, each the median of {args.distinct_batches} batches:")
    for name in names:
        row = costs[name]
        ratio = row["seconds"] / costs["vLLM alone"]["seconds"]
        print(f"{name:>11}: {row['seconds']:.2f} s, {row['steps']:.0f} steps, "
              f"{row['ms_per_step']:.1f} ms/step, cached {row['cached_tokens']:.0f} tokens; "
              f"time ×{ratio:.3f} of vLLM alone (target ≤ 1.05); CPU {row['cpu_seconds']:.1f} s "
              f"(×{row['cpu_seconds'] / costs['vLLM alone']['cpu_seconds']:.3f}); in the "
              f"connector's hooks {row['hook_seconds']:.3f} s "
              f"({row['hook_seconds'] / row['seconds']:.1%} of the time)")
    for name in names:
        print(f"  {name:>11} rounds (s): "
              + " ".join(f"{run['seconds']:.2f}" for run in distinct_runs[name])
              + "; TTFT p50 (ms): "
              + " ".join(f"{run['ttft_p50_ms']:.0f}" for run in replay[name]))
    return {"least_prefill_tokens": least_prefill(talks), "replay": replay,
            "replay_medians": medians, "same_replies": agreement,
            "nothing_hits": distinct_runs, "nothing_hits_medians": costs}


def prefix_hit_rates(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from atb_mem.tools.prefix_replay import (
        VOCAB,
        PrefixRequest,
        prefix_requests,
        replay_prefixes,
    )

    requests = prefix_requests(str(args.trace), args.prefix_requests)
    prompts = [request.prompt for request in requests]
    longest = max(len(prompt) for prompt in prompts)
    layers, kv_heads, head_dim = 2, 1, 32
    model = save_llama(work / "small", vocab=VOCAB, hidden=64, layers=layers, heads=2,
                       kv_heads=kv_heads, head_dim=head_dim)
    block_bytes = 2 * BLOCK_SIZE * kv_heads * head_dim * 4 * layers
    base = {"model": str(model), "one_at_a_time": prompts, "vocab": VOCAB,
            "max_model_len": -(-longest // BLOCK_SIZE) * BLOCK_SIZE + BLOCK_SIZE,
            "max_num_seqs": 4, "num_blocks": args.prefix_blocks, "seed": 0}
    host_blocks = args.prefix_host_blocks or args.prefix_blocks
    host = host_blocks * block_bytes
    configurations: dict[str, Any] = {
        "vLLM alone": None, "connector 128/16": {"host": host, "hash_block_size": 16},
        "connector 128/128": {"host": host, "hash_block_size": BLOCK_SIZE}}
    tokens = args.prefix_blocks * BLOCK_SIZE
    print(f"\nprefix hit rate: {len(requests)} requests of 'atb-mem bench prefix' "
          f"({sum(map(len, prompts)):,} prompt tokens, longest {longest}), one at a time, "
          f"vLLM's KV cache {tokens:,} tokens, the host tier {host_blocks * BLOCK_SIZE:,}",
          flush=True)
    rows: dict[str, Any] = {}
    bare = [PrefixRequest(request.prompt, [], request.system) for request in requests]
    for name, extra in configurations.items():
        run = spawn({**base, "extra": extra}, work, name.replace(" ", "_").replace("/", "-"),
                    args.settings)
        prompt = sum(map(len, prompts))
        cached = sum(run["prefix"]["cached"])
        piece = None if extra is None else extra["hash_block_size"]
        predicted = replay_prefixes(bare, args.prefix_blocks, BLOCK_SIZE, "lru",
                                    piece if piece != BLOCK_SIZE else None)
        rows[name] = {"hit_rate": cached / prompt, "cached_tokens": cached,
                      "connector_tokens": run["prefix"]["counters"].get(
                          "vllm:external_prefix_cache_hits", 0),
                      "seconds": run["prefix"]["seconds"],
                      "replay_prefixes_hit_rate": predicted["hit_rate"]}
        print(f"{name:>17}: hit rate {cached / prompt:.3f} ({cached:,} tokens, "
              f"{rows[name]['connector_tokens']:,.0f} from the connector) in "
              f"{rows[name]['seconds']:.0f} s; replay_prefixes at "
              f"{'128' if piece in (None, BLOCK_SIZE) else '128/16'}, lru: "
              f"{predicted['hit_rate']:.3f}", flush=True)
    return rows


if __name__ == "__main__":
    main()

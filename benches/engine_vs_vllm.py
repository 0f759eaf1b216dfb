"""atb-mem's ``Engine`` against vLLM's CPU build at its best, on the same model and requests,
each system in a fresh process of its own, round after round alternating:

    python benches/engine_vs_vllm.py [--model toy|qwen3-0.6b] [--rounds 2] \
        [--vllm-python .venv-vllm/bin/python] [--systems vllm,vllm-mp,atb-mem]

Models (random weights, saved once with ``save_pretrained`` and loaded by both):
``toy``, an fp32 Llama (8 layers, hidden 256, 4 query and 2 KV heads of 64, vocab 2,048);
``qwen3-0.6b``, Qwen3-0.6B's published config in bfloat16 (28 layers, hidden 1,024, 16 query
and 8 KV heads of 128, vocab 151,936, tied embeddings). The requests are the first 256 (toy)
or 32 (qwen3-0.6b) of the Azure LLM code trace 2023 (tests/data), all queued at t=0, greedy,
EOS ignored: each prompt its ``ContextTokens`` ÷ 8 (4–512 tokens, random ids), each output its
``GeneratedTokens`` ÷ 2.

vLLM runs as its CPU documentation advises for this machine (``vllm``): tcmalloc and the
OpenMP runtime its torch links in ``LD_PRELOAD``, ``OMP_NUM_THREADS`` = the cores, and, on a
machine of fewer than 4 cores, its engine core in the worker's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), where a separate engine-core process would take a core
from the forward; its defaults otherwise (128-token blocks, torch.compile, its CPU attention,
``max_num_batched_tokens`` 4,096). ``vllm-mp`` is vLLM as it installs (multiprocess engine
core; its worker preloads the same libraries itself). atb-mem runs its own defaults (16-token
blocks, the CPU kernel, the compiled forward; ``atb-mem-eager`` without it). Both
``max_num_seqs=64`` and 2 GiB of KV cache. Each run warms up on two short requests first.
Reported per run: useful output tokens/s (each request's own output length), TTFT p50/p99 from
t=0, peak RSS of the process tree, start-up seconds (loading, compiling, warming up); the
configuration of every system is printed first.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "tests" / "data" / "azure_llm_code_2023.csv"


MODELS: dict[str, dict[str, Any]] = {
    "toy": {"requests": 256, "dtype": "float32", "vocab": 2048},
    "qwen3-0.6b": {"requests": 32, "dtype": "bfloat16", "vocab": 151_936},
}


def workload(count: int, vocab: int) -> list[tuple[list[int], int]]:
    import random

    rng = random.Random(0)
    with TRACE.open() as trace:
        rows = list(csv.DictReader(trace))[:count]
    return [([rng.randrange(3, vocab) for _ in range(min(512, max(4, int(row["ContextTokens"])
                                                                   // 8)))],
             max(1, int(row["GeneratedTokens"]) // 2)) for row in rows]


def build_model(name: str) -> Any:
    """The benchmark's model ``name`` with random weights (seeded), in its dtype, eval mode."""
    import torch
    import transformers

    torch.manual_seed(0)
    if name == "toy":
        config = transformers.LlamaConfig(
            vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
            torch_dtype="float32")
        return transformers.LlamaForCausalLM(config).eval()
    # Qwen3-0.6B's config.json as published (its weights are not downloaded: random ones).
    config = transformers.Qwen3Config(
        vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40_960, rms_norm_eps=1e-6, rope_theta=1_000_000,
        tie_word_embeddings=True, torch_dtype="bfloat16")
    return transformers.Qwen3ForCausalLM(config).to(torch.bfloat16).eval()


def save_model(folder: Path, name: str = "toy") -> None:
    build_model(name).save_pretrained(folder)


# ---- in the child ------------------------------------------------------------------------------

def tree_rss() -> int:
    """Resident bytes of this process and every process under it (Linux /proc)."""
    total, pending = 0, [os.getpid()]
    while pending:
        pid = pending.pop()
        try:
            with open(f"/proc/{pid}/status") as status:
                total += next(int(line.split()[1]) * 1024 for line in status
                              if line.startswith("VmRSS:"))
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as children:
                    pending += [int(child) for child in children.read().split()]
        except (OSError, StopIteration):
            continue
    return total


class PeakRss:
    def __init__(self) -> None:
        self.peak, self._done = 0, threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._done.wait(0.05):
            self.peak = max(self.peak, tree_rss())

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return self.peak


def drive(add: Any, step: Any, unfinished: Any, work: list[tuple[list[int], int]]
          ) -> dict[str, Any]:
    """Queues ``work`` at t=0 and steps to the end: seconds, TTFTs, output tokens."""
    first: dict[str, float] = {}
    tokens: dict[str, int] = {}
    start = time.perf_counter()
    for index, (prompt, max_tokens) in enumerate(work):
        add(str(index), prompt, max_tokens)
    while unfinished():
        for request_id, count in step():
            if count:
                first.setdefault(request_id, time.perf_counter() - start)
                tokens[request_id] = count
    return {"seconds": time.perf_counter() - start, "ttft": list(first.values()),
            "tokens": sum(tokens.values())}


def run_vllm(job: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    began = time.perf_counter()
    llm = LLM(model=job["model"], skip_tokenizer_init=True, dtype=job["dtype"], seed=0,
              max_num_seqs=job["max_num_seqs"], max_model_len=2048)
    engine = llm.llm_engine
    started = time.perf_counter() - began

    def add(request_id: str, prompt: list[int], max_tokens: int) -> None:
        engine.add_request(request_id, {"prompt_token_ids": prompt},
                           SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))

    def step() -> list[tuple[str, int]]:  # its outputs carry all their tokens so far
        return [(out.request_id, len(out.outputs[0].token_ids)) for out in engine.step()]

    drive(add, step, engine.has_unfinished_requests, [([5] * 40, 4), ([6] * 90, 4)])
    return {"startup": started, **drive(add, step, engine.has_unfinished_requests, job["work"])}


def run_atb_mem(job: dict[str, Any]) -> dict[str, Any]:
    import torch
    import transformers

    from atb_mem.serving import Engine, SamplingParams

    began = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        job["model"], dtype=getattr(torch, job["dtype"]))
    options = {"kv_cache_memory_bytes": 2 << 30, **job.get("options", {})}
    engine = Engine(model.eval(), max_num_seqs=job["max_num_seqs"], **options)
    started = time.perf_counter() - began

    def add(request_id: str, prompt: list[int], max_tokens: int) -> None:
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens,
                                                              temperature=0, ignore_eos=True))

    made: dict[str, int] = {}

    def step() -> Iterator[tuple[str, int]]:  # a step's outputs carry that step's tokens
        for out in engine.step():
            made[out.request_id] = made.get(out.request_id, 0) + len(out.outputs[0].token_ids)
            yield out.request_id, made[out.request_id]

    drive(add, step, engine.has_unfinished_requests, [([5] * 40, 4), ([6] * 90, 4)])
    made.clear()
    return {"startup": started, **drive(add, step, engine.has_unfinished_requests, job["work"])}


def child(job: dict[str, Any]) -> dict[str, Any]:
    peak = PeakRss()
    result = (run_vllm if job["system"].startswith("vllm") else run_atb_mem)(job)
    return {**result, "peak_rss": peak.stop(), "load_average": os.getloadavg()[0]}


# ---- the driver --------------------------------------------------------------------------------

SYSTEMS: dict[str, dict[str, Any]] = {
    "vllm": {"best": True},
    "vllm-mp": {},
    "atb-mem": {"options": {}},
    "atb-mem-eager": {"options": {"enforce_eager": True}},
}


def cpu() -> str:
    """The CPU's model name and the instruction sets both systems' bf16 and attention paths
    depend on (results differ by far between an AVX2 CPU and one with AMX tiles)."""
    info = Path("/proc/cpuinfo")
    fields: dict[str, str] = {}
    for line in (info.read_text() if info.exists() else "").splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name, flags = fields.get("model name", "an unknown CPU"), set(fields.get("flags", "").split())
    sets = [label for flag, label in (("avx2", "AVX2"), ("avx512f", "AVX-512"),
                                      ("avx512_bf16", "AVX512-BF16"), ("amx_tile", "AMX"))
            if flag in flags]
    return f"{name} ({', '.join(sets) or 'no AVX2'})"


def vllm_at_its_best(python: str) -> dict[str, str]:
    """The environment vLLM's CPU installation guide asks for: tcmalloc and the OpenMP runtime
    its torch links preloaded, one OpenMP thread per core, and on fewer than 4 cores the engine
    core in the worker's process."""
    found = subprocess.run([python, "-c", (
        "import importlib.util as u\n"
        "for name in ('torch', 'vllm'):\n"
        "    print(u.find_spec(name).submodule_search_locations[0])")],
        capture_output=True, text=True, check=True).stdout.split()
    torch_folder, vllm_folder = Path(found[0]), Path(found[1])
    gomp = sorted([*(torch_folder / "lib").glob("libgomp*.so*"),
                   *(torch_folder.parent / "torch.libs").glob("libgomp*.so*")])
    tcmalloc = sorted((vllm_folder / "libs").glob("libtcmalloc*.so*")) or \
        sorted(Path("/usr/lib/x86_64-linux-gnu").glob("libtcmalloc_minimal.so.4"))
    if not gomp or not tcmalloc:
        raise SystemExit(f"vLLM at its best needs torch's libgomp ({gomp}) and tcmalloc "
                         f"({tcmalloc}: apt-get install libtcmalloc-minimal4)")
    cores = len(os.sched_getaffinity(0))
    environment = {"LD_PRELOAD": f"{tcmalloc[0]}:{gomp[0]}", "OMP_NUM_THREADS": str(cores)}
    if cores < 4:
        environment["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return environment


def configuration(system: str, python: str) -> dict[str, str]:
    """The environment ``system`` runs under, beyond this one's."""
    if system.startswith("vllm"):
        best = vllm_at_its_best(python) if SYSTEMS[system].get("best") else {}
        return {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_LOGGING_LEVEL": "WARNING", **best}
    return {"PYTHONPATH": str(ROOT / "python")}


def spawn(system: str, job: dict[str, Any], folder: Path, python: str,
          settings: dict[str, str]) -> dict[str, Any]:
    job_file = folder / f"{system}.json"
    job_file.write_text(json.dumps({**job, **SYSTEMS[system], "system": system}))
    environment = {**os.environ, **settings}
    # A session of its own: vLLM's engine and worker processes outlive a killed child and
    # spin, slowing every later run; the whole group goes when the run ends, however.
    child = subprocess.Popen([python, __file__, "--child", str(job_file)], text=True,
                             env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True)
    try:
        stdout, stderr = child.communicate(timeout=1800)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if child.returncode or not lines:
        raise SystemExit(f"{system} failed (exit {child.returncode}):\n{stderr[-4000:]}")
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT "):])
    return result


def report(system: str, run: dict[str, Any]) -> str:
    ttft = sorted(run["ttft"])
    p99 = ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))]
    return (f"{system:14} {run['tokens'] / run['seconds']:7.1f} tok/s  TTFT p50 "
            f"{statistics.median(ttft):5.2f} s  p99 {p99:5.2f} s  peak RSS "
            f"{run['peak_rss'] / 2**30:4.2f} GiB  start-up {run['startup']:5.1f} s  "
            f"({run['tokens']} tokens in {run['seconds']:.1f} s, load {run['load_average']:.1f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default="toy", choices=sorted(MODELS))
    parser.add_argument("--requests", type=int, help="default: 256 (toy), 32 (qwen3-0.6b)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--systems", default="vllm,vllm-mp,atb-mem")
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = child(json.loads(Path(args.child).read_text()))
        print("RESULT " + json.dumps(result), flush=True)
        return
    model = MODELS[args.model]
    work = workload(args.requests or model["requests"], model["vocab"])
    print(f"{args.model} ({model['dtype']}): {len(work)} requests, "
          f"{sum(len(p) for p, _ in work)} prompt and {sum(m for _, m in work)} output tokens; "
          f"{len(os.sched_getaffinity(0))} cores of {cpu()}", flush=True)
    systems = args.systems.split(",")
    pythons = {system: args.vllm_python if system.startswith("vllm") else sys.executable
               for system in systems}
    settings = {system: configuration(system, pythons[system]) for system in systems}
    for system in systems:
        shown = " ".join(f"{key}={value}" for key, value in settings[system].items())
        print(f"  {system:14} {shown or '(this environment)'} {SYSTEMS[system]}", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        save_model(Path(folder) / "model", args.model)
        job = {"model": str(Path(folder) / "model"), "work": work, "dtype": model["dtype"],
               "max_num_seqs": args.max_num_seqs}
        runs: dict[str, list[dict[str, Any]]] = {}
        for _ in range(args.rounds):
            for system in systems:
                run = spawn(system, job, Path(folder), pythons[system], settings[system])
                runs.setdefault(system, []).append(run)
                print(report(system, run), flush=True)
    print("medians:")
    for system, done in runs.items():
        rate = statistics.median(r["tokens"] / r["seconds"] for r in done)
        ttft = statistics.median(statistics.median(r["ttft"]) for r in done)
        rss = statistics.median(r["peak_rss"] for r in done) / 2**30
        startup = statistics.median(r["startup"] for r in done)
        print(f"  {system:14} {rate:7.1f} tok/s  TTFT p50 {ttft:5.2f} s  peak RSS {rss:4.2f} GiB"
              f"  start-up {startup:5.1f} s")


if __name__ == "__main__":
    main()

"""atb-mem's ``Engine`` against vLLM's CPU build on the same model and requests, each system in
a fresh process of its own, round after round alternating:

    python benches/engine_vs_vllm.py [--rounds 2] [--vllm-python .venv-vllm/bin/python]
    python benches/engine_vs_vllm.py --systems atb-mem,atb-mem-eager   # compiled or not

The model is a random-weight fp32 Llama (8 layers, hidden 256, 4 query and 2 KV heads of 64,
saved once with ``save_pretrained`` and loaded by both). The requests are the first 256 of the
Azure LLM code trace 2023 (tests/data), all queued at t=0, greedy, EOS ignored: each prompt its
``ContextTokens`` ÷ 8 (4–512 tokens, random ids), each output its ``GeneratedTokens`` ÷ 2 —
56,038 prompt and 2,892 output tokens. Both systems run ``max_num_seqs=64``; vLLM with its CPU
defaults (128-token blocks, torch.compile, its own paged attention), atb-mem with its own
(16-token blocks, the CPU kernel; ``atb-mem-eager`` without the compiled forward). Each run
warms up on two short requests first. Reported per run: useful output tokens/s (each request's
own output length), TTFT p50/p99 from t=0, peak RSS of the process tree, start-up seconds.
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


def workload(count: int, vocab: int) -> list[tuple[list[int], int]]:
    import random

    rng = random.Random(0)
    with TRACE.open() as trace:
        rows = list(csv.DictReader(trace))[:count]
    return [([rng.randrange(3, vocab) for _ in range(min(512, max(4, int(row["ContextTokens"])
                                                                   // 8)))],
             max(1, int(row["GeneratedTokens"]) // 2)) for row in rows]


def save_model(folder: Path) -> None:
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        torch_dtype="float32")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)


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
    llm = LLM(model=job["model"], skip_tokenizer_init=True, dtype="float32", seed=0,
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
    model = transformers.LlamaForCausalLM.from_pretrained(job["model"], dtype=torch.float32)
    engine = Engine(model.eval(), max_num_seqs=job["max_num_seqs"], num_blocks=4096,
                    **job.get("options", {}))
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

# vLLM's CPU worker keeps a core for its scheduler process by default: on 2 cores its forward
# has one thread. "vllm-all-cores" gives the worker every core (the scheduler shares them).
SYSTEMS: dict[str, dict[str, Any]] = {
    "vllm": {},
    "vllm-all-cores": {"environment": {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}},
    "atb-mem": {"options": {}},
    "atb-mem-eager": {"options": {"enforce_eager": True}},
}


def spawn(system: str, job: dict[str, Any], folder: Path, python: str) -> dict[str, Any]:
    job_file = folder / f"{system}.json"
    job_file.write_text(json.dumps({**job, **SYSTEMS[system], "system": system}))
    environment = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_LOGGING_LEVEL": "WARNING",
                   "PYTHONPATH": str(ROOT / "python"), **SYSTEMS[system].get("environment", {})}
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
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--systems", default="vllm,atb-mem")
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = child(json.loads(Path(args.child).read_text()))
        print("RESULT " + json.dumps(result), flush=True)
        return
    work = workload(args.requests, 2048)
    print(f"{len(work)} requests, {sum(len(p) for p, _ in work)} prompt and "
          f"{sum(m for _, m in work)} output tokens; {os.cpu_count()} CPUs", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        save_model(Path(folder) / "model")
        job = {"model": str(Path(folder) / "model"), "work": work,
               "max_num_seqs": args.max_num_seqs}
        runs: dict[str, list[dict[str, Any]]] = {}
        for _ in range(args.rounds):
            for system in args.systems.split(","):
                python = args.vllm_python if system.startswith("vllm") else sys.executable
                run = spawn(system, job, Path(folder), python)
                runs.setdefault(system, []).append(run)
                print(report(system, run), flush=True)
    print("medians:")
    for system, done in runs.items():
        rate = statistics.median(r["tokens"] / r["seconds"] for r in done)
        ttft = statistics.median(statistics.median(r["ttft"]) for r in done)
        print(f"  {system:14} {rate:7.1f} tok/s  TTFT p50 {ttft:5.2f} s")


if __name__ == "__main__":
    main()

"""Quantized KV blocks under memory pressure: the Engine with ``kv_cache_dtype`` ``auto``,
``int8`` and ``fp8_e4m3`` on the same requests and a KV budget that makes the unquantized
cache preempt, each in a fresh process, round after round alternating:

    python benches/quantized_kv_capacity.py [--model qwen3-0.6b] [--kv-budget-mib 256] \
        [--requests 64] [--rounds 2] [--output-scale 2]

The requests are ``engine_vs_vllm.py``'s (the first of the Azure code trace, all queued at
t=0, greedy, EOS ignored), each output ``--output-scale`` times as long (2: the trace's own
``GeneratedTokens``; outputs that grow are what makes a running batch preempt);
``max_num_seqs=64``, 16-token blocks, the compiled forward.
Reported per run: useful output tokens/s, preemptions, the most sequences running in one
step, the cache's blocks, and blocks per GiB of each dtype.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine_vs_vllm import MODELS, build_model, workload  # beside this script

ROOT = Path(__file__).resolve().parents[1]
DTYPES = ("auto", "int8", "fp8_e4m3")


def run(job: dict[str, Any]) -> dict[str, Any]:
    """One Engine over the job's requests (in this process)."""
    import torch
    import transformers

    from atb_mem.serving import Engine, SamplingParams

    model = transformers.AutoModelForCausalLM.from_pretrained(
        job["model"], dtype=getattr(torch, MODELS[job["name"]]["dtype"])).eval()
    engine = Engine(model, max_num_seqs=64, kv_cache_memory_bytes=job["budget"],
                    kv_cache_dtype=job["kv_cache_dtype"])
    greedy = {"temperature": 0, "ignore_eos": True}
    for index, (prompt, _) in enumerate(job["warm_up"]):
        engine.add_request(f"w{index}", prompt, SamplingParams(max_tokens=4, **greedy))
    while engine.has_unfinished_requests():
        engine.step()
    before = engine.scheduler.stats()["preemptions"]
    tokens, peak = 0, 0
    start = time.perf_counter()
    for index, (prompt, max_tokens) in enumerate(job["work"]):
        engine.add_request(str(index), prompt,
                           SamplingParams(max_tokens=max_tokens, **greedy))
    while engine.has_unfinished_requests():
        tokens += sum(len(out.outputs[0].token_ids) for out in engine.step())
        peak = max(peak, engine.scheduler.stats()["running"])
    seconds = time.perf_counter() - start
    return {"tokens": tokens, "seconds": seconds, "peak_running": peak,
            "preemptions": engine.scheduler.stats()["preemptions"] - before,
            "num_blocks": engine.kv_cache.num_blocks,
            "bytes_per_block": engine.kv_cache.bytes_per_block}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b", choices=sorted(MODELS))
    parser.add_argument("--kv-budget-mib", type=int, default=256)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--output-scale", type=int, default=1)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(run(json.loads(Path(args.child).read_text()))))
        return
    vocab = MODELS[args.model]["vocab"]
    results: dict[str, list[dict[str, Any]]] = {dtype: [] for dtype in DTYPES}
    with tempfile.TemporaryDirectory() as folder:
        model_dir = Path(folder) / "model"
        build_model(args.model).save_pretrained(model_dir)
        job = {"model": str(model_dir), "name": args.model, "budget": args.kv_budget_mib << 20,
               "work": [(prompt, tokens * args.output_scale)
                        for prompt, tokens in workload(args.requests, vocab)],
               "warm_up": [([5] * 40, 4), ([6] * 90, 4)]}
        print(f"{args.model}, {args.requests} requests (outputs x{args.output_scale}), KV "
              f"budget {args.kv_budget_mib} MiB, max_num_seqs 64, block size 16, compiled forward")
        for round_ in range(args.rounds):
            for dtype in DTYPES:
                job_file = Path(folder) / f"{dtype}.json"
                job_file.write_text(json.dumps({**job, "kv_cache_dtype": dtype}))
                child = subprocess.run([sys.executable, __file__, "--child", str(job_file)],
                                       capture_output=True, text=True, timeout=3600,
                                       env={"PYTHONPATH": str(ROOT / "python"),
                                            **os.environ})
                lines = [line for line in child.stdout.splitlines()
                         if line.startswith("RESULT ")]
                if child.returncode or not lines:
                    raise SystemExit(f"{dtype} failed:\n{child.stderr[-3000:]}")
                result = json.loads(lines[-1][len("RESULT "):])
                results[dtype].append(result)
                print(f"round {round_ + 1} {dtype:9} {result['tokens'] / result['seconds']:6.1f} "
                      f"tok/s  preemptions {result['preemptions']:4}  peak running "
                      f"{result['peak_running']:3}  blocks {result['num_blocks']:5}  "
                      f"({result['tokens']} tokens in {result['seconds']:.1f} s)", flush=True)
    print("medians:")
    for dtype, runs in results.items():
        per_gib = (1 << 30) // runs[0]["bytes_per_block"]
        print(f"  {dtype:9} {statistics.median(r['tokens'] / r['seconds'] for r in runs):6.1f} "
              f"tok/s  preemptions {statistics.median(r['preemptions'] for r in runs):6.1f}  "
              f"peak running {statistics.median(r['peak_running'] for r in runs):5.1f}  "
              f"blocks per GiB {per_gib}")


if __name__ == "__main__":
    main()

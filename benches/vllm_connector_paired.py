"""What ``AtbMemConnector`` costs vLLM where nothing hits, measured paired: vLLM alone and vLLM
with the connector run at the same time, each pinned to a core of its own (its process and
its one OpenMP thread), on the same prompts that never hit, and start measuring together
(each waits for the other's warm-up). The cores swap from pair to pair, so a faster core
favours neither; the machine's drift hits both runs of a pair alike.

    .venv-vllm/bin/python benches/vllm_connector_paired.py [--pairs 4] [--config host]

Run it with the python of vLLM's virtualenv. Each run: ``--batches`` batches of
``--distinct`` prompts of ``--length`` random tokens, ``--tokens`` output tokens each, all
submitted at once (``benches/vllm_connector.py``'s "nothing hits", on one core); the cost is
the connector's wall time over vLLM alone's, per pair (each the median of its batches).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import threading
from pathlib import Path
from typing import Any

from vllm_connector import (  # beside this script
    BLOCK_SIZE,
    batch_figures,
    save_llama,
    spawn,
    vllm_environment,
)
from vllm_connector_child import distinct_prompts

# "lookups only": no tier holds anything (what the connector's presence alone costs).
CONFIGS = {"host": {"host": "1GiB", "hash_block_size": 16},
           "host+disk": {"host": "96MiB", "hash_block_size": 16},
           "lookups only": {"host": 0, "hash_block_size": 16}}


def pair(base: dict[str, Any], extra: dict[str, Any], work: Path, index: int
         ) -> tuple[float, float]:
    """One pair's (alone, connector) seconds, the connector's run on core ``index % 2``."""
    ready = [work / f"ready-{index}-{side}" for side in (0, 1)]
    go = work / f"go-{index}"
    jobs = [{**base, "extra": None, "ready": str(ready[0]), "go": str(go)},
            {**base, "extra": extra, "ready": str(ready[1]), "go": str(go)}]
    if "disk" in extra:
        jobs[1]["extra"] = {**extra, "disk": [str(work / f"disk-{index}"), "8GiB"]}
    cores = (1, 0) if index % 2 == 0 else (0, 1)
    results: list[dict[str, Any]] = [{}, {}]

    def run(side: int) -> None:
        results[side] = spawn(jobs[side], work, f"pair-{index}-{side}",
                              vllm_environment(0, as_installed=True), core=cores[side])

    threads = [threading.Thread(target=run, args=(side,)) for side in (0, 1)]
    for thread in threads:
        thread.start()
    for _ in range(18_000):  # both warmed up, then go (bounded: 15 minutes)
        if all(path.exists() for path in ready) or not any(t.is_alive() for t in threads):
            break
        threading.Event().wait(0.05)
    go.touch()
    for thread in threads:
        thread.join()
    alone, connector = (batch_figures(result["distinct"]) for result in results)
    print(f"  pair {index + 1}: alone {alone['seconds']:.2f} s ({alone['steps']:.0f} steps), "
          f"connector {connector['seconds']:.2f} s ({connector['steps']:.0f} steps, "
          f"{connector['hook_seconds']:.3f} s in its hooks): "
          f"{connector['seconds'] / alone['seconds'] - 1:+.1%}", flush=True)
    return alone["seconds"], connector["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--config", default="host", choices=sorted(CONFIGS))
    parser.add_argument("--distinct", type=int, default=8)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=4096)
    args = parser.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("a paired run needs two cores")
    work = Path(tempfile.mkdtemp(prefix="atb-mem-vllm-paired-"))
    try:
        model = save_llama(work / "llama", vocab=args.vocab, hidden=768, layers=6, heads=12,
                           kv_heads=4, head_dim=64)
        base = {"model": str(model), "vocab": args.vocab, "seed": 0, "num_blocks": 72,
                "max_model_len": -(-(args.length + args.tokens) // BLOCK_SIZE) * BLOCK_SIZE
                + BLOCK_SIZE, "max_num_seqs": args.distinct, "distinct_tokens": args.tokens,
                "distinct": [distinct_prompts(args.distinct, args.length, args.vocab, batch + 1)
                             for batch in range(args.batches)]}
        disk = " and a disk" * (args.config == "host+disk")
        print(f"paired, nothing hits: {args.pairs} pairs of vLLM alone and with the connector "
              f"({args.config}: {CONFIGS[args.config]}{disk})"
              f", one core each; {args.batches} batches of {args.distinct} prompts of "
              f"{args.length} tokens, {args.tokens} output tokens each", flush=True)
        extra = {**CONFIGS[args.config], **({"disk": []} if args.config == "host+disk" else {})}
        costs = []
        for index in range(args.pairs):
            alone, connector = pair(base, extra, work, index)
            costs.append(connector / alone - 1)
        print(f"connector's cost, median of {args.pairs} pairs: "
              f"{statistics.median(costs):+.1%} (target ≤ +2%)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

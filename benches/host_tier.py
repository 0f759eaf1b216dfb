"""What the host prefix tier costs and moves (issue 25's targets), each pair measured
alternately in one process so the machine's noise hits both:

    python benches/host_tier.py [--rounds 7] [--running 256] [--blocks 256]

- the scheduler's decode step with a host prefix tier and nothing to load, against none
  (target: within 5%);
- the tier path's copy bandwidth (``KVTensors.execute`` of device→host then host→device
  block moves on the host backing) as a ratio of one plain ``memcpy`` of the same bytes
  (``numpy.copyto`` of contiguous buffers; target ≥ 0.8).

Prints each round, the medians and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

import atb_mem
from atb_mem.kv.tensors import MOVE_TO_DEVICE, MOVE_TO_HOST
from atb_mem.tools import workloads


def timed(run: Callable[[], object], count: int = 1) -> float:
    start = time.perf_counter()
    for _ in range(count):
        run()
    return (time.perf_counter() - start) / count


def alternate(name: str, unit: str, runs: dict[str, Callable[[], float]], rounds: int
              ) -> dict[str, float]:
    for run in runs.values():  # warm-up
        run()
    times: dict[str, list[float]] = {label: [] for label in runs}
    for _ in range(rounds):
        for label, run in runs.items():
            times[label].append(run())
    medians = {label: statistics.median(values) for label, values in times.items()}
    print(f"{name} ({unit}, medians of {rounds}): "
          + ", ".join(f"{label} {value:.2f}" for label, value in medians.items()))
    for label, values in times.items():
        print(f"  {label:<10} " + " ".join(f"{value:.2f}" for value in values))
    return medians


def step_runs(running: int, steps: int) -> dict[str, Callable[[], float]]:
    runs = {}
    for label, host_prefix in (("no tier", False), ("host tier", True)):
        step, _ = workloads.scheduler_step_workload(running, host_prefix=host_prefix)
        runs[label] = lambda step=step: timed(step, steps) * 1e6
    return runs


def bandwidth_runs(blocks: int) -> tuple[dict[str, Callable[[], float]], int]:
    """Blocks of 16 tokens × 8 KV heads × 128 × float16 × 4 layers (512 KiB, the size vLLM's
    offloading found worth merging transfers to), `blocks` of them each way."""
    kv = atb_mem.KVCachePool(blocks + 1, 16, num_layers=4, num_kv_heads=8, head_dim=128,
                             dtype="float16", num_host_blocks=blocks)
    tensors = kv.tensors
    assert tensors is not None
    tensors.kv[...] = 1.0
    ids = np.arange(1, blocks + 1, dtype=np.int32)
    out = np.stack([np.full(blocks, MOVE_TO_HOST, np.int32), ids, ids], axis=1)
    back = np.stack([np.full(blocks, MOVE_TO_DEVICE, np.int32), ids, ids], axis=1)
    nbytes = 2 * blocks * kv.bytes_per_block
    source = np.ones(nbytes, np.uint8)
    target = np.empty_like(source)

    def tier_path() -> float:
        return nbytes / timed(lambda: (tensors.execute(out), tensors.execute(back))) / 2**30

    def memcpy() -> float:
        return nbytes / timed(lambda: np.copyto(target, source)) / 2**30

    return {"memcpy": memcpy, "tier path": tier_path}, nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--blocks", type=int, default=256)
    args = parser.parse_args()
    step = alternate(f"decode step, {args.running} running", "us per step",
                     step_runs(args.running, args.steps), args.rounds)
    print(f"  host tier / no tier: {step['host tier'] / step['no tier']:.3f}")
    runs, nbytes = bandwidth_runs(args.blocks)
    bandwidth = alternate(f"copy bandwidth, {nbytes / 2**20:.0f} MiB", "GiB/s", runs,
                          args.rounds)
    print(f"  tier path / memcpy: {bandwidth['tier path'] / bandwidth['memcpy']:.3f}")


if __name__ == "__main__":
    main()

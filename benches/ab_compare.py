"""Two builds of atb-mem side by side on W1-W3 and the scheduler step, in the same run.

Each build is a folder holding an installed ``atb_mem`` (``pip install --no-deps --target DIR
WHEEL``). Every workload runs in a fresh interpreter per build, alternating A, B, A, B, ...
``--repeats`` times, so drift on a shared machine hits both alike; the table gives each side's
median over the repeats (each repeat itself a median over ``--rounds``) and B / A.

    python benches/ab_compare.py --a /tmp/pkg-old --b /tmp/pkg-new --repeats 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

# name, unit, scale, the workload call (run in the child with ``workloads`` imported).
WORKLOADS = [
    ("W1 alloc+free pair", "ns", 1e9, "workloads.churn_workload(200_000)"),
    ("W2 decode step (256 seqs)", "us", 1e6, "workloads.decode_workload(500)"),
    ("W3 prefix request", "us", 1e6,
     "workloads.prefix_workload(workloads.prefix_prompts(2_000))"),
    ("step + on_tokens, 256 running", "us", 1e6, "workloads.scheduler_step_workload(256)"),
    ("step + on_tokens, 4096 running", "us", 1e6, "workloads.scheduler_step_workload(4096)"),
    ("step after a fork, 256 running", "us", 1e6,
     "workloads.scheduler_step_workload(256, after_fork=True)"),
    ("step after a fork, 4096 running", "us", 1e6,
     "workloads.scheduler_step_workload(4096, after_fork=True)"),
    ("step, hash_block_size 4 + 1 waiting, 256 running", "us", 1e6,
     "workloads.scheduler_step_workload(256, hash_block_size=4)"),
    ("step, hash_block_size 4 + 1 waiting, 4096 running", "us", 1e6,
     "workloads.scheduler_step_workload(4096, hash_block_size=4)"),
]
# Operations per timed round of the step workloads (one step each) vs the others (one call).
STEP_ROUNDS = {"256": 300, "4096": 60}

CHILD = """
import sys
from atb_mem.tools import workloads
workload = {call}
print(workloads.median_per_operation(workload, {rounds}, warmup=True))
"""


def measure(build: str, call: str, rounds: int) -> float:
    env = {**os.environ, "PYTHONPATH": build}
    child = CHILD.format(call=call, rounds=rounds)
    done = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True,
                          text=True, check=True, timeout=600)
    return float(done.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--a", required=True, help="folder with build A's atb_mem")
    parser.add_argument("--b", required=True, help="folder with build B's atb_mem")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="", help="run the workloads whose name has this")
    args = parser.parse_args()
    print(f"| workload | A ({args.a}) | B ({args.b}) | B / A |")
    print("|---|---|---|---|")
    for name, unit, scale, call in WORKLOADS:
        if args.only not in name:
            continue
        running = next((n for n in STEP_ROUNDS if f"scheduler_step_workload({n}" in call),
                       None)
        rounds = STEP_ROUNDS[running] if running else args.rounds
        sides: dict[str, list[float]] = {"a": [], "b": []}
        for _ in range(args.repeats):
            for side in ("a", "b"):
                sides[side].append(measure(getattr(args, side), call, rounds))
        a, b = (statistics.median(sides[side]) * scale for side in ("a", "b"))
        print(f"| {name} | {a:.2f} {unit} | {b:.2f} {unit} | {b / a:.3f} |", flush=True)


if __name__ == "__main__":
    main()

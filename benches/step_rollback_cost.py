"""What a scheduler step costs once it could move blocks, against a plain one, in one process.

A step that might move blocks must be able to roll back if executing the moves fails. The
workloads of ``atb_mem.tools.workloads.scheduler_step_workload`` at each size: a plain
decode step, its prompts given as counts and as token ids; the same after one request of
two samples ran and finished (a fork happened); and with ``hash_block_size=4`` (token ids)
and one request waiting for a seat. Each round times every workload in turn (their order
rotating), so drift hits all alike; the table gives the median of the rounds' medians and
each against the plain step. The pools hold no bytes, so the scheduler's ``step`` runs no
executor (see ``cargo bench -p atb-mem-core --bench step`` for ``step_executing``).

    python benches/step_rollback_cost.py --rounds 7
"""

from __future__ import annotations

import argparse
import statistics

from atb_mem.tools import workloads

CASES = {
    "plain": {},
    "plain, token ids": {"token_ids": True},
    "after a fork": {"after_fork": True},
    "hash_block_size 4 + 1 waiting": {"hash_block_size": 4},
}
STEPS = {256: 300, 4096: 40}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--running", type=int, nargs="+", default=[256, 4096])
    args = parser.parse_args()
    print("| running | workload | step + on_tokens | / plain |")
    print("|---|---|---|---|")
    for running in args.running:
        steps = STEPS.get(running, 100)
        runs = {name: workloads.scheduler_step_workload(running, **kwargs)
                for name, kwargs in CASES.items()}
        times: dict[str, list[float]] = {name: [] for name in CASES}
        names = list(CASES)
        for round_ in range(args.rounds):
            for name in names[round_ % len(names):] + names[:round_ % len(names)]:
                times[name].append(workloads.median_per_operation(runs[name], steps,
                                                                  warmup=True))
        plain = statistics.median(times["plain"])
        for name in names:
            median = statistics.median(times[name])
            print(f"| {running} | {name} | {median * 1e6:.1f} us | {median / plain:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()

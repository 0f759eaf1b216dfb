"""What KV-cache events cost on W2 and W3 (issue 13's targets: ≤ 5% on W2, ≤ 10% on W3), with
events off and on measured alternately in one process, so the machine's noise hits both:

    python benches/kv_event_overhead.py [--rounds 7] [--requests 10000] [--steps 2000]

W3 drains after every request and W2 after every step, as an engine drains each step. A
drain is what the engine's thread pays: the events are typed where they are read (a
publisher's thread), so ``--typed`` also reads every event there, to show that cost too.
Prints each round's times, the medians and the overhead of the medians.
"""

from __future__ import annotations

import argparse
import statistics
import time

from atb_mem.tools import workloads


def timed(run: object) -> float:
    start = time.perf_counter()
    run()  # type: ignore[operator]
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--steps", type=int, default=2_000)
    parser.add_argument("--typed", action="store_true",
                        help="also type every drained event on the engine's thread")
    args = parser.parse_args()
    prompts = workloads.prefix_prompts(args.requests)
    cases = {
        "W3 us per request": (args.requests, {
            events: workloads.prefix_workload(prompts, kv_events=events, typed=args.typed)[0]
            for events in (False, True)}),
        "W2 us per decode step": (args.steps, {
            events: workloads.decode_workload(args.steps, kv_events=events)[0]
            for events in (False, True)}),
    }
    for name, (count, runs) in cases.items():
        runs[False]()  # warm-up
        runs[True]()
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for events in (False, True):
                times[events].append(timed(runs[events]) / count * 1e6)
        off, on = (statistics.median(times[events]) for events in (False, True))
        print(f"{name}: events off {off:.2f}, on {on:.2f} (medians of {args.rounds}); "
              f"overhead {100 * (on / off - 1):+.1f}%")
        print("  off " + " ".join(f"{t:.2f}" for t in times[False]))
        print("  on  " + " ".join(f"{t:.2f}" for t in times[True]))


if __name__ == "__main__":
    main()

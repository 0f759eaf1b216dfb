"""Prefix hits under cache pressure on a hybrid model: a trace with shared prefixes (lengths
from the Azure code trace) replayed through the scheduler with KV-cache groups and with a
cache that keeps every block, on the same bytes, from roomy to tight.

    python benches/hybrid_hit_rate.py [--requests 400]

The model: 6 layers, 5 sliding (window 128) to 1 full, 8 KV heads × 128, bf16; see
``tests/support/hybrid_replay.py`` for the workload. Occupancy is the mean share of blocks
held by running sequences; the hit rate counts prompt tokens served from the cache.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.hybrid_replay import prompts, replay


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    args = parser.parse_args()
    requests = prompts(args.requests)
    print(f"{'MiB':>5} {'groups: occupancy':>18} {'hit rate':>9} {'every block: occupancy':>23}"
          f" {'hit rate':>9}")
    for mib in (64, 96, 128, 192, 256, 384, 512):
        grouped, plain = (replay(requests, mib << 20, grouped) for grouped in (True, False))
        print(f"{mib:>5} {grouped.occupancy:>18.2f} {grouped.hit_rate:>9.3f} "
              f"{plain.occupancy:>23.2f} {plain.hit_rate:>9.3f}")


if __name__ == "__main__":
    main()

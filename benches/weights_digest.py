"""How fast the engine names a model's weights (``weights_digest``, the key of the tiers
shared across engines), measured alternately in one process against one plain read of the
same bytes (``numpy.sum`` of them as uint64 words, which touches every byte once) and
Python's single-threaded ``hashlib.sha256``:

    python benches/weights_digest.py [--gib 2] [--rounds 5]

Prints each round and the medians in GB/s; at N GB/s a 70B checkpoint in bf16 (140 GB)
takes 140 / N seconds at start-up.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from collections.abc import Callable

import numpy as np

from atb_mem import _core


def gigabytes_per_second(run: Callable[[], object], nbytes: int) -> float:
    start = time.perf_counter()
    run()
    return nbytes / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    # Forty tensors, as a checkpoint's layers come, each a whole number of uint64 words.
    per_tensor = int(args.gib * (1 << 30)) // 40 // 8 * 8
    rng = np.random.default_rng(0)
    tensors = [rng.integers(0, 256, size=per_tensor, dtype=np.uint8) for _ in range(40)]
    total = sum(tensor.nbytes for tensor in tensors)
    runs: dict[str, Callable[[], object]] = {
        "content_digests, every core": lambda: _core.content_digests(tensors, 0),
        "content_digests, one thread": lambda: _core.content_digests(tensors, 1),
        "read once (numpy sum)": lambda: [tensor.view(np.uint64).sum() for tensor in tensors],
        "hashlib.sha256": lambda: [hashlib.sha256(tensor).digest() for tensor in tensors],
    }
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(args.rounds):
        for name, run in runs.items():
            rates[name].append(gigabytes_per_second(run, total))
        print(f"round {round_}: " + ", ".join(f"{name} {rates[name][-1]:.2f}" for name in runs))
    print(f"\nmedians over {args.rounds} rounds of {total / 1e9:.2f} GB (GB/s):")
    for name, values in rates.items():
        print(f"  {name:<28} {statistics.median(values):6.2f}")


if __name__ == "__main__":
    main()

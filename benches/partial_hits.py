"""What hits finer than a block cost per request: W3 (a shared system prompt plus a unique
suffix, allocated with its token ids, marked computed, freed) on blocks of 128 tokens, plain
and with ``hash_block_size=16``, alternating in one process so the machine's noise hits both:

    python benches/partial_hits.py [--rounds 7] [--requests 5000]

W3's own 1,024-token system prompt ends on a block boundary: every hit is whole blocks, and
what is measured is the sub-block keys' upkeep (hashing each cached block's pieces, keeping
token ids). With a 1,000-token system prompt each request also gets a partial hit (104
tokens copied), so the lookup and the copy's planning are in it too. Prints each round's
times, the medians, their ratio and the tokens each setting served from the cache.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import atb_mem

BLOCK_SIZE, PIECE = 128, 16
NUM_BLOCKS = 4096


def prompts(system_tokens: int, requests: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    system = rng.integers(0, 32_000, system_tokens, dtype=np.int32)
    out = []
    for i in range(requests):
        suffix = rng.integers(0, 32_000, int(rng.integers(64, 513)), dtype=np.int32)
        suffix[0] = 100_000 + i  # unique: the only hits are the system prompt's
        out.append(np.concatenate([system, suffix]))
    return out


def run(batch: list[np.ndarray], hash_block_size: int | None) -> tuple[float, int]:
    kv = atb_mem.KVCachePool(NUM_BLOCKS, BLOCK_SIZE, device=None,
                             hash_block_size=hash_block_size)
    start = time.perf_counter()
    for seq_id, tokens in enumerate(batch):
        kv.alloc_sequence(seq_id, tokens)
        kv.mark_computed(seq_id)
        kv.free_sequence(seq_id)
        kv.take_pending_copies()  # what an engine hands its executor
    elapsed = time.perf_counter() - start
    return elapsed / len(batch) * 1e6, kv.stats()["prefix_cache_hit_tokens"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--requests", type=int, default=5_000)
    args = parser.parse_args()
    for system in (1024, 1000):
        batch = prompts(system, args.requests)
        times: dict[int | None, list[float]] = {None: [], PIECE: []}
        hits: dict[int | None, int] = {}
        for setting in times:  # warm-up
            run(batch, setting)
        for _ in range(args.rounds):
            for setting in times:
                elapsed, hits[setting] = run(batch, setting)
                times[setting].append(elapsed)
        plain, fine = (statistics.median(times[setting]) for setting in (None, PIECE))
        print(f"W3, {system}-token system prompt, block {BLOCK_SIZE}: plain {plain:.2f} us, "
              f"hash_block_size={PIECE} {fine:.2f} us per request (medians of {args.rounds}); "
              f"ratio {fine / plain:.3f}; hit tokens {hits[None]:,} vs {hits[PIECE]:,}")
        print("  plain " + " ".join(f"{t:.2f}" for t in times[None]))
        print(f"  {PIECE:>5} " + " ".join(f"{t:.2f}" for t in times[PIECE]))


if __name__ == "__main__":
    main()

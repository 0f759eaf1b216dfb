"""How fast ``AtbMemConnector``'s worker copies blocks between vLLM's CPU cache and its host
tier, on Qwen3-0.6B's shapes (28 layers, each cache ``[2, blocks, 8, 128, 128]`` in bf16: a
128-token block is 14 MiB across layers), for a step that saves or loads 1 to 8 blocks:

    python benches/vllm_worker_copies.py [--rounds 9]

The worker alone (no vLLM): ``TierWorker.save`` (vLLM → host, after the forward) and
``TierWorker.start_loads`` with host loads (host → vLLM, before it). Medians of ``--rounds``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from atb_mem.integrations.vllm.moves import TierMoves
from atb_mem.integrations.vllm.worker import TierWorker

LAYERS, BLOCKS, HOST_BLOCKS = 28, 72, 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    caches = {f"layer.{at}": torch.zeros(2, BLOCKS, 8, 128, 128, dtype=torch.bfloat16)
              for at in range(LAYERS)}
    worker = TierWorker(num_host_blocks=HOST_BLOCKS, stores=[], layout="bench",
                        identity="bench-tp0")
    block_bytes = worker.register(caches, BLOCKS)
    print(f"{LAYERS} layers, {block_bytes / 2**20:.0f} MiB a block, torch threads "
          f"{torch.get_num_threads()}")
    for count in (1, 2, 4, 8):
        # Spread over the caches and the host, as a replay's blocks are.
        pairs = [(3 + 7 * at, 1 + 5 * at) for at in range(count)]
        moves = {"save": TierMoves(saves=[(block, row) for block, row in pairs]),
                 "load": TierMoves(host_loads=[(row, block) for block, row in pairs])}
        for name, move in moves.items():
            call = worker.save if name == "save" else worker.start_loads
            seconds = []
            for _ in range(args.rounds):
                start = time.perf_counter()
                call(move)
                seconds.append(time.perf_counter() - start)
            median = statistics.median(seconds)
            print(f"{count} block(s) {name:>4}: {median * 1e3:7.2f} ms, "
                  f"{count * block_bytes / median / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()

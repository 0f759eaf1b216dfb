"""What broadcasting a step's plan costs under tensor parallelism, on CPU ranks over gloo.

    python benches/tensor_parallel_broadcast.py --ranks 2 4 --running 256 --steps 300

Rank 0 sends the plan of a decode step of ``--running`` sequences (one token each, contexts of
``--context`` tokens in blocks of 16, a few block moves) ``--steps`` times through
``PlanBroadcast``; the others receive it. Prints the median microseconds per step of rank 0's
send (the step's wait for every rank to have its plan) for each rank count.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from types import SimpleNamespace

import numpy as np
import torch.distributed as dist
import torch.multiprocessing as mp

from atb_mem.distributed.tensor_parallel import PlanBroadcast, TensorParallelGroup


def decode_plan(running: int, context: int, block_size: int = 16) -> SimpleNamespace:
    width = -(-context // block_size)
    rng = np.random.default_rng(0)
    return SimpleNamespace(
        query_lens=np.ones(running, np.int32), seq_lens=np.full(running, context, np.int32),
        query_start_loc=np.arange(running + 1, dtype=np.int32),
        input_ids=rng.integers(0, 32_000, running).astype(np.int32),
        positions=np.full(running, context - 1, np.int32),
        slot_mapping=rng.integers(0, 1 << 20, running).astype(np.int32),
        logits_indices=np.arange(running, dtype=np.int32),
        block_tables=rng.integers(1, 1 << 16, (running, width)).astype(np.int32),
        moves=np.zeros((4, 3), np.int32))


def rank_main(rank: int, size: int, port: int, args: argparse.Namespace, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(size))
    group = TensorParallelGroup.join(size, backend="gloo")
    broadcast = PlanBroadcast(group)
    if rank == 0:
        plan = decode_plan(args.running, args.context)
        times = []
        for _ in range(args.steps):
            began = time.perf_counter()
            broadcast.send(plan)
            times.append(time.perf_counter() - began)
        broadcast.stop()
        out[size] = statistics.median(times[10:]) * 1e6
    else:
        while broadcast.receive() is not None:
            pass
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    results = mp.Manager().dict()
    for size in args.ranks:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        mp.spawn(rank_main, args=(size, port, args, results), nprocs=size)
        print(f"{size} ranks: {results[size]:.0f} us per step to broadcast a "
              f"{args.running}-sequence decode plan")


if __name__ == "__main__":
    main()

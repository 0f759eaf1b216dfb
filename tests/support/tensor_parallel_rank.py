"""One rank of a tensor-parallel engine, as torchrun would start it (RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT in the environment):

    python -m tests.support.tensor_parallel_rank CHECKPOINT OUT.json [--die-after N]
                                                  [--num-blocks N]

Rank 0 generates ``PROMPTS`` greedily and writes their token ids (or the error that ended
it) to OUT.json; the other ranks serve its steps. With ``--die-after N`` rank 1 exits
abruptly after N steps.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

# A mixed batch: shared prefixes (hits once the first is cached), lengths past the cache's
# room (preemption by swapping: block moves every rank must execute), one long prompt
# prefilled in chunks.
PROMPTS = [[5 + i, 9, 17, 33, 2, 8, 41, 12] + [20 + i] * 3 for i in range(4)] + \
    [[5, 9, 17, 33, 2, 8, 41, 12, 7, 7, 7, 70], list(range(3, 60))]
ENGINE: dict[str, Any] = {"device": "cpu", "num_blocks": 24, "block_size": 4,
                          "max_num_seqs": 4, "max_num_batched_tokens": 32,
                          "preemption": "swap", "num_host_blocks": 32}
MAX_TOKENS = 24
FORK_PROMPT = [7, *range(60, 110)]  # new to the cache, its last block partly filled
FORKED: Any = None  # n=3 greedy samples of one prompt: forks (SamplingParams, made in main)


def main(argv: list[str]) -> None:
    import torch

    from atb_mem.distributed.tensor_parallel import PlanBroadcast, TensorParallelError
    from atb_mem.serving import Engine, SamplingParams
    from tests.support.models import poison_unused_blocks

    global FORKED
    FORKED = SamplingParams(max_tokens=6, n=3, temperature=0, ignore_eos=True)

    torch.set_num_threads(1)
    checkpoint, out = argv[0], argv[1]
    options = dict(zip(argv[2::2], (int(value) for value in argv[3::2]), strict=True))
    die_after = options.get("--die-after")
    engine = Engine.from_pretrained(checkpoint, tensor_parallel_size=2,
                                    verify_tensor_parallel=True,
                                    **{**ENGINE, "num_blocks": options.get("--num-blocks",
                                                                           ENGINE["num_blocks"])})
    if not engine.is_driver:
        if die_after is not None:
            receive, count = PlanBroadcast.receive, [0]

            def receive_then_die(self: PlanBroadcast) -> Any:
                count[0] += 1
                if count[0] > die_after:
                    os._exit(3)  # no goodbye: the process is gone
                return receive(self)

            PlanBroadcast.receive = receive_then_die  # type: ignore[method-assign]
        engine.run_worker()
        return
    step = engine.step

    def poisoned_step() -> Any:  # unused blocks NaN on every rank: a stale read shows
        assert engine.plan_broadcast is not None
        engine.plan_broadcast.poison_next = engine.kv_cache.unused_blocks()
        poison_unused_blocks(engine.kv_cache)
        return step()

    engine.step = poisoned_step  # type: ignore[method-assign]
    began = time.monotonic()
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    try:
        outputs = engine.generate(PROMPTS, greedy)
        forked = engine.generate(FORK_PROMPT, FORKED)  # copy-on-write of the shared block
    except TensorParallelError as error:
        result: dict[str, Any] = {"error": str(error), "seconds": time.monotonic() - began}
    else:
        engine.shutdown()
        result = {"tokens": [output.outputs[0].token_ids for output in outputs],
                  "forked": [one.token_ids for one in forked[0].outputs],
                  "preemptions": engine.scheduler.stats()["preemptions"],
                  "hits": engine.kv_cache.stats()["prefix_cache_hits"]}
    with open(out, "w") as file:
        json.dump(result, file)


if __name__ == "__main__":
    main(sys.argv[1:])

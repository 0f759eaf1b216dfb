"""Prefix hits for a hybrid model with recurrent layers: what state checkpoints save, and
what a state group costs a decode step.

    python benches/recurrent_checkpoints.py [--requests 400] [--rounds 5]

The model: Granite-4.0-H-Tiny-shaped (40 layers, an attention layer every tenth, 4 KV heads
of 128; Mamba2 mixers of 48 heads × 64 with a 128-wide state; bf16). The replay: the shared
prefixes of ``tests/support/hybrid_replay.py`` (trace lengths, one of 4 system prompts per
request) through the scheduler, once with state checkpoints (prefix caching on) and once
without (today's behaviour for such a model: every prompt recomputed). It prints the prompt
tokens the model computed and those the cache saved, and the memory the checkpoints held
(their blocks, at the peak, and what one checkpoint takes).

Then the decode step: ``ContinuousBatchScheduler.step`` and ``on_tokens`` at the same batch
of decoding sequences, with the state groups and attention-only (the same layers all
attention), each with prefix caching (checkpoints at the default interval, and at every
block) and without, alternating in one process; medians of ``--rounds``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import atb_mem
from atb_mem.kv.state_layout import recurrent_state_layout
from tests.support.hybrid_replay import prompts

LAYERS = 40
LAYER_TYPES = ["full_attention" if layer % 10 == 9 else "linear_attention"
               for layer in range(LAYERS)]
MAMBA = {"model_type": "granitemoehybrid", "hidden_size": 1536, "mamba_expand": 2,
         "mamba_n_heads": 48, "mamba_d_head": 64, "mamba_n_groups": 1, "mamba_d_state": 128,
         "mamba_d_conv": 4}
SHAPE = {"num_layers": LAYERS, "num_kv_heads": 4, "head_dim": 128, "dtype": "bfloat16",
         "layer_types": LAYER_TYPES,
         "state_bytes": recurrent_state_layout(MAMBA, "bfloat16").state_bytes}
BLOCK_SIZE = 64


def replay(requests: list[tuple[list[int], int]], num_blocks: int, checkpoints: bool,
           interval: int | None = None) -> dict[str, float]:
    extra = {"state_checkpoint_interval": interval} if interval else {}
    kv = atb_mem.KVCachePool(num_blocks, BLOCK_SIZE, device=None,  # type: ignore[arg-type]
                             enable_prefix_caching=checkpoints, **SHAPE, **extra)
    scheduler = atb_mem.ContinuousBatchScheduler(kv, max_num_seqs=32,
                                                 max_num_batched_tokens=4096)
    computed, peak_cached, pending = 0, 0, list(enumerate(requests))[::-1]
    while pending or scheduler.stats()["waiting"] or scheduler.stats()["running"]:
        if pending:
            seq_id, (prompt, output) = pending.pop()
            scheduler.add_request(seq_id, prompt, min(output, 64))
        plan = scheduler.step()
        computed += int(plan.prefill_tokens.sum())
        scheduler.on_tokens(plan.sample_seq_ids, np.ones(len(plan.sample_seq_ids), np.int32))
        peak_cached = max(peak_cached, kv.stats()["blocks_cached"])
    stats = kv.stats()
    return {"prefill_computed": computed, "hit_tokens": stats["prefix_cache_hit_tokens"],
            "checkpoints": stats["state_checkpoints_saved"], "peak_cached_blocks": peak_cached,
            "bytes_per_block": kv.bytes_per_block, "state_blocks": kv.num_state_blocks}


def decode_step_us(states: bool, checkpoints: bool, batch: int, steps: int,
                   interval: int | None = None) -> float:
    shape = SHAPE if states else \
        {k: v for k, v in SHAPE.items() if k not in ("layer_types", "state_bytes")}
    # Room for every sequence's states and K/V, whichever the model: the same batch runs.
    state_blocks = atb_mem.KVCachePool(10_000, 16, device=None,  # type: ignore[arg-type]
                                       **SHAPE).num_state_blocks
    extra = {"state_checkpoint_interval": interval} if interval else {}
    kv = atb_mem.KVCachePool(batch * (state_blocks + 40) + 64, 16,  # type: ignore[arg-type]
                             device=None, enable_prefix_caching=checkpoints, **shape, **extra)
    scheduler = atb_mem.ContinuousBatchScheduler(kv, max_num_seqs=batch,
                                                 max_num_batched_tokens=8192)
    for seq_id in range(batch):
        scheduler.add_request(seq_id, list(range(seq_id, seq_id + 100)), 10_000)
    # Prefill, keep each prompt's checkpoint (once per request), and reach the steady decode.
    for _ in range(50):
        plan = scheduler.step()
        scheduler.on_tokens(plan.sample_seq_ids, np.ones(len(plan.sample_seq_ids), np.int32))
        if len(plan.decode_seq_ids) == batch and not len(plan.moves):
            break
    assert scheduler.stats()["running"] == batch, scheduler.stats()
    start = time.perf_counter()
    for _ in range(steps):
        plan = scheduler.step()
        scheduler.on_tokens(plan.sample_seq_ids, np.ones(len(plan.sample_seq_ids), np.int32))
    return (time.perf_counter() - start) / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--num-blocks", type=int, default=3000)
    args = parser.parse_args()
    requests = prompts(args.requests)
    with_, every_block, without = (replay(requests, args.num_blocks, on, interval)
                                   for on, interval in ((True, None), (True, 1), (False, None)))
    mib = with_["bytes_per_block"] / 2**20
    print(f"{args.requests} requests, {args.num_blocks} blocks of {BLOCK_SIZE} tokens "
          f"({mib:.2f} MiB each); a checkpoint is {with_['state_blocks']} blocks "
          f"({with_['state_blocks'] * mib:.1f} MiB)")
    for name, row in (("checkpoints", with_), ("every block", every_block), ("none", without)):
        print(f"{name:>12}: prefill computed {row['prefill_computed']:>9,}, saved "
              f"{row['hit_tokens']:>9,}, checkpoints kept {row['checkpoints']:>6,}, peak "
              f"cached {row['peak_cached_blocks']:>5,} blocks "
              f"({row['peak_cached_blocks'] * mib / 1024:.2f} GiB)")
    for name, row in (("checkpoints", with_), ("every block", every_block)):
        saved = 1 - row["prefill_computed"] / without["prefill_computed"]
        print(f"prefill tokens computed: {saved:.1%} fewer with {name}")
    for batch in (64, 256):
        variants = {"states, checkpoints": (True, True, None),
                    "states, a checkpoint every block": (True, True, 1),
                    "attention-only": (False, True, None),
                    "states, no prefix caching": (True, False, None),
                    "attention-only, no prefix caching": (False, False, None)}
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, (states, checkpoints, interval) in variants.items():
                times[name].append(decode_step_us(states, checkpoints, batch, 200, interval))
        base = statistics.median(times["attention-only"])
        print(f"decode step, {batch} running (µs, and against attention-only): " + ", ".join(
            f"{name} {statistics.median(t):.1f} ({statistics.median(t) / base:.2f})"
            for name, t in times.items()))


if __name__ == "__main__":
    main()

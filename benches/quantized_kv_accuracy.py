"""Quantized KV blocks against the model's own dtype, teacher-forced: every position of the
first trace prompts (the Azure code trace's lengths, as ``engine_vs_vllm.py`` makes them)
prefilled through atb-mem's model runner over a cache of each ``kv_cache_dtype``, its logits
kept at every position. Reported per dtype: the share of positions whose argmax agrees with
the unquantized cache's, and the mean and largest |Δ log-prob| of that argmax token; beside
them, the floor of that comparison: the unquantized cache again, attended by torch's
reference instead of the kernel (the same K/V, another order of rounding).

    python benches/quantized_kv_accuracy.py [--model qwen3-0.6b] [--positions 2000]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch
from engine_vs_vllm import MODELS, build_model, workload  # beside this script

from atb_mem import KVCachePool
from atb_mem.integrations.forward_plan import ForwardPlan
from atb_mem.integrations.transformers import ModelRunner
from atb_mem.serving.kv_sizing import kv_cache_shape

BLOCK_SIZE = 16


def logits_at_every_position(model: Any, prompts: list[list[int]], kv_cache_dtype: str,
                             attention_backend: str = "cpu") -> list[torch.Tensor]:
    """Each prompt's log-probabilities ``[len, vocab]`` (float32), prefilled alone."""
    longest = max(len(prompt) for prompt in prompts)
    pool = KVCachePool(longest // BLOCK_SIZE + 2, BLOCK_SIZE, device="cpu",
                       enable_prefix_caching=False,
                       **kv_cache_shape(model, 1, kv_cache_dtype))  # type: ignore[arg-type]
    runner = ModelRunner(model, pool, enforce_eager=True,
                         attention_backend=attention_backend)  # type: ignore[arg-type]
    out = []
    for prompt in prompts:
        length = len(prompt)
        pool.alloc_sequence(1, length)
        lengths = np.array([length], dtype=np.int32)
        plan = ForwardPlan(
            query_lens=lengths, seq_lens=lengths,
            query_start_loc=np.array([0, length], dtype=np.int32),
            input_ids=np.asarray(prompt, dtype=np.int32),
            positions=np.arange(length, dtype=np.int32),
            slot_mapping=np.asarray(pool.slot_mapping([1], [0], [length]), dtype=np.int32),
            logits_indices=np.arange(length, dtype=np.int32),
            block_tables=np.asarray(pool.block_tables([1]), dtype=np.int32)[None])
        out.append(torch.log_softmax(runner.execute(plan), dim=-1))  # type: ignore[arg-type]
        pool.free_sequence(1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b", choices=sorted(MODELS))
    parser.add_argument("--positions", type=int, default=2000)
    args = parser.parse_args()
    model = build_model(args.model)
    prompts: list[list[int]] = []
    for prompt, _ in workload(256, MODELS[args.model]["vocab"]):
        if sum(map(len, prompts)) >= args.positions:
            break
        prompts.append(prompt[:args.positions - sum(map(len, prompts))])
    print(f"{args.model} ({model.dtype}), {len(prompts)} trace prompts, "
          f"{sum(map(len, prompts))} positions, block size {BLOCK_SIZE}, eager")
    started = time.perf_counter()
    reference = logits_at_every_position(model, prompts, "auto")
    argmax = [logprobs.argmax(dim=-1) for logprobs in reference]
    print(f"auto: {time.perf_counter() - started:.1f} s")
    for kv_cache_dtype, backend in (("auto", "torch"), ("int8", "cpu"), ("fp8_e4m3", "cpu")):
        started = time.perf_counter()
        quantized = logits_at_every_position(model, prompts, kv_cache_dtype, backend)
        agree = sum(int((got.argmax(dim=-1) == want).sum()) for got, want in
                    zip(quantized, argmax, strict=True))
        deltas = torch.cat([(got.gather(1, want[:, None]) - ref.gather(1, want[:, None]))
                            .abs()[:, 0] for got, ref, want in
                            zip(quantized, reference, argmax, strict=True)])
        total = sum(map(len, prompts))
        print(f"{kv_cache_dtype} ({backend} attention): argmax agrees at {agree}/{total} positions "
              f"({agree / total:.1%}); |Δ log-prob| of the unquantized argmax: mean "
              f"{float(deltas.mean()):.4f}, max {float(deltas.max()):.4f} "
              f"({time.perf_counter() - started:.1f} s)")


if __name__ == "__main__":
    main()

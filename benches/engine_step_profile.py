"""Where an Engine step's time goes, by operator (torch's profiler), on a model and the first
``--requests`` of the requests of ``benches/engine_vs_vllm.py``; atb-mem's CPU kernel appears
as ``atb_mem kernel``, the compiled forward's fused loops as ``cpp_fused_*`` (inside
``CompiledFunction``).

    python benches/engine_step_profile.py --requests 64 [--enforce-eager] [--model qwen3-0.6b]
    python benches/engine_step_profile.py --attention-backend torch --enforce-eager
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from engine_vs_vllm import MODELS, build_model, workload  # beside this script

from atb_mem.integrations import cpu_attention
from atb_mem.serving import Engine, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention-backend", default="cpu", choices=["cpu", "torch"])
    parser.add_argument("--model", default="toy", choices=sorted(MODELS))
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rows", type=int, default=14, help="operators shown")
    parser.add_argument("--enforce-eager", action="store_true", help="no compiled forward")
    args = parser.parse_args()
    engine = Engine(build_model(args.model), block_size=16, max_num_seqs=64,
                    kv_cache_memory_bytes=2 << 30, attention_backend=args.attention_backend,
                    enforce_eager=args.enforce_eager)
    work = workload(args.requests, MODELS[args.model]["vocab"])
    for index, (prompt, max_tokens) in enumerate(work):
        engine.add_request(str(index), prompt, SamplingParams(max_tokens=max_tokens,
                                                              temperature=0, ignore_eos=True))
    kernel = cpu_attention._core.paged_attention

    def labelled(*call_args: Any, **kwargs: Any) -> None:
        with torch.profiler.record_function("atb_mem kernel"):
            kernel(*call_args, **kwargs)

    cpu_attention._core.paged_attention = labelled  # type: ignore[assignment]
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            while engine.has_unfinished_requests():
                engine.step()
    finally:
        cpu_attention._core.paged_attention = kernel  # type: ignore[assignment]
    print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()

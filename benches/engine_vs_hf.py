"""atb-mem's ``Engine`` against transformers' own continuous batching (``generate_batch``) and
HF ``generate`` with static padded batches, on the same model and requests (one run each):

    python benches/engine_vs_hf.py [--requests 256] [--layers 8] [--hidden 256]
    python benches/engine_vs_hf.py --only engine --batch-size 64 \
        --attention-backends cpu,torch --rounds 2     # the engine's attention paths, alternating

Requests are the first ``--requests`` of the Azure LLM code trace 2023 (tests/data):
prompts divided by ``--scale`` to fit the model (4–448 tokens), outputs as traced (1–64).
Everything is offline (all requests at t=0), greedy, EOS ignored. Reported: output tokens/s
(useful tokens: each request's own output length), time to first token p50/p99, peak KV
bytes, and for the engine where the time went (model forward, scheduler + cache, the rest
of its Python).
transformers' ``generate_batch`` takes one ``max_new_tokens`` for all requests: it gets the
largest, and its throughput counts the tokens it made.
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AttentionInterface, GenerationConfig, LlamaConfig, LlamaForCausalLM

from atb_mem.integrations import transformers as paged
from atb_mem.integrations.transformers import ATTN_IMPLEMENTATION
from atb_mem.serving import Engine, SamplingParams

TRACE = Path(__file__).resolve().parents[1] / "tests" / "data" / "azure_llm_code_2023.csv"


def requests(count: int, scale: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(0)
    with TRACE.open() as trace:
        rows = list(csv.DictReader(trace))[:count]
    return [(rng.integers(3, vocab, size=min(448, max(4, int(row["ContextTokens"]) // scale)))
             .tolist(), min(64, max(1, int(row["GeneratedTokens"]))))
            for row in rows]


def percentiles(values: list[float]) -> str:
    p50, p99 = np.percentile(values, [50, 99])
    return f"TTFT p50 {p50 * 1e3:8.1f} ms  p99 {p99 * 1e3:8.1f} ms"


def run_engine(model: Any, work: list[tuple[list[int], int]], max_num_seqs: int,
               backend: str = "auto") -> None:
    engine = Engine(model, block_size=16, max_num_seqs=max_num_seqs, num_blocks=4096,
                    attention_backend=backend)  # type: ignore[arg-type]
    bytes_per_block = engine.kv_cache.bytes_per_block
    start = time.perf_counter()
    first: dict[str, float] = {}
    for index, (prompt, max_tokens) in enumerate(work):
        engine.add_request(str(index), prompt, SamplingParams(max_tokens=max_tokens,
                                                              temperature=0, ignore_eos=True))
    timers = {"model": 0.0, "scheduler": 0.0}
    execute, plan_step = engine.runner.execute, engine.scheduler.step

    def timed(name: str, call: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                timers[name] += time.perf_counter() - began
        return wrapper

    engine.runner.execute = timed("model", execute)  # type: ignore[method-assign]
    # The attention function is looked up per layer call: time it inside the forward.
    timers["attention"] = 0.0
    AttentionInterface.register(ATTN_IMPLEMENTATION,
                                timed("attention", paged.paged_attention_forward))
    engine.scheduler.step = timed("scheduler", plan_step)  # type: ignore[method-assign]
    peak_blocks, tokens = 0, 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        peak_blocks = max(peak_blocks, engine.kv_cache.stats()["blocks_used"])
        for output in outputs:
            tokens += sum(len(one.token_ids) for one in output.outputs)
            first.setdefault(output.request_id, now - start)
    elapsed = time.perf_counter() - start
    rest = elapsed - timers["model"] - timers["scheduler"]
    print(f"atb-mem Engine ({backend}) {tokens / elapsed:8.1f} tok/s  "
          f"{percentiles(list(first.values()))}  "
          f"peak KV {peak_blocks * bytes_per_block / 2**20:8.1f} MiB")
    print(f"    where the time went: model {timers['model'] / elapsed:.0%} (of which paged "
          f"attention {timers['attention'] / elapsed:.0%}), scheduler + cache "
          f"{timers['scheduler'] / elapsed:.0%}, sampling and the rest {rest / elapsed:.0%}")


def run_generate_batch(model: Any, work: list[tuple[list[int], int]]) -> None:
    config = GenerationConfig(max_new_tokens=max(m for _, m in work), do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    start = time.perf_counter()
    outputs = model.generate_batch([prompt for prompt, _ in work], generation_config=config,
                                   record_timestamps=True, warmup=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(output.generated_tokens) for output in outputs.values())
    first = [output.timestamps[0] - start for output in outputs.values() if output.timestamps]
    print(f"HF generate_batch  {tokens / elapsed:8.1f} tok/s  {percentiles(first)}"
          "  peak KV (its own paged cache; not reported)")


def run_static(model: Any, work: list[tuple[list[int], int]], batch_size: int) -> None:
    config, layers = model.config, model.config.num_hidden_layers
    head_dim = config.hidden_size // config.num_attention_heads
    start = time.perf_counter()
    first: list[float] = []
    useful, peak = 0, 0
    for begin in range(0, len(work), batch_size):
        batch = work[begin:begin + batch_size]
        width = max(len(prompt) for prompt, _ in batch)
        new = max(m for _, m in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (prompt, _) in enumerate(batch):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        stamps: list[float] = []

        def stamp(input_ids: Any, scores: Any, stamps: list[float] = stamps) -> Any:
            stamps.append(time.perf_counter() - start)
            return scores

        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0, logits_processor=[stamp])
        first += [stamps[0]] * len(batch)
        useful += sum(m for _, m in batch)
        # DynamicCache at the end of the batch: K and V of every layer, padded rows included.
        peak = max(peak, 2 * layers * len(batch) * (width + new) * config.num_key_value_heads
                   * head_dim * model.dtype.itemsize)
    elapsed = time.perf_counter() - start
    print(f"HF static batches  {useful / elapsed:8.1f} tok/s  {percentiles(first)}"
          f"  peak KV {peak / 2**20:8.1f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--scale", type=int, default=16)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--only", choices=["engine", "generate_batch", "static"], default=None)
    parser.add_argument("--attention-backends", default="auto",
                        help="the engine's attention backends, comma-separated (run in turn)")
    parser.add_argument("--rounds", type=int, default=1, help="engine runs per backend")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=2048, hidden_size=args.hidden,
                         intermediate_size=args.hidden * 3, num_hidden_layers=args.layers,
                         num_attention_heads=args.hidden // 64, num_key_value_heads=2,
                         max_position_embeddings=1024)
    work = requests(args.requests, args.scale, config.vocab_size)
    print(f"{len(work)} requests, prompts {sum(len(p) for p, _ in work)} tokens, outputs "
          f"{sum(m for _, m in work)} tokens; {args.layers} layers, hidden {args.hidden}; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.only in (None, "static"):
        run_static(LlamaForCausalLM(config).eval(), work, args.batch_size)
    if args.only in (None, "generate_batch"):
        torch.manual_seed(0)
        run_generate_batch(LlamaForCausalLM(config).eval(), work)
    if args.only in (None, "engine"):
        for _ in range(args.rounds):
            for backend in args.attention_backends.split(","):
                torch.manual_seed(0)
                run_engine(LlamaForCausalLM(config).eval(), work, args.batch_size, backend)


if __name__ == "__main__":
    main()

"""A multi-turn replay through the ``Engine``: conversations whose every turn re-sends its
history, with the host prefix tier, with the disk tier (written once a block is seen twice,
loaded while others run) and with neither, on the same device memory and the same requests,
alternating in one run:

    python benches/multi_turn_offload.py [--conversations 24] [--turns 4] [--num-blocks 96]

Conversation ``c``'s turns take their lengths from the Azure LLM code trace 2023
(tests/data): rows ``c × turns`` onward, each user message its ``ContextTokens`` ÷ ``--scale``
(4–96 tokens) and each reply its ``GeneratedTokens`` (1–32). Turn ``k``'s prompt is the
conversation's prompts and replies so far plus its new message. Conversations take turns
round-robin, ``--concurrent`` at once, so a history is usually evicted from the small device
before its next turn comes. Greedy, EOS ignored.

Reported per configuration: prefill tokens the model computed (and saved by prefix hits), time
to first token p50 / p99 (from a request's arrival in the engine to its first token), and
output tokens per second.
"""

from __future__ import annotations

import argparse
import csv
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from atb_mem.serving import Engine, SamplingParams

TRACE = Path(__file__).resolve().parents[1] / "tests" / "data" / "azure_llm_code_2023.csv"


def conversations(count: int, turns: int, scale: int, vocab: int
                  ) -> list[list[tuple[list[int], int]]]:
    """Per conversation, its turns' (new message, reply length)."""
    rng = np.random.default_rng(0)
    with TRACE.open() as trace:
        rows = list(csv.DictReader(trace))
    result = []
    for c in range(count):
        turn_rows = rows[(c * turns) % len(rows):][:turns]
        result.append([(rng.integers(3, vocab, size=min(96, max(4, int(row["ContextTokens"])
                                                              // scale))).tolist(),
                        min(32, max(1, int(row["GeneratedTokens"]))))
                       for row in turn_rows])
    return result


def model(layers: int, hidden: int) -> Any:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096)
    return LlamaForCausalLM(config).eval()


def replay(engine: Engine, talks: list[list[tuple[list[int], int]]], concurrent: int
           ) -> dict[str, float]:
    """Runs every conversation to its end; returns the figures."""
    history: dict[int, list[int]] = {c: [] for c in range(len(talks))}
    next_turn = dict.fromkeys(history, 0)
    active: list[int] = []
    waiting = list(history)
    arrived: dict[str, float] = {}
    ttft: list[float] = []
    prompt_tokens = output_tokens = 0
    hits_before = engine.kv_cache.stats()["prefix_cache_hit_tokens"]
    start = time.perf_counter()

    def submit(c: int) -> None:
        nonlocal prompt_tokens
        message, reply = talks[c][next_turn[c]]
        prompt = history[c] + message
        history[c] = prompt
        prompt_tokens += len(prompt)
        request_id = f"{c}-{next_turn[c]}"
        arrived[request_id] = time.perf_counter()
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=reply, temperature=0,
                                                             ignore_eos=True))

    while waiting or active or engine.has_unfinished_requests():
        while waiting and len(active) < concurrent:
            c = waiting.pop(0)
            active.append(c)
            submit(c)
        for output in engine.step():
            c = int(output.request_id.split("-")[0])
            if output.request_id in arrived:
                ttft.append(time.perf_counter() - arrived.pop(output.request_id))
            if not output.finished:
                continue
            tokens = output.outputs[0].token_ids
            output_tokens += len(tokens)
            history[c] = history[c] + list(tokens)
            next_turn[c] += 1
            active.remove(c)
            if next_turn[c] < len(talks[c]):
                waiting.append(c)  # its next turn goes to the back of the queue
    seconds = time.perf_counter() - start
    hit = engine.kv_cache.stats()["prefix_cache_hit_tokens"] - hits_before
    if engine.tiers is not None:  # tokens loaded from the disk are not computed either
        hit += engine.tiers.counters.loaded_blocks * engine.kv_cache.block_size
    ttft.sort()
    return {"prefill_tokens": prompt_tokens - hit, "saved_tokens": hit,
            "ttft_p50_ms": 1e3 * statistics.median(ttft),
            "ttft_p99_ms": 1e3 * ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "output_tokens_per_s": output_tokens / seconds, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrent", type=int, default=4)
    parser.add_argument("--scale", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=96)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--host", default="64MiB", help="the host tier's size")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(2)
    talks = conversations(args.conversations, args.turns, args.scale, 512)
    disk = tempfile.mkdtemp(prefix="atb-mem-disk-tier-")
    configurations: dict[str, Any] = {"device only": None, "host tier": {"host": args.host},
                                      "disk tier": {"disk": (disk, "4GiB")}}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in configurations}
    for _ in range(args.rounds):
        for name, offload in configurations.items():
            shutil.rmtree(disk, ignore_errors=True)  # each round starts with an empty disk
            engine = Engine(model(args.layers, args.hidden), num_blocks=args.num_blocks,
                            block_size=args.block_size, max_num_seqs=args.concurrent,
                            kv_offload=offload)
            results[name].append(replay(engine, talks, args.concurrent))
            engine.shutdown()
    shutil.rmtree(disk, ignore_errors=True)
    print(f"{args.conversations} conversations × {args.turns} turns, {args.concurrent} at once, "
          f"{args.num_blocks} device blocks of {args.block_size}; medians of {args.rounds}")
    for name, runs in results.items():
        figures = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        print(f"{name:>12}: prefill {figures['prefill_tokens']:.0f} tokens "
              f"(saved {figures['saved_tokens']:.0f}), TTFT p50 {figures['ttft_p50_ms']:.1f} ms "
              f"p99 {figures['ttft_p99_ms']:.1f} ms, {figures['output_tokens_per_s']:.1f} "
              f"output tokens/s")


if __name__ == "__main__":
    main()

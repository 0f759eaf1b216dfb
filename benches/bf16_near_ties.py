"""How often the Engine's greedy tokens leave HF's ``generate`` on a bfloat16 model, and that
each time it is at a near tie (HF's margin between the two tokens at most twice HF's own
sdpa-against-eager difference at that position; ``tests/support/near_ties.py``): Qwen3-0.6B's
shapes (random weights, bf16) over the first requests of ``benches/engine_vs_vllm.py``, the
Engine compiled (on a CPU without bfloat16 instructions its linears of 16+ rows multiply in
float32), unused blocks NaN-poisoned before every step.

    python benches/bf16_near_ties.py [--requests 8] [--tokens 16]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benches")]

from engine_vs_vllm import MODELS, build_model, workload  # noqa: E402

from atb_mem.integrations.cpu_linear import lacks_bf16_instructions  # noqa: E402
from atb_mem.serving import Engine  # noqa: E402
from tests.support.models import greedy, run_poisoned  # noqa: E402
from tests.support.near_ties import assert_each_matches_hf_up_to_near_ties  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    model = build_model("qwen3-0.6b")
    reference = copy.deepcopy(model)  # before the Engine takes the model's linears over
    engine = Engine(model, block_size=16, max_num_seqs=64, kv_cache_memory_bytes=1 << 30)
    prompts = [prompt for prompt, _ in workload(args.requests, MODELS["qwen3-0.6b"]["vocab"])]
    arrivals = {0: [(str(index), prompt, greedy(args.tokens))
                    for index, prompt in enumerate(prompts)]}
    results = run_poisoned(engine, arrivals)
    differing = assert_each_matches_hf_up_to_near_ties(results, reference, arrivals)
    print(f"float32 products: {lacks_bf16_instructions()}; {len(prompts)} requests of "
          f"{args.tokens} tokens: {len(prompts) - len(differing)} equal to HF's, "
          f"{len(differing)} leave them at a near tie {differing}")


if __name__ == "__main__":
    main()

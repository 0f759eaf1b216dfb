"""One engine process over a shared store, for tests/serving/test_shared_store.py:

    python -m tests.support.store_engine CHECKPOINT STORE_URL PROMPTS_JSON

runs each prompt alone, greedy, and prints one JSON line: the tokens per prompt and how many
blocks came from the store. Then it keeps its store client (whose memory holds the blocks
it put) alive until its standard input closes.
"""

from __future__ import annotations

import json
import sys

from atb_mem.serving import Engine, SamplingParams


def main(checkpoint: str, url: str, prompts_json: str) -> None:
    prompts = json.loads(prompts_json)
    engine = Engine.from_pretrained(checkpoint, device="cpu", dtype="float32", num_blocks=8,
                                    block_size=4, max_num_seqs=1, kv_store=url)
    tokens = []
    for prompt in prompts:
        [output] = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0))
        tokens.append(output.outputs[0].token_ids)
    assert engine.tiers is not None
    assert engine.tiers.wait_for_saves(60)  # another engine looks them up once this prints
    print(json.dumps({"tokens": tokens, "loaded_blocks": engine.tiers.counters.loaded_blocks}),
          flush=True)
    sys.stdin.read()
    engine.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:4])

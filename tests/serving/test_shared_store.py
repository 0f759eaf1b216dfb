"""A KV store shared across engines through a real ``mooncake_master`` on 127.0.0.1.

- Two engine processes share one master: the prompts engine A prefilled are loaded by engine
  B from A's blocks, and B's greedy tokens equal HF's.
- Engines of different models share nothing: their keys differ.
- A client buffer below one block (every put would fail) is refused at start-up.
- The master is killed mid-run (kill -9): requests recompute, none is lost, and the engine
  keeps serving and counts the failed lookups.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from atb_mem.kv.tiers.store import framed_size
from atb_mem.serving import Engine, SamplingParams
from tests.support.models import hf_greedy, model_pair, run_poisoned, save_tiny_checkpoint
from tests.support.mooncake import mooncake_master, require_mooncake

GREEDY = SamplingParams(max_tokens=6, temperature=0)
PROMPTS = [np.random.default_rng(seed).integers(3, 120, size=17).tolist() for seed in range(3)]


def engine_process(checkpoint: Path, url: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.store_engine", str(checkpoint), url,
         json.dumps(PROMPTS)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result_of(process: subprocess.Popen[str]) -> dict[str, object]:
    assert process.stdout is not None
    line = process.stdout.readline()  # bounded: the process ends (and EOFs) on any failure
    if not line:
        raise AssertionError(process.communicate(timeout=60)[1])
    return dict(json.loads(line))


def test_a_prompt_prefilled_by_engine_a_is_a_hit_on_engine_b(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    require_mooncake()
    save_tiny_checkpoint(tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype="float32").eval()
    expected = [hf_greedy(reference, prompt, GREEDY.max_tokens) for prompt in PROMPTS]
    with mooncake_master() as master:
        first = engine_process(tmp_path, master.url)
        second = None
        try:
            a = result_of(first)  # A stays up: the blocks live in its client's memory
            assert a["tokens"] == expected and a["loaded_blocks"] == 0
            second = engine_process(tmp_path, master.url)
            b = result_of(second)
            assert b["tokens"] == expected
            assert b["loaded_blocks"] == 4 * len(PROMPTS), b  # every full block of each
        finally:
            for process in (first, second):
                if process is not None:
                    process.communicate(timeout=120)  # closes stdin: it stops
        assert first.returncode == 0 and second is not None and second.returncode == 0


def test_repeated_prompts_come_back_from_the_store_and_match_hf() -> None:
    """One engine whose device keeps no earlier prompt: the second round's prefixes are
    loaded from the store, with the device's unused blocks poisoned before every step."""
    model, reference = model_pair("llama")
    expected = [hf_greedy(reference, prompt, GREEDY.max_tokens) for prompt in PROMPTS]
    with mooncake_master() as master:
        engine = Engine(model, num_blocks=8, block_size=4, max_num_seqs=1, kv_store=master.url)
        try:
            assert engine.tiers is not None
            for round_ in range(2):
                for index, prompt in enumerate(PROMPTS):
                    request_id = f"{round_}-{index}"
                    results = run_poisoned(engine, {0: [(request_id, prompt, GREEDY)]})
                    assert results[request_id][0][0] == expected[index], request_id
                # The saves are written on the tier's thread: the second round counts on
                # them having landed (on a loaded machine they may land after its lookups).
                assert engine.tiers.wait_for_saves(60)
            assert engine.tiers.counters.loaded_by_tier == {"MOONCAKE": 4 * len(PROMPTS)}
        finally:
            engine.shutdown()


def test_engines_of_different_models_share_nothing() -> None:
    with mooncake_master() as master:
        (model, _), (other, _) = model_pair("llama"), model_pair("qwen3")
        engines = [Engine(one, num_blocks=8, block_size=4, max_num_seqs=1, kv_store=master.url)
                   for one in (model, other)]
        try:
            engines[0].generate([PROMPTS[0]], GREEDY)
            engines[1].generate([PROMPTS[0]], GREEDY)
            assert engines[1].tiers is not None and engines[0].tiers is not None
            assert engines[1].tiers.counters.offered_blocks == 0
            assert engines[0].tiers.identity != engines[1].tiers.identity
        finally:
            for engine in engines:
                engine.shutdown()


def test_a_buffer_below_one_block_is_refused_at_start_up() -> None:
    """Every put would fail for the engine's life: the error names ``buffer`` and the bytes
    of a block (2,048 of K/V and its frame), which Mooncake's allocator rounds up to 2,304.
    A buffer of exactly that is taken, and its puts land."""
    model, _ = model_pair("llama")
    framed = framed_size(2048)
    with mooncake_master() as master:
        for buffer in ("1KiB", "0", str(framed)):
            url = master.url.replace("buffer=16MiB", f"buffer={buffer}")
            with pytest.raises(ValueError, match=f"buffer={buffer}.*buffer of "
                                                 f".*{framed} bytes.*buffer=2304"):
                Engine(model, num_blocks=8, block_size=4, kv_store=url)
        engine = Engine(model, num_blocks=8, block_size=4,
                        kv_store=master.url.replace("buffer=16MiB", "buffer=2304"))
        try:
            engine.generate([PROMPTS[0]], GREEDY)
            assert engine.tiers is not None and engine.tiers.wait_for_saves(60)
            assert engine.tiers.counters.saved_by_tier == {"MOONCAKE": 4}
            assert engine.tiers.counters.store_errors == 0
        finally:
            engine.shutdown()


def test_the_store_killed_mid_run_costs_recomputes_only(caplog: pytest.LogCaptureFixture
                                                       ) -> None:
    model, reference = model_pair("llama")
    expected = [hf_greedy(reference, prompt, GREEDY.max_tokens) for prompt in PROMPTS]
    with mooncake_master() as master:
        engine = Engine(model, num_blocks=8, block_size=4, max_num_seqs=1, kv_store=master.url)
        try:
            produced = [engine.generate([p], GREEDY)[0].outputs[0].token_ids for p in PROMPTS]
            assert produced == expected
            master.kill()
            with caplog.at_level("WARNING", logger="atb_mem.tiers"):
                produced = [engine.generate([p], GREEDY)[0].outputs[0].token_ids
                            for p in PROMPTS]
            assert produced == expected, "every request recomputed"
            assert engine.tiers is not None
            assert engine.tiers.counters.store_errors > 0
            assert "shared store" in caplog.text
        finally:
            engine.shutdown()

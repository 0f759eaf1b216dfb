"""Tensor parallelism with 2 ranks over gloo on the CPU: output equal to the single-process
engine for a mixed batch with swap preemption, prefix hits and copy-on-write forks, with the
unused blocks NaN on every rank before every step (every step the ranks also compare their
block tables through a collective); and a rank that dies ends rank 0 with a clear error
instead of a hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.models import run_poisoned, save_tiny_checkpoint
from tests.support.processes import free_port
from tests.support.tensor_parallel_rank import ENGINE, FORK_PROMPT, MAX_TOKENS, PROMPTS

ROOT = Path(__file__).resolve().parents[2]


def run_ranks(checkpoint: Path, out: Path, *extra: str) -> list[subprocess.CompletedProcess[str]]:
    port = str(free_port())
    processes = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(ROOT)}
        processes.append(subprocess.Popen(
            [sys.executable, "-m", "tests.support.tensor_parallel_rank", str(checkpoint),
             str(out), *extra], env=env, cwd=ROOT, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True))
    results = []
    try:
        for process in processes:
            stdout, stderr = process.communicate(timeout=300)
            results.append(subprocess.CompletedProcess(process.args, process.returncode,
                                                       stdout, stderr))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    return results


def single_process_tokens(checkpoint: Path, num_blocks: int | None = None
                          ) -> tuple[list[list[int]], list[list[int]], Any]:
    from atb_mem.serving import Engine, SamplingParams

    engine = Engine.from_pretrained(str(checkpoint), **{
        **ENGINE, "num_blocks": num_blocks or ENGINE["num_blocks"]})
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outputs = run_poisoned(engine, {0: [(str(i), prompt, greedy)
                                        for i, prompt in enumerate(PROMPTS)]})
    forked = run_poisoned(engine, {0: [("forked", FORK_PROMPT, SamplingParams(
        max_tokens=6, n=3, temperature=0, ignore_eos=True))]})["forked"]
    return ([outputs[str(i)][0][0] for i in range(len(PROMPTS))],
            [forked[index][0] for index in sorted(forked)], engine)


def test_two_ranks_match_one_process_token_for_token(checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    results = run_ranks(checkpoint, out)
    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]
    tensor_parallel = json.loads(out.read_text())
    expected, forked, engine = single_process_tokens(checkpoint)
    assert tensor_parallel["tokens"] == expected
    assert tensor_parallel["forked"] == forked
    # The batch exercised what it is meant to, on both sides alike.
    assert tensor_parallel["preemptions"] == engine.scheduler.stats()["preemptions"] > 0
    assert tensor_parallel["hits"] == engine.kv_cache.stats()["prefix_cache_hits"] > 0


@pytest.fixture(scope="module")
def hybrid_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gemma3")
    save_tiny_checkpoint(path, "gemma3")
    return path


def test_a_hybrid_model_matches_over_two_ranks(hybrid_checkpoint: Path, tmp_path: Path) -> None:
    """Gemma 3 (sliding and full layers): three KV-cache groups, each group's block table
    broadcast, windows releasing blocks on every rank alike."""
    out = tmp_path / "result.json"
    results = run_ranks(hybrid_checkpoint, out, "--num-blocks", "72")
    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]
    tensor_parallel = json.loads(out.read_text())
    expected, forked, engine = single_process_tokens(hybrid_checkpoint, num_blocks=72)
    assert len(engine.kv_cache.groups) == 3
    assert tensor_parallel["tokens"] == expected and tensor_parallel["forked"] == forked
    assert tensor_parallel["hits"] == engine.kv_cache.stats()["prefix_cache_hits"]
    assert tensor_parallel["preemptions"] == engine.scheduler.stats()["preemptions"]


def test_a_rank_that_dies_ends_rank_0_with_a_clear_error(checkpoint: Path,
                                                         tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    rank_0, rank_1 = run_ranks(checkpoint, out, "--die-after", "3")
    assert rank_1.returncode == 3
    result = json.loads(out.read_text())
    assert "a rank died or timed out" in result["error"], result
    assert result["seconds"] < 120
    assert rank_0.returncode == 0, rank_0.stderr[-3000:]


def test_a_model_that_cannot_be_split_is_refused_unchanged() -> None:
    import torch
    import transformers

    from atb_mem.distributed.tensor_parallel import shard_model
    from tests.support.models import tiny_model

    # Dense first layer, experts after it: a split that went layer by layer would have
    # changed layer 0 before it found layer 1 unsplittable.
    mixed = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=16,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[0]))
    for model, size, error in ((mixed, 2, NotImplementedError),
                               (tiny_model("qwen3_moe"), 2, NotImplementedError),
                               (tiny_model("llama"), 3, ValueError)):
        before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        try:
            shard_model(model, 0, size)
        except error:
            pass
        else:
            raise AssertionError(f"{type(model).__name__} split {size} ways")
        after = model.state_dict()
        assert before.keys() == after.keys()
        assert all(torch.equal(before[name], after[name]) for name in before)

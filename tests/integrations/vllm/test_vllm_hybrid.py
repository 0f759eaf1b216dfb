"""``AtbMemConnector`` inside vLLM's CPU build on a hybrid model (a tiny Gemma 3: sliding
windows of 64 tokens around a full-attention layer), with vLLM's hybrid manager on: each
KV-cache group has its block ids, the windows' groups let old blocks go, and every group's
blocks move together. Outputs are compared token for token (and logprob) with vLLM alone,
which runs the same hybrid manager; vLLM's prefix caching is off, so only the connector
serves a repeat."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.test_vllm_end_to_end import FAULTS, HOST, _disk_files, assert_as_alone
from tests.integrations.vllm.vllm_process import VllmProcess, alone, tiny_gemma3, token_prompt

H = token_prompt(11, 600)  # four whole 128-token blocks: the windows keep the last ones
J = H[:400] + token_prompt(12, 100)  # shares three blocks and one 16-token piece with H
K = token_prompt(13, 300)
PROMPTS = [H, J, K]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_gemma3(tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def expected(model: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> dict[tuple[int, ...], tuple[list[int], list[float]]]:
    outputs, result = alone(model, tmp_path_factory.mktemp("alone") / "vllm.log", PROMPTS)
    assert result["hybrid_manager"], "vLLM alone runs its hybrid manager on this model"
    return outputs


def test_a_hybrid_model_keeps_vllms_hybrid_manager_and_is_served_from_the_host(
        model: Path, expected: dict[tuple[int, ...], Any], tmp_path: Path) -> None:
    prompts = [H, H, J]
    with VllmProcess(model, tmp_path / "vllm.log", [{"prompts": prompts}], HOST) as vllm:
        result = vllm.run()
    assert result["hybrid_manager"], "the connector no longer turns vLLM's hybrid manager off"
    # H: four whole blocks and five 16-token pieces of its fifth (the first H's last block,
    # saved when it ended, in every group); J: three blocks and one piece.
    assert result["cached"] == [0, 592, 400]
    assert result["counters"]["vllm:external_prefix_cache_hits"] == 592 + 400
    assert_as_alone(expected, prompts, result)


def test_loading_zeros_into_every_group_changes_the_tokens(
        model: Path, expected: dict[tuple[int, ...], Any], tmp_path: Path) -> None:
    """The negative control: the comparison above can fail."""
    with VllmProcess(model, tmp_path / "vllm.log", [{"prompts": [H, H]}], HOST,
                     connector="ZeroLoadsConnector", module=FAULTS) as vllm:
        result = vllm.run()
    assert result["cached"] == [0, 592]
    assert result["tokens"][0] == expected[tuple(H)][0]
    assert result["tokens"][1] != expected[tuple(H)][0]


def test_a_fresh_vllm_loads_a_hybrid_prompt_from_the_disk_and_recomputes_a_damaged_one(
        model: Path, expected: dict[tuple[int, ...], Any], tmp_path: Path) -> None:
    """A failed load of a hybrid prompt is named by its request (vLLM cannot map one group's
    block ids back): vLLM recomputes the prompt whole, and its answer is still vLLM's."""
    disk = tmp_path / "kv"
    tiers = {**HOST, "disk": [str(disk), "64MiB"]}
    # The disk writes a block on its second sighting: the repeat, served by the host.
    with VllmProcess(model, tmp_path / "first.log", [{"prompts": [H, H, K, K]}],
                     tiers) as vllm:
        result = vllm.run()
    assert result["cached"] == [0, 592, 0, 288]
    files = _disk_files(disk, K)
    phases: list[dict[str, Any]] = [{"prompts": [H]}, {"prompts": [K]}]
    with VllmProcess(model, tmp_path / "second.log", phases, tiers) as vllm:
        result = vllm.run()
        assert result["cached"] == [512]  # the disk keeps whole blocks only
        assert result["counters"]["vllm:atb_mem_loaded_blocks{DISK}"] == 4
        assert_as_alone(expected, [H], result)

        damaged = files[1]
        data = bytearray(damaged.read_bytes())
        data[len(data) // 2] ^= 0xFF
        damaged.write_bytes(bytes(data))
        result = vllm.run()
        assert_as_alone(expected, [K], result)
        counters = result["counters"]
        assert counters["vllm:atb_mem_load_failures"] == 1
        assert counters["vllm:atb_mem_corrupt_blocks"] == 1

"""``AtbMemConnector`` inside vLLM's CPU build, end to end: a tiny random-weight Llama (fp32,
token-id prompts, greedy), vLLM's prefix caching off so that only the connector can serve a
repeat. Every output is compared token for token (and logprob) with vLLM without the
connector, and every test asserts how many tokens vLLM took from the connector, so none
passes with zero hits. vLLM starts in 20-45 s here: each test starts as few as it needs."""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.vllm_process import (
    VllmProcess,
    alone,
    serve_vllm,
    tiny_llama,
    token_prompt,
)
from tests.support.mooncake import mooncake_master
from tests.support.processes import free_port, wait_until_healthy

P = token_prompt(1, 300)
Q = P[:176] + token_prompt(2, 100)  # shares 128 + 3·16 tokens with P
S = P[:64] + token_prompt(3, 150)  # shares 4·16 tokens, inside P's first block
U = token_prompt(4, 290)
V = token_prompt(5, 270)
W = token_prompt(6, 280)
PROMPTS = [P, Q, S, U, V, W]
HOST = {"host": "64MiB", "hash_block_size": 16}
FAULTS = "tests.integrations.vllm.faulty_connectors"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def expected(model: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> dict[tuple[int, ...], tuple[list[int], list[float]]]:
    """vLLM alone: each prompt's tokens and logprobs."""
    outputs, result = alone(model, tmp_path_factory.mktemp("alone") / "vllm.log", PROMPTS)
    assert result["cached"] == [0] * len(PROMPTS)
    return outputs


def assert_as_alone(expected: dict[tuple[int, ...], Any], prompts: list[list[int]],
                    result: dict[str, Any]) -> None:
    for at, prompt in enumerate(prompts):
        tokens, logprobs = expected[tuple(prompt)]
        assert result["tokens"][at] == tokens, f"prompt {at}: tokens differ from vLLM alone"
        assert all(math.isclose(a, b, abs_tol=1e-4)
                   for a, b in zip(result["logprobs"][at], logprobs, strict=True)), \
            f"prompt {at}: logprobs differ from vLLM alone"


def test_the_host_tier_serves_repeats_and_hits_finer_than_a_block(
        model: Path, expected: dict[tuple[int, ...], Any], tmp_path: Path) -> None:
    prompts = [P, P, Q, S]
    with VllmProcess(model, tmp_path / "vllm.log", [{"prompts": prompts}], HOST) as vllm:
        result = vllm.run()
    # 300 tokens: two whole 128-token blocks and two 16-token pieces of the third (the first
    # P's last block, saved when it ended, copied whole); Q: one block and three pieces of
    # the next, copied whole; S: four pieces of the first.
    assert result["cached"] == [0, 256 + 32, 176, 64]
    counters = result["counters"]
    assert counters["vllm:external_prefix_cache_hits"] == 288 + 176 + 64
    assert counters["vllm:atb_mem_loaded_blocks{HOST}"] == 3 + 2 + 1
    assert_as_alone(expected, prompts, result)


def test_a_tail_is_copied_before_vllm_gives_its_block_to_another_request(
        model: Path, expected: dict[tuple[int, ...], Any], tmp_path: Path) -> None:
    """vLLM runs a step's forward before its ``start_load_kv`` when the step loads nothing
    synchronously, so an ended request's last block stays its own until a worker copied it.
    P and V fill the cache (six blocks); U waits, then takes their freed blocks, P's last
    one first, and computes into them in the step that would copy P's tail. P's repeat
    still gets P's tail."""
    phases: list[dict[str, Any]] = [{"prompts": [P, V, U], "together": True},
                                    {"prompts": [P]}]
    with VllmProcess(model, tmp_path / "vllm.log", phases, HOST, num_blocks=7,
                     max_model_len=512) as vllm:
        together = vllm.run()
        assert_as_alone(expected, [P, V, U], together)
        result = vllm.run()
    assert result["cached"] == [256 + 32]
    assert_as_alone(expected, [P], result)


def test_loading_zeros_instead_changes_the_tokens(
        model: Path, expected: dict[tuple[int, ...], Any], tmp_path: Path) -> None:
    """The negative control: the comparison above can fail."""
    with VllmProcess(model, tmp_path / "vllm.log", [{"prompts": [P, P]}], HOST,
                     connector="ZeroLoadsConnector", module=FAULTS) as vllm:
        result = vllm.run()
    assert result["cached"] == [0, 288]
    assert result["tokens"][0] == expected[tuple(P)][0]
    assert result["tokens"][1] != expected[tuple(P)][0]


def _disk_files(folder: Path, prompt: list[int]) -> list[Path]:
    """The disk tier's files of ``prompt``'s whole blocks, in order."""
    import atb_mem

    hashes = atb_mem.KVCachePool(2, 128, hash_block_size=16).block_hashes(prompt)
    files = []
    for words in hashes[:(len(prompt) - 1) // 128]:
        found = list(folder.glob(f"*/*{int(words[0]):016x}{int(words[1]):016x}.kv"))
        assert len(found) == 1, f"no disk file for a block of the prompt: {found}"
        files.append(found[0])
    return files


def test_a_fresh_vllm_loads_from_the_disk_tier_and_recomputes_damaged_files(
        model: Path, expected: dict[tuple[int, ...], Any], tmp_path: Path) -> None:
    disk = tmp_path / "kv"
    tiers = {**HOST, "disk": [str(disk), "64MiB"]}
    # The disk writes a block on its second sighting: the repeat, served by the host.
    first = [P, P, U, U, V, V]
    with VllmProcess(model, tmp_path / "first.log", [{"prompts": first}], tiers,
                     kv_events_port=free_port()) as vllm:
        result = vllm.run()
    # Each repeat: two whole blocks, and the whole 16-token pieces of the first run's last
    # block within the prompt (P's 300 and U's 290 tokens: two; V's 270: none).
    assert result["cached"] == [0, 288, 0, 288, 0, 256]
    assert_as_alone(expected, first, result)
    # vLLM's own KV-event stream names the tiers: the host took each computed block, the
    # disk the ones seen twice.
    assert result["events"].get("BlockStored/CPU") == 6
    assert result["events"].get("BlockStored/DISK") == 6
    files = {tuple(prompt): _disk_files(disk, prompt) for prompt in (P, U, V)}

    phases: list[dict[str, Any]] = [{"prompts": [P]}, {"prompts": [U]}, {"prompts": [V]}]
    with VllmProcess(model, tmp_path / "second.log", phases, tiers) as vllm:
        result = vllm.run()
        assert result["cached"] == [256]
        assert result["counters"]["vllm:atb_mem_loaded_blocks{DISK}"] == 2
        assert_as_alone(expected, [P], result)

        damaged = files[tuple(U)][0]
        data = bytearray(damaged.read_bytes())
        data[len(data) // 2] ^= 0xFF
        damaged.write_bytes(bytes(data))
        result = vllm.run()
        assert_as_alone(expected, [U], result)
        counters = result["counters"]
        assert counters["vllm:atb_mem_load_failures"] == 1
        assert counters["vllm:atb_mem_corrupt_blocks"] == 1
        assert counters["vllm:atb_mem_loaded_blocks{DISK}"] == 2

        truncated = files[tuple(V)][1]
        truncated.write_bytes(truncated.read_bytes()[:100])
        result = vllm.run()
        assert_as_alone(expected, [V], result)
        counters = result["counters"]
        assert counters["vllm:atb_mem_load_failures"] == 2
        assert counters["vllm:atb_mem_loaded_blocks{DISK}"] == 3  # V's first block landed


def test_files_removed_from_the_disk_folder_are_written_again(
        model: Path, expected: dict[tuple[int, ...], Any], tmp_path: Path) -> None:
    """Another engine sharing the folder evicted a prompt's files, or a clean-up removed
    them: the next time this engine computes the prompt it writes them again, and a later
    request loads them (it used to miss for good, its files counted as held)."""
    disk = tmp_path / "kv"
    tiers = {"host": 0, "hash_block_size": 16, "disk": [str(disk), "64MiB"]}
    phases: list[dict[str, Any]] = [{"prompts": [P, P]}] * 2 + [{"prompts": [P]}]
    with VllmProcess(model, tmp_path / "vllm.log", phases, tiers) as vllm:
        vllm.run()  # computed twice: written on the second sighting
        for file in _disk_files(disk, P):
            file.unlink()
        result = vllm.run()
        assert result["cached"] == [0, 0]
        assert_as_alone(expected, [P, P], result)
        assert len(_disk_files(disk, P)) == 2, "written again"
        result = vllm.run()
        assert result["cached"] == [256]
        assert_as_alone(expected, [P], result)


def test_two_vllm_processes_share_blocks_through_mooncake(
        model: Path, expected: dict[tuple[int, ...], Any], tmp_path: Path) -> None:
    with mooncake_master() as master:
        tiers = {**HOST, "store": master.url}
        writer = VllmProcess(model, tmp_path / "writer.log", [{"prompts": [P, W]}], tiers)
        reader = VllmProcess(model, tmp_path / "reader.log",
                             [{"prompts": [P]}, {"prompts": [W]}], tiers)
        with writer, reader:
            assert_as_alone(expected, [P, W], writer.run())
            result = reader.run()
            assert result["cached"] == [256]
            assert result["counters"]["vllm:atb_mem_loaded_blocks{MOONCAKE}"] == 2
            assert_as_alone(expected, [P], result)

            master.kill()  # W's blocks are in the writer's segment, the master is gone
            result = reader.run()
            assert result["cached"] == [0]
            assert_as_alone(expected, [W], result)
            assert result["counters"].get("vllm:atb_mem_store_errors", 0) >= 1


def _complete(port: int, model: Path, prompt: list[int]) -> tuple[list[int], list[float], int]:
    """A completion through the OpenAI API: its tokens, their logprobs, the cached tokens."""
    import httpx

    answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=300, json={
        "model": str(model), "prompt": prompt, "max_tokens": 8, "temperature": 0,
        "logprobs": 0, "return_token_ids": True,
        "return_tokens_as_token_ids": True}).raise_for_status().json()
    choice = answer["choices"][0]
    details = answer["usage"].get("prompt_tokens_details") or {}
    return (choice["token_ids"], choice["logprobs"]["token_logprobs"],
            details.get("cached_tokens") or 0)


def test_prefill_and_decode_servers_share_prompts_through_mooncake(
        model: Path, expected: dict[tuple[int, ...], Any], tmp_path: Path) -> None:
    """Two ``vllm serve`` (kv_producer, kv_consumer) and the package's proxy: the decode
    server loads every whole prompt block the prefill server computed and answers as one
    vLLM alone; with the master, then the prefill server killed, it recomputes, never
    fails."""
    from atb_mem.integrations.vllm.disagg_proxy import DisaggProxy

    with mooncake_master() as master:
        ports = [free_port() for _ in range(3)]
        servers = [serve_vllm(model, tmp_path / f"{role}.log", port, role,
                              {"host": 0, "hash_block_size": 16, "store": master.url})
                   for role, port in zip(("kv_producer", "kv_consumer"), ports, strict=False)]
        proxy = DisaggProxy(("127.0.0.1", ports[2]), f"http://127.0.0.1:{ports[0]}",
                            f"http://127.0.0.1:{ports[1]}", timeout_s=300)
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        try:
            for server, port in zip(servers, ports, strict=False):
                wait_until_healthy(server, port, 300)

            def check(prompt: list[int], cached: int) -> None:
                tokens, logprobs, served = _complete(ports[2], model, prompt)
                assert tokens == expected[tuple(prompt)][0], "tokens differ from vLLM alone"
                assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in
                           zip(logprobs, expected[tuple(prompt)][1], strict=True))
                assert served == cached

            check(P, 256)  # two whole blocks loaded, the last partial one computed
            check(U, 256)
            assert proxy.prefill_failures == 0
            master.kill()
            check(V, 0)  # the prefill server's puts fail, the decode's lookups too
            servers[0].kill()
            servers[0].wait(30)
            check(W, 0)
            assert proxy.prefill_failures == 1
        finally:
            proxy.shutdown()
            proxy.server_close()
            for server in servers:
                server.terminate()
                server.wait(60)


def test_a_bad_extra_config_fails_start_up_naming_the_key(model: Path, tmp_path: Path) -> None:
    message = VllmProcess(model, tmp_path / "vllm.log", [], {"host": "64MiB", "hoast": 1}
                          ).start_error()
    assert "unknown key 'hoast'" in message


def test_an_abort_and_preemptions_while_disk_loads_are_in_flight_free_everything(
        model: Path, expected: dict[tuple[int, ...], Any], tmp_path: Path) -> None:
    disk = tmp_path / "kv"
    tiers = {**HOST, "disk": [str(disk), "64MiB"]}
    with VllmProcess(model, tmp_path / "first.log", [{"prompts": [P, P, U, U]}], tiers) as vllm:
        vllm.run()
    # Every disk read takes a second; nine blocks of 128 tokens for three requests that
    # grow to six blocks each: vLLM preempts while U's load is in flight. Every disk load
    # asynchronous (none read before the forward), as a slow disk's would be.
    tiers = {**tiers, "disk_sync_load": 0}
    phases: list[dict[str, Any]] = [
        {"abort": P, "prompts": [Q]},
        {"prompts": [U, V, W], "together": True, "max_tokens": 400}]
    with VllmProcess(model, tmp_path / "second.log", phases, tiers,
                     connector="SlowStoresConnector", module=FAULTS, in_process=True,
                     num_blocks=10, max_model_len=1024) as vllm:
        result = vllm.run()
        assert result["waited"], "the aborted request never waited for its disk load"
        assert result["cached"] == [128]  # Q's first block is P's, on the disk
        assert_as_alone(expected, [Q], result)
        assert result["held"] == {"free_blocks": 9, "requests": 0, "connector_requests": 0,
                                  "loading": 0}

        result = vllm.run()
        assert result["counters"]["vllm:num_preemptions"] > 0
        assert result["counters"]["vllm:atb_mem_loaded_blocks{DISK}"] >= 1 + 2
        for at, prompt in enumerate([U, V, W]):
            assert result["tokens"][at][:8] == expected[tuple(prompt)][0]
        assert result["held"] == {"free_blocks": 9, "requests": 0, "connector_requests": 0,
                                  "loading": 0}

"""The disk tier under a model. The device pool is too small to keep any earlier prompt, and
there is no host tier. Each prompt runs three times round:

- the first time, its blocks are seen once and not written (one-off prompts do not wear the
  disk);
- the second time, they are computed again and written;
- the third time, they are loaded from disk while the engine serves on.

The greedy tokens equal HF's own ``generate`` every time, with the device's unused blocks
poisoned (NaN) before every step.

Faults:

- a corrupted or truncated file is detected by its checksum, and that prefix is recomputed;
- a file deleted under the engine is recomputed once, and written anew by that recompute;
- with the checksum check off, the corrupted chunk changes the tokens (the negative control);
- a directory that cannot be written is refused at start-up;
- one that fails at run time stops the writes, and the engine serves on.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from atb_mem.kv.tiers import block_key, unframe
from atb_mem.kv.tiers.store import framed_size
from atb_mem.serving import Engine, SamplingParams
from tests.support.models import hf_greedy, model_pair, run_poisoned

BLOCK_SIZE = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0)
PROMPTS = [np.random.default_rng(seed).integers(3, 256, size=17).tolist() for seed in range(4)]


def disk_engine(model: object, path: Path) -> Engine:
    return Engine(model, num_blocks=8, block_size=BLOCK_SIZE, max_num_seqs=1,
                  kv_offload={"disk": (str(path), "16MiB")})


def run_round(engine: Engine, label: str) -> list[list[int]]:
    produced = []
    for index, tokens in enumerate(PROMPTS):
        request_id = f"{label}-{index}"
        produced.append(run_poisoned(engine, {0: [(request_id, tokens, GREEDY)]})
                        [request_id][0][0])
    # Saves land on the tier's own thread: the next round counts on them.
    assert engine.tiers is not None and engine.tiers.wait_for_saves(60)
    return produced


def written(path: Path) -> tuple[Engine, list[list[int]]]:
    """An engine whose disk tier holds every prompt (two rounds run), and HF's tokens."""
    model, reference = model_pair("llama")
    engine = disk_engine(model, path)
    expected = [hf_greedy(reference, tokens, GREEDY.max_tokens) for tokens in PROMPTS]
    run_round(engine, "first")
    run_round(engine, "second")
    return engine, expected


def damage(chunk: Path, how: str = "corrupt") -> None:
    """Overwrites the payload past the header, or cuts the file in half."""
    value, header = chunk.read_bytes(), framed_size(0)
    chunk.write_bytes(value[:header] + b"\x7f" * (len(value) - header) if how == "corrupt"
                      else value[:len(value) // 2])


def folder_of(engine: Engine) -> Path:
    """The folder of the engine's disk tier (named by its identity, under the directory)."""
    assert engine.tiers is not None
    folder: Path = engine.tiers.stores[0].layout_path  # type: ignore[attr-defined]
    return folder


def chunk_of(engine: Engine, path: Path, prompt: list[int], index: int) -> Path:
    assert engine.tiers is not None and folder_of(engine).parent == path
    key = block_key(engine.tiers.identity, engine.kv_cache.block_hashes(prompt)[index])
    return folder_of(engine) / (key.replace("/", "-") + ".kv")


def test_repeated_prompts_are_loaded_from_disk_and_match_hf(tmp_path: Path) -> None:
    model, reference = model_pair("llama")
    engine = disk_engine(model, tmp_path)
    expected = [hf_greedy(reference, tokens, GREEDY.max_tokens) for tokens in PROMPTS]
    assert run_round(engine, "first") == expected
    assert not list(folder_of(engine).glob("*.kv")), "blocks seen once are not written"
    assert run_round(engine, "second") == expected
    assert len(list(folder_of(engine).glob("*.kv"))) >= 16  # 4 full blocks of each prompt
    assert engine.tiers is not None
    before = engine.tiers.counters.loaded_blocks
    assert run_round(engine, "third") == expected
    # Each third-round prompt loaded its 4 full blocks: the device held none of them.
    assert engine.tiers.counters.loaded_blocks - before == 16
    stats = engine.scheduler.stats()
    assert stats["loads_started"] == 4 and stats["load_failures"] == 0
    assert engine.kv_cache.stats()["blocks_used"] == 0
    # explain_prefix names the disk for what only it holds.
    why = engine.tiers.explain_prefix(PROMPTS[0])
    assert why.hit_tokens == 4 * BLOCK_SIZE and why.tiers[-1][0] == "disk", why
    # The metrics say where the hits came from and what moved.
    from atb_mem.observability.metrics import AtbMemCollector
    from tests.observability.test_metrics import scrape

    samples = scrape(AtbMemCollector(kv_cache=engine.kv_cache, tiers=engine.tiers))
    per_block = engine.kv_cache.bytes_per_block
    assert samples["atb_mem_kv_cache_prefix_cache_hit_tokens_total"][
        (("tier", "DISK"),)] == 16 * BLOCK_SIZE
    assert samples["atb_mem_kv_tier_bytes_total"][
        (("direction", "loaded"), ("tier", "DISK"))] == 16 * per_block
    assert samples["atb_mem_kv_tier_bytes_total"][
        (("direction", "saved"), ("tier", "DISK"))] >= 16 * per_block
    assert samples["atb_mem_kv_tier_load_seconds_count"][()] == 4
    assert samples["atb_mem_kv_tier_load_failures_total"][()] == 0


def test_a_file_swapped_for_another_valid_block_is_detected(tmp_path: Path) -> None:
    """Every block's file is intact on its own; one holding another prompt's block (a file
    moved, or a copy restored over the wrong name) is caught by the key its header carries,
    recomputed, and written anew."""
    engine, expected = written(tmp_path)
    chunk = chunk_of(engine, tmp_path, PROMPTS[0], 1)
    chunk.write_bytes(chunk_of(engine, tmp_path, PROMPTS[1], 1).read_bytes())
    assert run_round(engine, "third") == expected
    assert engine.tiers is not None and engine.tiers.counters.load_failures == 1
    assert run_round(engine, "fourth") == expected
    assert engine.tiers.counters.load_failures == 1


@pytest.mark.parametrize("how", ["corrupt", "truncate"])
def test_a_damaged_chunk_is_detected_and_recomputed(tmp_path: Path, how: str) -> None:
    engine, expected = written(tmp_path)
    chunk = chunk_of(engine, tmp_path, PROMPTS[0], 1)
    damage(chunk, how)
    assert run_round(engine, "third") == expected
    assert engine.tiers is not None and engine.tiers.counters.load_failures == 1
    assert engine.scheduler.stats()["load_failures"] == 1
    # The damaged file was dropped, and the recompute wrote the block anew: it loads.
    key = block_key(engine.tiers.identity, engine.kv_cache.block_hashes(PROMPTS[0])[1])
    assert unframe(chunk.read_bytes(), engine.kv_cache.bytes_per_block, key=key) is not None
    before = engine.tiers.counters.loaded_blocks
    assert run_round(engine, "fourth") == expected
    assert engine.tiers.counters.loaded_blocks - before == 16
    assert engine.tiers.counters.load_failures == 1


@pytest.mark.parametrize("per_copy", [None, 3])
def test_a_load_lands_in_one_copy_per_landing_buffer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, per_copy: int | None) -> None:
    """A prompt's four blocks from the disk land in the device's blocks as one copy (or as
    few as a landing buffer of ``per_copy`` blocks allows), not one per block; the tokens
    still equal HF's, unused blocks poisoned."""
    from atb_mem.kv.tiers import block_io

    engine, expected = written(tmp_path)
    assert engine.tiers is not None
    if per_copy is not None:
        monkeypatch.setattr(block_io, "LANDING_BYTES", per_copy * engine.kv_cache.bytes_per_block)
    backend = engine.tiers._tensors.backend
    copy_blocks, landed = backend.copy_blocks, []

    def counted(dst: object, dst_blocks: object, src: object, src_blocks: object) -> None:
        if dst is engine.tiers._tensors.kv:  # type: ignore[union-attr]
            landed.append(len(np.asarray(dst_blocks)))
        copy_blocks(dst, dst_blocks, src, src_blocks)

    monkeypatch.setattr(backend, "copy_blocks", counted)
    produced = run_poisoned(engine, {0: [("third", PROMPTS[0], GREEDY)]})
    assert produced["third"][0][0] == expected[0]
    assert engine.tiers.counters.loaded_blocks == 4
    assert landed == ([4] if per_copy is None else [3, 1])


def test_a_lost_file_is_recomputed_once_and_written_anew(tmp_path: Path) -> None:
    """A block file deleted under a running engine: the next request's load fails and it
    recomputes (HF's tokens), that recompute writes the block again, and the request after
    loads every block from disk."""
    engine, expected = written(tmp_path)
    assert engine.tiers is not None
    chunk = chunk_of(engine, tmp_path, PROMPTS[0], 1)
    chunk.unlink()
    assert run_round(engine, "third") == expected
    assert engine.tiers.counters.load_failures == 1
    assert chunk.exists(), "the recompute wrote the lost block anew"
    before = engine.tiers.counters.loaded_blocks
    assert run_round(engine, "fourth") == expected
    assert engine.tiers.counters.loaded_blocks - before == 16
    assert engine.tiers.counters.load_failures == 1


def test_a_load_that_cannot_land_is_reported_failed_and_recomputed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, expected = written(tmp_path)
    assert engine.tiers is not None
    land = engine.tiers._land
    calls = []

    def land_once_failing(load: object) -> bool:
        calls.append(load)
        if len(calls) == 1:
            raise RuntimeError("the device copy failed")
        return land(load)  # type: ignore[arg-type]

    monkeypatch.setattr(engine.tiers, "_land", land_once_failing)
    assert run_round(engine, "third") == expected
    assert engine.scheduler.stats()["loading"] == 0 and engine.tiers.num_loading == 0
    assert engine.scheduler.stats()["load_failures"] == 1


def test_negative_control_a_corrupt_chunk_served_unchecked_changes_the_tokens(
        tmp_path: Path) -> None:
    engine, expected = written(tmp_path)
    damage(chunk_of(engine, tmp_path, PROMPTS[0], 1))
    assert engine.tiers is not None
    engine.tiers.checksum = False
    produced = run_round(engine, "third")
    assert produced[0] != expected[0], "the corrupted chunk was not what the model read"
    assert produced[1:] == expected[1:]


def test_lower_tiers_refuse_what_they_cannot_serve(tmp_path: Path) -> None:
    from atb_mem.serving.kv_sizing import kv_cache_shape, tier_connector

    model, _ = model_pair("llama")
    engine = Engine(model, num_blocks=8, block_size=BLOCK_SIZE)
    shape = kv_cache_shape(model)
    with pytest.raises(ValueError, match="without tensor parallelism"):
        tier_connector(engine.kv_cache, model, {"disk": (str(tmp_path), "1MiB")}, None, shape,
                       2)
    hybrid, _ = model_pair("gemma3")
    with pytest.raises(ValueError, match="all full-attention; this one has sliding-window"):
        Engine(hybrid, num_blocks=32, block_size=BLOCK_SIZE,
               kv_offload={"disk": (str(tmp_path), "1MiB")})


def test_an_unwritable_directory_is_refused_at_start_up(tmp_path: Path) -> None:
    model, _ = model_pair("llama")
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="is not writable"):
        disk_engine(model, blocker / "tier")


def test_a_directory_that_fails_at_run_time_stops_the_writes(tmp_path: Path) -> None:
    """The tier's folder is replaced by a file mid-run (a real OSError on every write,
    even for root, unlike a read-only mode): writes stop with a warning, serving goes on."""
    model, reference = model_pair("llama")
    path = tmp_path / "tier"
    engine = disk_engine(model, path)
    expected = [hf_greedy(reference, tokens, GREEDY.max_tokens) for tokens in PROMPTS]
    run_round(engine, "first")
    folder_of(engine).rmdir()
    folder_of(engine).write_text("no longer a directory")
    assert run_round(engine, "second") == expected
    assert engine.tiers is not None
    store = engine.tiers.stores[0]
    assert store.writable is False  # type: ignore[attr-defined]
    assert run_round(engine, "third") == expected


class Captured:
    """A KV-event publisher that keeps what it is given."""

    def __init__(self) -> None:
        self.events: list[object] = []

    def publish(self, events: object) -> None:
        self.events.extend(events)  # type: ignore[call-overload]


def test_kv_events_say_which_blocks_the_disk_holds(tmp_path: Path) -> None:
    from atb_mem.events import BlockRemoved, BlockStored
    from atb_mem.events.vllm import encode_batch

    model, _ = model_pair("llama")
    captured = Captured()
    engine = Engine(model, num_blocks=8, block_size=BLOCK_SIZE, max_num_seqs=1,
                    kv_offload={"disk": (str(tmp_path), "16MiB")}, kv_events=captured)
    run_round(engine, "first")
    run_round(engine, "second")
    assert engine.tiers is not None
    engine.tiers.close()  # the writes (and their events) are done
    engine.step()  # publishes what the writers recorded
    on_disk = [event for event in captured.events
               if isinstance(event, BlockStored) and event.medium == "disk"]
    stored = {int(h) for event in on_disk for h in event.block_hashes}
    expected = {int(words[0]) for prompt in PROMPTS
                for words in engine.kv_cache.block_hashes(prompt)[:4]}
    assert stored == expected
    for event in on_disk:  # each carries its block's tokens, as a router expects
        assert len(event.token_ids) == BLOCK_SIZE * len(event.block_hashes)
    assert not any(isinstance(event, BlockRemoved) and event.medium == "disk"
                   for event in captured.events), "16 MiB evicts nothing here"
    assert b"DISK" in encode_batch(on_disk)


def test_a_save_that_fails_costs_the_tier_not_the_requests(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, reference = model_pair("llama")
    engine = disk_engine(model, tmp_path)
    expected = [hf_greedy(reference, tokens, GREEDY.max_tokens) for tokens in PROMPTS]
    assert engine.tiers is not None

    def broken(*_: object) -> None:
        raise RuntimeError("the device copy failed")

    monkeypatch.setattr(engine.tiers, "_save_block", broken)
    assert run_round(engine, "first") == expected
    assert engine.tiers.counters.dropped_saves > 0

"""The disk tier touches only the files it wrote. Its directory may hold other files, and other
engines' tiers: each engine keeps its blocks in a folder named by its model and layout
identity, counts only those against its capacity, and evicts only those. What it cannot use
is a clear error at start-up, and changes nothing:

- an empty path (it would fill the working directory);
- a capacity below one block;
- in its own folder, a dangling ``*.kv`` link or a ``*.part`` directory.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from atb_mem.kv.tiers.store import framed_size
from atb_mem.serving import Engine
from tests.serving.test_engine_disk_tier import BLOCK_SIZE, GREEDY, PROMPTS, run_round
from tests.support.models import hf_greedy, model_pair

# One block of the tiny llama at BLOCK_SIZE: 2,048 bytes of K/V and its frame.
FRAMED_BLOCK = framed_size(2048)


def engine_on(path: Path | str, capacity: str, block_size: int = BLOCK_SIZE) -> Engine:
    model, _ = model_pair("llama")
    return Engine(model, num_blocks=8, block_size=block_size, max_num_seqs=1,
                  kv_offload={"disk": (str(path), capacity)})


def layout_folder(engine: Engine) -> Path:
    assert engine.tiers is not None
    folder: Path = engine.tiers.stores[0].layout_path  # type: ignore[attr-defined]
    return folder


def test_files_the_tier_did_not_write_are_neither_counted_nor_evicted(tmp_path: Path) -> None:
    notes = tmp_path / "notes.kv"
    notes.write_bytes(b"n" * 20_000)  # more than the tier's capacity
    (tmp_path / "draft.part").write_bytes(b"mine")
    engine = engine_on(tmp_path, f"{8 * FRAMED_BLOCK}B")  # 8 of the 16 blocks: it evicts
    run_round(engine, "first")
    run_round(engine, "second")
    assert engine.tiers is not None
    store = engine.tiers.stores[0]
    assert notes.read_bytes() == b"n" * 20_000 and (tmp_path / "draft.part").exists()
    own = list(layout_folder(engine).glob("*.kv"))
    assert len(own) == 8 and store.used_bytes == 8 * FRAMED_BLOCK  # type: ignore[attr-defined]
    assert layout_folder(engine).parent == tmp_path
    engine.shutdown()


def test_engines_of_different_block_sizes_share_a_directory(tmp_path: Path) -> None:
    """Engine B (8-token blocks) fills its own capacity on A's directory: A's blocks stay,
    and A's next round loads every one of them."""
    _, reference = model_pair("llama")
    expected = [hf_greedy(reference, tokens, GREEDY.max_tokens) for tokens in PROMPTS]
    capacity = f"{17 * FRAMED_BLOCK}B"  # A's 16 blocks, or 8 of B's twice as large
    a = engine_on(tmp_path, capacity)
    run_round(a, "first")
    run_round(a, "second")
    b = engine_on(tmp_path, capacity, block_size=2 * BLOCK_SIZE)
    assert run_round(b, "first") == expected and run_round(b, "second") == expected
    assert layout_folder(a) != layout_folder(b) and list(layout_folder(b).glob("*.kv"))
    assert a.tiers is not None
    assert run_round(a, "third") == expected
    assert a.tiers.counters.loaded_blocks == 16 and a.tiers.counters.load_failures == 0
    a.shutdown()
    b.shutdown()


def test_an_empty_path_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="path is empty"):
        engine_on("", "16MiB")
    assert list(tmp_path.iterdir()) == []


def test_a_capacity_below_one_block_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"capacity.*1024 bytes.*{FRAMED_BLOCK} bytes"):
        engine_on(tmp_path, "1KiB")
    assert list(tmp_path.iterdir()) == []
    engine_on(tmp_path, f"{FRAMED_BLOCK}B").shutdown()  # one block is enough


@pytest.mark.parametrize("entry", ["dangling link", "part directory"])
def test_what_the_tier_cannot_use_in_its_folder_is_a_start_up_error(
        tmp_path: Path, entry: str) -> None:
    def plant(folder: Path, name: str) -> None:
        if entry == "dangling link":
            os.symlink(folder / "gone", folder / f"{name}.kv")
        else:
            (folder / f"{name}.part").mkdir()

    plant(tmp_path, "beside")  # not the tier's: left alone
    first = engine_on(tmp_path, "16MiB")
    folder = layout_folder(first)
    first.shutdown()
    plant(folder, "own")
    with pytest.raises(ValueError, match=rf"{re.escape(str(folder))}.*own"):
        engine_on(tmp_path, "16MiB")
    assert os.path.lexists(folder / ("own.kv" if entry == "dangling link" else "own.part"))


def test_a_write_another_engine_has_in_progress_survives_start_up(tmp_path: Path) -> None:
    """Engines of one model share the identity's folder: one starting up removes the partial
    writes that processes no longer running left, never one a live engine is writing."""
    import subprocess
    import sys

    first = engine_on(tmp_path, "16MiB")
    folder = layout_folder(first)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    live = folder / f"block.{os.getpid()}-1.part"
    dead = folder / f"block.{gone}-1.part"
    for partial in (live, dead):
        partial.write_bytes(b"half a block")
    second = engine_on(tmp_path, "16MiB")
    assert live.exists(), "a live engine's write was deleted under it"
    assert not dead.exists(), "a dead process's partial write was left behind"
    first.shutdown()
    second.shutdown()

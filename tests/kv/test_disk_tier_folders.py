"""The disk tier's folder as others change it: files another engine wrote or evicted, a write
that fails (a full disk) and what it leaves, a start on a full disk, a capacity beyond what
the filesystem holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.kv.disk_tier import disk


def test_a_file_another_engine_wrote_in_the_folder_is_read_and_seen(tmp_path: Path) -> None:
    """Two engines of one layout share a folder (or a vLLM scheduler looks up what its
    workers write): a block one wrote is found and read by the other, which never counts it
    as its own."""
    writer, reader = disk(tmp_path, 300), disk(tmp_path, 300)
    key, value = "atb/m/" + "ab" * 16, b"w" * 100
    assert not writer.put(key, value) and writer.put(key, value)
    assert reader.exists([key]) == [False], "not one of the reader's files"
    assert reader.files_exist([key]) == [True]
    assert reader.get(key) == value
    assert reader.used_bytes == 0


def test_a_file_another_engine_evicted_is_written_again_at_its_next_save(
        tmp_path: Path) -> None:
    """Two engines share a folder; one evicts (or someone cleans up) a file the other wrote.
    The writer's own list still names it, but the folder does not: its next save of the block
    writes it again, where it used to be refused for good."""
    writer, other = disk(tmp_path, 300), disk(tmp_path, 300)
    key, value = "atb/m/" + "cd" * 16, b"v" * 100
    assert not writer.put(key, value) and writer.put(key, value)
    assert other.files_exist([key]) == [True]
    assert writer.layout_path is not None
    (writer.layout_path / (key.replace("/", "-") + ".kv")).unlink()  # the other's eviction
    assert other.files_exist([key]) == [False]
    assert writer.put(key, value), "the file is gone: written again"
    assert other.files_exist([key]) == [True] and other.get(key) == value
    assert writer.used_bytes == 100, "counted once"
    assert not writer.put(key, value), "there again: nothing to write"


def test_a_failed_write_leaves_no_partial_file(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC midway: the partial file it left is removed with the failure."""
    import errno

    store = disk(tmp_path, 1 << 20, min_seen=1)
    write_bytes = Path.write_bytes

    def full(self: Path, data: Any) -> int:
        write_bytes(self, data[:10])  # what a full disk leaves: part of the file
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full)
    assert not store.put("atb/m/" + "01" * 16, b"x" * 100)
    assert not store.writable
    assert store.layout_path is not None
    assert list(store.layout_path.iterdir()) == []


def test_a_full_disk_does_not_keep_the_next_start_from_coming_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The folder holds a dead writer's partial file and the disk has no room for even the
    probe: start-up removes the partial, warns, and comes up reading what is there."""
    import errno

    first = disk(tmp_path, 1 << 20, min_seen=1)
    key = "atb/m/" + "02" * 16
    assert first.put(key, b"k" * 100)
    assert first.layout_path is not None
    dead = first.layout_path / f"{'03' * 16}.999999999-1.part"  # no such process
    dead.write_bytes(b"half")
    write_bytes = Path.write_bytes

    def full(self: Path, data: Any) -> int:
        if self.name.endswith(".part") or self.name == ".atb-mem-probe":
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_bytes(self, data)

    monkeypatch.setattr(Path, "write_bytes", full)
    with pytest.warns(UserWarning, match="no space"):
        second = disk(tmp_path, 1 << 20, min_seen=1)
    assert not dead.exists(), "the dead writer's partial was removed first"
    assert second.get(key) == b"k" * 100, "reads go on"
    assert not second.writable and not second.put("atb/m/" + "04" * 16, b"n" * 100)


def test_a_capacity_beyond_the_filesystem_is_cut_to_what_it_can_hold(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """256 MiB asked for on a filesystem with 1 MiB free: a warning at start-up, and the
    tier's bytes stay within the free space (plus what it already holds)."""
    from atb_mem.kv.tiers import disk as disk_module

    monkeypatch.setattr(disk_module, "_free_bytes", lambda path: 1000)
    with pytest.warns(UserWarning, match="free"):
        store = disk(tmp_path, 256 << 20, min_seen=1)
    assert store.capacity_bytes == 1000
    for index in range(15):
        store.put(f"atb/m/{index:032x}", b"f" * 100)
    assert store.used_bytes <= 1000

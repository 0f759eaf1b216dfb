"""The tiers below the host, piece by piece: a block's frame, the disk tier's capacity, its
LRU, its write rule and the files it owns, keys, and the shared store's URL."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atb_mem.kv.tiers import DiskStore, block_key, frame, open_store, parse_mooncake_url, unframe
from atb_mem.kv.tiers.store import key_hash
from tests.kv.disk_tier import disk


def test_a_frame_detects_truncation_corruption_and_the_wrong_length() -> None:
    payload = bytes(range(256)) * 4
    value = frame(payload)
    assert unframe(value, len(payload)) == payload
    assert unframe(value[:-1], len(payload)) is None
    assert unframe(value, len(payload) + 1) is None
    corrupt = value[:100] + bytes([value[100] ^ 1]) + value[101:]
    assert unframe(corrupt, len(payload)) is None
    assert unframe(corrupt, len(payload), checksum=False) is not None  # what the check buys
    assert unframe(None, 4) is None and unframe(b"short", 4) is None
    keyed = frame(payload, key="atb/m/01")
    assert unframe(keyed, len(payload), key="atb/m/01") == payload
    assert unframe(keyed, len(payload), key="atb/m/02") is None, "another key's block"
    assert unframe(keyed, len(payload)) is None and unframe(value, len(payload), key="k") is None


def test_keys_name_the_chain_hash_and_give_it_back() -> None:
    words = np.array([0xDEADBEEF, 2**64 - 1], dtype=np.uint64)
    key = block_key("model", words)
    assert key.startswith("atb/model/") and key_hash(key) == (0xDEADBEEF, 2**64 - 1)
    assert key_hash(key.replace("/", "-")) == (0xDEADBEEF, 2**64 - 1)  # as a file name
    assert block_key("other", words) != key


def test_the_disk_tier_writes_on_the_second_sighting_and_evicts_the_oldest(
        tmp_path: Path) -> None:
    store = disk(tmp_path, capacity_bytes=3 * 100)
    values = {f"atb/m/{index:032x}": bytes([index]) * 100 for index in range(4)}
    keys = list(values)
    assert not store.put(keys[0], values[keys[0]]), "seen once: not written"
    assert store.exists(keys[:1]) == [False]
    for key in keys[:3]:
        store.put(key, values[key])
        store.put(key, values[key])
    assert store.exists(keys) == [True, True, True, False]
    assert store.get(keys[0]) == values[keys[0]]  # now the most recently used
    store.put(keys[3], values[keys[3]])
    store.put(keys[3], values[keys[3]])
    assert store.exists(keys) == [True, False, True, True]
    assert [key_hash(old) for old in store.take_evicted()] == [key_hash(keys[1])]
    assert store.used_bytes == 300
    # A later run finds what this one left.
    assert disk(tmp_path, capacity_bytes=300).exists(keys) == [True, False, True, True]


def test_bad_disk_tier_settings_are_clear_errors(tmp_path: Path) -> None:
    for capacity in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="capacity"):
            DiskStore(tmp_path, capacity)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_seen"):
        DiskStore(tmp_path, 100, min_seen=0)
    for empty in ("", " "):
        with pytest.raises(ValueError, match="path is empty"):
            DiskStore(empty, 100)
    with pytest.raises(TypeError, match="path"):
        DiskStore(None, 100)  # type: ignore[arg-type]
    # A capacity that holds no value is refused before anything is created.
    with pytest.raises(ValueError, match=r"capacity .* of 99 bytes holds no block of 100 bytes"):
        disk(tmp_path / "tier", 99, value_bytes=100)
    assert not (tmp_path / "tier").exists()


def test_the_disk_tier_counts_and_evicts_only_the_files_of_its_layout(tmp_path: Path) -> None:
    notes = tmp_path / "notes.kv"
    notes.write_bytes(b"n" * 1000)
    (tmp_path / "draft.part").write_bytes(b"d")
    other = disk(tmp_path, 300, layout="n")
    for _ in range(2):
        other.put("atb/n/" + "0" * 32, b"o" * 100)
    store = disk(tmp_path, 300)
    assert store.used_bytes == 0 and store.layout_path == tmp_path / "m"
    for index in range(5):  # evicts two of its own
        for _ in range(2):
            store.put(f"atb/m/{index:032x}", bytes([index]) * 100)
    assert store.used_bytes == 300 and len(list((tmp_path / "m").glob("*.kv"))) == 3
    assert notes.read_bytes() == b"n" * 1000 and (tmp_path / "draft.part").exists()
    assert other.exists(["atb/n/" + "0" * 32]) == [True] and other.used_bytes == 100
    # An identity that cannot name a folder as it is names it by its digest.
    assert disk(tmp_path, 300, layout="org/model@rev").layout_path.parent == tmp_path


def test_a_lost_file_is_forgotten_and_its_next_save_writes_it(tmp_path: Path) -> None:
    store = disk(tmp_path, 300)
    key, value = "atb/m/" + "ef" * 16, b"z" * 100
    store.put(key, value)
    assert store.put(key, value), "seen twice: written"
    assert store.layout_path is not None
    (store.layout_path / (key.replace("/", "-") + ".kv")).unlink()
    assert store.exists([key]) == [True], "nothing looked yet"
    assert store.get(key) is None
    assert store.exists([key]) == [False] and store.used_bytes == 0
    assert [key_hash(old) for old in store.take_evicted()] == [key_hash(key)]
    assert store.put(key, value), "written again at its next save"
    assert store.get(key) == value


def test_store_urls() -> None:
    settings = parse_mooncake_url("mooncake://10.0.0.5:50051?segment=1GiB")
    assert settings["master"] == "10.0.0.5:50051"
    assert settings["metadata"] == "http://10.0.0.5:8080/metadata"
    assert settings["segment"] == 1 << 30
    for bad in ("mooncake://host", "redis://host:1", "mooncake://:1",
                "mooncake://h:1?colour=blue"):
        with pytest.raises(ValueError):
            parse_mooncake_url(bad)
    with pytest.raises(ValueError, match="scheme"):
        open_store("lmcache://host:1")
    with pytest.raises(TypeError):
        open_store(None)  # type: ignore[arg-type]


def test_tier_events_are_recorded_in_order_and_checked() -> None:
    import atb_mem

    kv = atb_mem.KVCachePool(8, 2, device=None, enable_kv_events=True)
    hashes = kv.block_hashes([1, 2, 3, 4]).tolist()
    for bad in (("device", True, hashes, None, [1, 2, 3, 4]),
                ("tape", True, hashes, None, [1, 2, 3, 4]),
                ("disk", True, hashes, None, [1, 2, 3]),
                ("disk", False, hashes, None, [1])):
        with pytest.raises(ValueError):
            kv._record_tier_event(*bad)  # type: ignore[arg-type]
    assert len(kv.take_events()) == 0, "a refused call records nothing"
    kv._record_tier_event("disk", True, hashes, None, [1, 2, 3, 4])
    kv._record_tier_event("store", False, hashes[:1], None, [])
    stored, removed = kv.take_events()
    assert (stored.medium, removed.medium) == ("disk", "store")
    assert stored.block_hashes.tolist() == [words[0] for words in hashes]
    assert stored.token_ids.tolist() == [1, 2, 3, 4] and stored.parent_block_hash is None
    assert removed.event_id == stored.event_id + 1


def test_concurrent_saves_of_one_key_write_it_once(tmp_path: Path) -> None:
    """Requests that share a prompt save its blocks at once: one file per key, its bytes
    counted once, and the tier still writable."""
    import threading

    store = disk(tmp_path, capacity_bytes=1 << 20, value_bytes=4096, min_seen=1)
    key, value = "atb/m/" + "ab" * 16, b"x" * 4096
    start = threading.Barrier(8)

    def save() -> None:
        start.wait()
        for _ in range(20):
            store.put(key, value)

    threads = [threading.Thread(target=save) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert store.writable and store.exists([key]) == [True]
    assert store.used_bytes == len(value) == sum(f.stat().st_size
                                                 for f in (tmp_path / "m").iterdir())


def test_a_damaged_file_is_dropped_and_written_anew(tmp_path: Path) -> None:
    store = disk(tmp_path, capacity_bytes=1 << 20, value_bytes=80, min_seen=1)
    key, value = "atb/m/" + "cd" * 16, frame(b"y" * 64)
    assert store.put(key, value)
    path = next((tmp_path / "m").glob("*.kv"))
    path.write_bytes(value[:10])
    assert unframe(store.get(key), 64) is None
    store.discard(key)
    assert store.exists([key]) == [False] and store.used_bytes == 0
    assert store.put(key, value) and unframe(store.get(key), 64) == b"y" * 64


def test_a_host_prefix_cache_needs_a_host_tier_and_prefix_caching() -> None:
    import atb_mem

    with pytest.raises(ValueError, match="needs a host tier"):
        atb_mem.KVCachePool(8, 4, device=None, host_prefix_cache=True)
    with pytest.raises(ValueError, match="needs prefix caching"):
        atb_mem.KVCachePool(8, 4, device=None, num_host_blocks=4, host_prefix_cache=True,
                            enable_prefix_caching=False)
    kv = atb_mem.KVCachePool(8, 4, device=None, num_host_blocks=4, host_prefix_cache=True)
    assert kv.host_prefix_cache and kv.stats()["host_blocks_cached"] == 0


def test_waiting_for_saves_ends_once_the_writer_has_written_them(tmp_path: Path) -> None:
    """Saves land on the writer's thread; ``wait_for_saves`` says whether they all did in
    time (a store held up keeps it waiting, and it gives up after its timeout)."""
    import threading

    from atb_mem import KVCachePool
    from atb_mem.kv.tiers import TierConnector

    release = threading.Event()

    class HeldUpDisk(DiskStore):
        def put(self, key: str, value: bytes) -> bool:
            release.wait(30)
            return super().put(key, value)

    kv = KVCachePool(8, 4, num_layers=1, num_kv_heads=1, head_dim=4)
    connector = TierConnector(kv, [HeldUpDisk(tmp_path, 1 << 20, min_seen=1)], "model")
    try:
        assert connector.wait_for_saves(0)  # nothing pending
        for bad in (-1, float("nan"), float("inf"), None, "1"):
            with pytest.raises(ValueError, match="timeout_s"):
                connector.wait_for_saves(bad)  # type: ignore[arg-type]
        connector._save_block(1, "model/00ff", ([0, 255], None, [1, 2, 3, 4]))
        assert not connector.wait_for_saves(0.05)
        release.set()
        assert connector.wait_for_saves(30)
        assert connector.counters.saved_blocks == 1
    finally:
        release.set()
        connector.close()


def test_a_store_whose_write_raises_does_not_keep_the_block_from_the_others(
        tmp_path: Path) -> None:
    from atb_mem import KVCachePool
    from atb_mem.kv.tiers import TierConnector

    class RaisingDisk(DiskStore):
        def put(self, key: str, value: bytes) -> bool:
            raise OSError("the device went away")

    kv = KVCachePool(8, 4, num_layers=1, num_kv_heads=1, head_dim=4)
    failing = RaisingDisk(tmp_path / "a", 1 << 20, min_seen=1)
    working = DiskStore(tmp_path / "b", 1 << 20, min_seen=1)
    connector = TierConnector(kv, [failing, working], "model")
    try:
        connector._save_block(1, "model/00ff", ([0, 255], None, [1, 2, 3, 4]))
        assert connector.wait_for_saves(30)
        counters = connector.counters
        assert counters.saved_by_tier == {working.name: 1} and counters.saved_blocks == 1
        assert counters.store_errors == 1 and counters.raised_puts == 1
        assert working.exists(["model/00ff"]) == [True]
    finally:
        connector.close()


def test_a_partial_write_removed_under_the_tier_costs_the_block_not_the_tier(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another engine's start-up that cannot tell a write is live (another PID namespace)
    removes it: that save is lost, and the tier goes on taking blocks."""
    store = DiskStore(tmp_path, 1 << 20, min_seen=1)
    store.register_layout("model", len(frame(b"x" * 64)))
    replace = Path.replace

    def removed_first(self: Path, target: Any) -> Any:
        if self.name.endswith(".part") and "00aa" in self.name:
            self.unlink()
        return replace(self, target)

    monkeypatch.setattr(Path, "replace", removed_first)
    assert not store.put("atb/model/" + "00aa" * 8, frame(b"x" * 64))
    assert store.writable and store.exists(["atb/model/" + "00aa" * 8]) == [False]
    assert store.put("atb/model/" + "00bb" * 8, frame(b"y" * 64))
    assert store.exists(["atb/model/" + "00bb" * 8]) == [True]


def test_evictions_nobody_reads_are_not_kept_for_ever(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from atb_mem.kv.tiers import disk

    monkeypatch.setattr(disk, "_MAX_TRACKED", 8)
    value = frame(b"z" * 64)
    store = DiskStore(tmp_path, len(value), min_seen=1)  # room for one block: each evicts
    store.register_layout("model", len(value))
    for index in range(disk._MAX_TRACKED + 10):
        assert store.put(f"atb/model/{index:032x}", value)
    assert len(store.take_evicted()) == disk._MAX_TRACKED


def test_a_path_under_home_is_read_as_a_shell_reads_it(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert DiskStore("~/kv", 1 << 20).path == tmp_path / "kv"


def test_tier_hits_count_in_the_cache_stats_and_bad_ones_change_nothing() -> None:
    """What the engine's tier connector reports when a disk or store load landed: hits in
    ``stats()``, with their tier; a medium or reason it cannot be is refused, changing
    nothing."""
    from atb_mem import KVCachePool

    pool = KVCachePool(16, 4)
    pool.alloc_sequence(1, list(range(13)))
    before = pool.stats()
    for bad in ({"medium": "host", "blocks": 1}, {"medium": "tape", "blocks": 1},
                {"medium": "disk", "blocks": 1, "filled": "bogus"},
                {"medium": "disk", "blocks": -1}):
        with pytest.raises((ValueError, OverflowError, TypeError)):
            pool._record_tier_hits(**bad)  # type: ignore[arg-type]
        assert pool.stats() == before
    pool._record_tier_hits("store", 3, "not_cached")
    after = pool.stats()
    assert after["prefix_cache_hits"] == before["prefix_cache_hits"] + 3
    assert after["prefix_cache_store_hit_tokens"] == after["prefix_cache_hit_tokens"] == 12
    assert after["prefix_cache_misses_not_cached"] == before["prefix_cache_misses_not_cached"] - 1

"""``kv_connector_extra_config``: each key read as documented, each bad value refused with an
error that names the key, and the sizes the connector derives from it."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest

from atb_mem.integrations.vllm.settings import (
    DEFAULT_HOST_BYTES,
    EXTRA_CONFIG_KEYS,
    ConnectorSettings,
)


def test_no_config_is_the_defaults() -> None:
    for extra in (None, {}):
        settings = ConnectorSettings.parse(extra)
        assert settings == ConnectorSettings()
        assert settings.host_bytes == DEFAULT_HOST_BYTES == 4 << 30
        assert settings.disk_path is None and settings.disk_bytes == 0
        assert settings.store_url is None and settings.hash_block_size is None
        assert settings.eviction_policy == "priority" and settings.kv_identity is None
        assert settings.load_timeout_s == 30.0 and settings.disk_min_seen == 2


def test_every_key_is_read(tmp_path: Path) -> None:
    settings = ConnectorSettings.parse({
        "host": "8GiB", "disk": [str(tmp_path), "100MB"], "store": "mooncake://h:50051",
        "hash_block_size": 32, "eviction_policy": "lfu", "kv_identity": "org/model@rev",
        "load_timeout_s": 5, "disk_min_seen": 1, "disk_sync_load": "1MiB"})
    assert settings == ConnectorSettings(
        host_bytes=8 << 30, disk_path=str(tmp_path), disk_bytes=100 * 1000**2,
        store_url="mooncake://h:50051", hash_block_size=32, eviction_policy="lfu",
        kv_identity="org/model@rev", load_timeout_s=5.0, disk_min_seen=1,
        disk_sync_load_bytes=1 << 20)
    assert isinstance(settings.load_timeout_s, float)
    assert set(EXTRA_CONFIG_KEYS) == {"host", "disk", "store", "hash_block_size",
                                      "eviction_policy", "kv_identity", "load_timeout_s",
                                      "disk_min_seen", "disk_sync_load"}


@pytest.mark.parametrize("value, expected", [
    ("8GiB", 8 << 30), ("14GB", 14 * 1000**3), (1048576, 1048576), (0, 0), ("512M", 512 << 20)])
def test_host_sizes(value: Any, expected: int) -> None:
    assert ConnectorSettings.parse({"host": value}).host_bytes == expected


@pytest.mark.parametrize("policy", ["lru", "lfu", "slru", "priority"])
def test_every_eviction_policy(policy: str) -> None:
    assert ConnectorSettings.parse({"eviction_policy": policy}).eviction_policy == policy


def test_the_disk_path_reads_a_tilde_and_a_tuple() -> None:
    settings = ConnectorSettings.parse({"disk": ("~/kv-cache", 4096)})
    assert settings.disk_path == os.path.join(os.path.expanduser("~"), "kv-cache")
    assert settings.disk_bytes == 4096


@pytest.mark.parametrize("key, value", [
    ("host", "lots"), ("host", -1), ("host", True), ("host", 1.5), ("host", None),
    ("host", ["8GiB"]),
    ("disk", "/var/cache/kv"), ("disk", ["/var/cache/kv"]), ("disk", ["/a", "1GiB", "x"]),
    ("disk", {"path": "/a"}), ("disk", ["", "1GiB"]), ("disk", ["   ", "1GiB"]),
    ("disk", [3, "1GiB"]), ("disk", [None, "1GiB"]), ("disk", ["/a", 0]),
    ("disk", ["/a", "0GiB"]), ("disk", ["/a", "big"]), ("disk", ["/a", -5]),
    ("store", "redis://h:1"), ("store", "mooncake:/h:1"), ("store", 5), ("store", None),
    ("hash_block_size", 0), ("hash_block_size", -16), ("hash_block_size", True),
    ("hash_block_size", "16"), ("hash_block_size", 16.0), ("hash_block_size", None),
    ("eviction_policy", "fifo"), ("eviction_policy", "LRU"), ("eviction_policy", None),
    ("kv_identity", ""), ("kv_identity", "  "), ("kv_identity", 3), ("kv_identity", None),
    ("load_timeout_s", 0), ("load_timeout_s", -1.0), ("load_timeout_s", math.inf),
    ("load_timeout_s", math.nan), ("load_timeout_s", True), ("load_timeout_s", "5"),
    ("load_timeout_s", None),
    ("disk_min_seen", 0), ("disk_min_seen", True), ("disk_min_seen", 2.0),
    ("disk_min_seen", "2"),
    ("disk_sync_load", -1), ("disk_sync_load", "lots"), ("disk_sync_load", None),
    ("disk_sync_load", True),
])
def test_a_bad_value_names_its_key(key: str, value: Any) -> None:
    with pytest.raises(ValueError) as raised:
        ConnectorSettings.parse({key: value})
    assert str(raised.value).startswith(f"kv_connector_extra_config[{key!r}]: "), raised.value


def test_the_first_bad_key_is_named_and_good_ones_do_not_hide_it() -> None:
    with pytest.raises(ValueError, match=r"\['load_timeout_s'\]"):
        ConnectorSettings.parse({"host": "1GiB", "load_timeout_s": 0, "disk_min_seen": 3})


def test_an_unknown_key_is_named_with_the_known_ones() -> None:
    with pytest.raises(ValueError) as raised:
        ConnectorSettings.parse({"host": "1GiB", "hots": "2GiB"})
    message = str(raised.value)
    assert "unknown key 'hots'" in message
    assert all(key in message for key in EXTRA_CONFIG_KEYS)
    with pytest.raises(ValueError, match="unknown key 'a'"):
        ConnectorSettings.parse({"b": 1, "a": 2})  # the first in order
    with pytest.raises(ValueError, match="unknown key 3"):
        ConnectorSettings.parse({3: 1})


@pytest.mark.parametrize("extra", [["host", "8GiB"], "host=8GiB", 5])
def test_the_config_must_be_a_dict(extra: Any) -> None:
    with pytest.raises(ValueError, match="kv_connector_extra_config must be a dict"):
        ConnectorSettings.parse(extra)


@pytest.mark.parametrize("block_size, expected", [(128, 16), (16, 16), (32, 16), (8, 8),
                                                  (24, 24), (1, 1)])
def test_the_default_hash_block_size(block_size: int, expected: int) -> None:
    assert ConnectorSettings().hash_block_size_for(block_size) == expected


def test_a_set_hash_block_size_must_divide_the_block_size() -> None:
    settings = ConnectorSettings.parse({"hash_block_size": 32})
    assert settings.hash_block_size_for(128) == 32
    assert settings.hash_block_size_for(32) == 32
    for block_size in (16, 48, 100):
        with pytest.raises(ValueError, match=r"\['hash_block_size'\].*block size "
                                             rf"{block_size}, got 32"):
            settings.hash_block_size_for(block_size)
    assert ConnectorSettings.parse({"hash_block_size": 1}).hash_block_size_for(7) == 1


def test_host_blocks() -> None:
    assert ConnectorSettings.parse({"host": 0}).num_host_blocks(1 << 20) == 0
    assert ConnectorSettings.parse({"host": "1GiB"}).num_host_blocks(1 << 20) == 1024
    assert ConnectorSettings.parse({"host": (1 << 20) * 3 - 1}).num_host_blocks(1 << 20) == 2
    assert ConnectorSettings.parse({"host": 1 << 20}).num_host_blocks(1 << 20) == 1
    with pytest.raises(ValueError, match=r"\['host'\].*hold no block of 1048576 bytes"):
        ConnectorSettings.parse({"host": (1 << 20) - 1}).num_host_blocks(1 << 20)


def test_more_host_memory_than_the_machine_has_is_refused() -> None:
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert ConnectorSettings.parse({"host": physical}).num_host_blocks(physical) == 1
    with pytest.raises(ValueError, match=r"\['host'\].*more than this machine's memory"):
        ConnectorSettings.parse({"host": physical + 1}).num_host_blocks(1)


@pytest.mark.parametrize("url", [
    "mooncake://h", "mooncake://h:99999", "mooncake://h:abc", "mooncake://h:0",
    "mooncake://:50051", "mooncake://h:50051?segmnet=1GiB", "mooncake://h:50051?buffer=lots"])
def test_a_bad_store_url_names_the_store_key(url: str) -> None:
    """Checked at parse, before anything connects: the port, the options and their sizes."""
    with pytest.raises(ValueError) as raised:
        ConnectorSettings.parse({"store": url})
    message = str(raised.value)
    assert message.startswith("kv_connector_extra_config['store']: "), message
    assert "kv_store" not in message


def test_a_disk_path_that_is_a_file_names_the_disk_key(tmp_path: Path) -> None:
    file = tmp_path / "not-a-folder"
    file.write_text("x")
    with pytest.raises(ValueError, match=r"^kv_connector_extra_config\['disk'\]: .*not a "
                                         r"directory"):
        ConnectorSettings.parse({"disk": [str(file), "1GiB"]})
    with pytest.raises(ValueError, match=r"^kv_connector_extra_config\['disk'\]: .*not a "
                                         r"directory"):
        ConnectorSettings.parse({"disk": [str(file / "under"), "1GiB"]})


def test_a_disk_capacity_below_one_block_per_rank_names_the_disk_key() -> None:
    settings = ConnectorSettings.parse({"disk": ["/tmp/kv", 3 << 20]})
    assert settings.disk_bytes_per_rank(1 << 20, ranks=2) == 3 << 19
    with pytest.raises(ValueError, match=r"^kv_connector_extra_config\['disk'\]: .*no block "
                                         r"of 2097152 bytes"):
        settings.disk_bytes_per_rank(2 << 20, ranks=2)

"""``kv_connector_extra_config`` of ``AtbMemConnector``: every key optional, each value
checked at vLLM's start-up with an error that names the key.

=================== =============================================================== ========
key                 what it is                                                      default
=================== =============================================================== ========
``host``            bytes of host memory for the host tier, per worker (``"8GiB"``) 4GiB
``disk``            ``[path, size]``: the disk tier's directory and capacity         none
``store``           ``"mooncake://HOST:PORT[?...]"``: a store shared across servers none
``hash_block_size`` tokens per prefix key (divides vLLM's block size): hits are     16
                    served in steps of this many tokens, not only whole blocks
``eviction_policy`` the host tier's ``lru``, ``lfu``, ``slru`` or ``priority``      priority
``kv_identity``     a name for the weights (``"org/model@rev"``); by default the     digest
                    checkpoint's files are digested
``load_timeout_s``  seconds a disk or store load may take before it is recomputed   30
``disk_min_seen``   sightings of a block before the disk tier writes it             2
``disk_sync_load``  bytes of disk blocks a request loads before the forward that    32MiB
                    reads them (no step spent waiting); larger loads, and every
                    store load, run asynchronously (0: every disk load too)
=================== =============================================================== ========
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from atb_mem._core import EVICTION_POLICIES
from atb_mem._sizes import parse_size
from atb_mem.kv.tiers.mooncake import parse_mooncake_url

__all__ = ["DEFAULT_HOST_BYTES", "EXTRA_CONFIG_KEYS", "ConnectorSettings"]

DEFAULT_HOST_BYTES = 4 << 30
EXTRA_CONFIG_KEYS = ("host", "disk", "store", "hash_block_size", "eviction_policy",
                     "kv_identity", "load_timeout_s", "disk_min_seen", "disk_sync_load")
DEFAULT_DISK_SYNC_LOAD = 32 << 20


def _fail(key: str, message: str) -> ValueError:
    return ValueError(f"kv_connector_extra_config[{key!r}]: {message}")


def _size(key: str, value: Any) -> int:
    try:
        return parse_size(value)
    except (TypeError, ValueError) as error:
        raise _fail(key, str(error)) from None


def _file_in_the_way(path: Path) -> Path | None:
    """``path`` or the nearest of its parents that exists, where that is no directory."""
    for at in (path, *path.parents):
        if at.exists():
            return None if at.is_dir() else at
    return None


def _int(key: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _fail(key, f"must be an int >= {low}, got {value!r}")
    return value


@dataclass(frozen=True)
class ConnectorSettings:
    """The checked ``kv_connector_extra_config``."""

    host_bytes: int = DEFAULT_HOST_BYTES
    disk_path: str | None = None
    disk_bytes: int = 0
    store_url: str | None = None
    hash_block_size: int | None = None
    """None: 16 where it divides the block size, else the block size."""
    eviction_policy: str = "priority"
    kv_identity: str | None = None
    load_timeout_s: float = 30.0
    disk_min_seen: int = 2
    disk_sync_load_bytes: int = DEFAULT_DISK_SYNC_LOAD

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """Checks every key; raises ValueError (naming the key) at the first bad one."""
        extra = {} if extra is None else extra
        if not isinstance(extra, Mapping):
            raise ValueError(f"kv_connector_extra_config must be a dict, got "
                             f"{type(extra).__name__}")
        unknown = sorted(set(extra) - set(EXTRA_CONFIG_KEYS), key=str)
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown key {unknown[0]!r}; "
                             f"AtbMemConnector knows {', '.join(EXTRA_CONFIG_KEYS)}")
        values: dict[str, Any] = {}
        if "host" in extra:
            values["host_bytes"] = _size("host", extra["host"])
        if "disk" in extra:
            disk = extra["disk"]
            if not isinstance(disk, (list, tuple)) or len(disk) != 2:
                raise _fail("disk", f"must be [path, size], got {disk!r}")
            path, size = disk
            if not isinstance(path, str) or not path.strip():
                raise _fail("disk", f"the path must be a non-empty str, got {path!r}")
            values["disk_path"] = os.path.expanduser(path)
            blocked = _file_in_the_way(Path(values["disk_path"]))
            if blocked is not None:
                raise _fail("disk", f"{str(blocked)!r} is a file, not a directory")
            values["disk_bytes"] = _size("disk", size)
            if values["disk_bytes"] < 1:
                raise _fail("disk", "the capacity must be at least one byte")
        if "store" in extra:
            store = extra["store"]
            if not isinstance(store, str) or not store.startswith("mooncake://"):
                raise _fail("store", f"must be a mooncake://HOST:PORT URL, got {store!r}")
            try:
                parse_mooncake_url(store)
            except ValueError as error:
                raise _fail("store", str(error)) from None
            values["store_url"] = store
        if "hash_block_size" in extra:
            values["hash_block_size"] = _int("hash_block_size", extra["hash_block_size"], 1)
        if "eviction_policy" in extra:
            policy = extra["eviction_policy"]
            if policy not in EVICTION_POLICIES:
                names = ", ".join(EVICTION_POLICIES)
                raise _fail("eviction_policy", f"must be one of {names}, got {policy!r}")
            values["eviction_policy"] = policy
        if "kv_identity" in extra:
            identity = extra["kv_identity"]
            if not isinstance(identity, str) or not identity.strip():
                raise _fail("kv_identity", f"must be a non-empty str, got {identity!r}")
            values["kv_identity"] = identity
        if "load_timeout_s" in extra:
            timeout = extra["load_timeout_s"]
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
                    or not 0 < timeout < math.inf:
                raise _fail("load_timeout_s", f"must be a finite number of seconds > 0, got "
                                              f"{timeout!r}")
            values["load_timeout_s"] = float(timeout)
        if "disk_min_seen" in extra:
            values["disk_min_seen"] = _int("disk_min_seen", extra["disk_min_seen"], 1)
        if "disk_sync_load" in extra:
            values["disk_sync_load_bytes"] = _size("disk_sync_load", extra["disk_sync_load"])
        return cls(**values)

    def hash_block_size_for(self, block_size: int) -> int:
        """The prefix key's tokens at vLLM's ``block_size``."""
        if self.hash_block_size is None:
            return 16 if block_size % 16 == 0 else block_size
        if block_size % self.hash_block_size:
            raise _fail("hash_block_size", f"must divide vLLM's block size {block_size}, got "
                                           f"{self.hash_block_size}")
        return self.hash_block_size

    def disk_bytes_per_rank(self, block_bytes: int, ranks: int) -> int:
        """Each worker rank's share of the disk tier's capacity, which must hold a block of
        ``block_bytes`` (its shard of a vLLM block)."""
        share = self.disk_bytes // ranks
        if share < block_bytes:
            raise _fail("disk", f"{self.disk_bytes} bytes ({share} per rank of {ranks}) hold "
                                f"no block of {block_bytes} bytes")
        return share

    def num_host_blocks(self, block_bytes: int) -> int:
        """Host blocks of ``block_bytes`` the host tier holds (0: no host tier); refuses more
        than the machine has."""
        if self.host_bytes == 0:
            return 0
        from atb_mem.kv.cache_pool import device_memory

        if self.host_bytes > device_memory("host")[1]:
            raise _fail("host", f"{self.host_bytes} bytes is more than this machine's memory")
        blocks = self.host_bytes // block_bytes
        if blocks < 1:
            raise _fail("host", f"{self.host_bytes} bytes hold no block of {block_bytes} "
                                f"bytes (set 0 for no host tier)")
        return blocks

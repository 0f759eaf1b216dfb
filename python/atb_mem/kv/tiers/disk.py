"""The disk tier: framed block values as files under one directory, with a capacity in bytes
and least-recently-used eviction. It needs no server. Only blocks seen at least
``min_seen`` times are written (KVBM's rule), so one-off prompts do not wear the disk.

A directory that cannot be created or written is an error at start-up. A write that fails at
run time (the disk is full, or went read-only) stops writing with one warning; reads go on.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

__all__ = ["DiskStore"]

log = logging.getLogger("atb_mem.tiers")

# Keys whose sightings are counted before the counts are forgotten.
_MAX_TRACKED = 1 << 16


class DiskStore:
    """``KVStore`` over the files of ``path`` (created if need be), at most
    ``capacity_bytes`` of them. Files left by an earlier run are kept, oldest first."""

    name = "DISK"
    medium = "disk"

    def __init__(self, path: str | os.PathLike[str], capacity_bytes: int, *,
                 min_seen: int = 2) -> None:
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) \
                or capacity_bytes < 1:
            raise ValueError(f"the disk tier's capacity must be a positive number of bytes, "
                             f"got {capacity_bytes!r}")
        if isinstance(min_seen, bool) or not isinstance(min_seen, int) or min_seen < 1:
            raise ValueError(f"min_seen must be a positive int, got {min_seen!r}")
        self.path = Path(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / ".atb-mem-probe"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as error:
            raise ValueError(f"the disk tier's directory {str(self.path)!r} is not writable: "
                             f"{error.strerror or error}") from None
        self.capacity_bytes = capacity_bytes
        self.min_seen = min_seen
        self.writable = True
        self.errors = 0
        self._lock = threading.Lock()
        self._files: OrderedDict[str, int] = OrderedDict()  # key -> size, least recent first
        self._seen: dict[str, int] = {}
        self._evicted: list[str] = []  # keys evicted since take_evicted
        self._writing: set[str] = set()  # keys whose file is being written
        self._bytes = 0
        for partial in self.path.glob("*.part"):  # a write an earlier run did not finish
            partial.unlink(missing_ok=True)
        for file in sorted(self.path.glob("*.kv"), key=lambda file: file.stat().st_mtime):
            self._files[file.stem] = file.stat().st_size
            self._bytes += file.stat().st_size

    def _file(self, key: str) -> Path:
        return self.path / (key.replace("/", "-") + ".kv")

    def exists(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [key.replace("/", "-") in self._files for key in keys]

    def get(self, key: str) -> bytes | None:
        name = key.replace("/", "-")
        with self._lock:
            if name not in self._files:
                return None
            self._files.move_to_end(name)
        try:
            return self._file(key).read_bytes()
        except OSError:
            return None

    def put(self, key: str, value: bytes) -> bool:
        name = key.replace("/", "-")
        with self._lock:
            if len(self._seen) > _MAX_TRACKED:
                self._seen.clear()  # forget counts rather than grow without bound
            seen = self._seen.get(name, 0) + 1
            self._seen[name] = seen
            if not self.writable or name in self._files or name in self._writing \
                    or seen < self.min_seen or len(value) > self.capacity_bytes:
                return False
            while self._files and self._bytes + len(value) > self.capacity_bytes:
                old, size = self._files.popitem(last=False)
                self._bytes -= size
                self._file(old).unlink(missing_ok=True)
                self._evicted.append(old)
            # Reserved before the write, which runs unlocked: one writer per key, and the
            # bytes counted once.
            self._writing.add(name)
            self._bytes += len(value)
        try:
            partial = self._file(key).with_name(f"{name}.{threading.get_ident()}.part")
            partial.write_bytes(value)
            partial.replace(self._file(key))  # readers never see half a file
        except OSError as error:
            with self._lock:
                self._writing.discard(name)
                self._bytes -= len(value)
                self.writable = False
                self.errors += 1
            log.warning("atb-mem: the disk tier stops taking blocks: writing %s failed: %s",
                        self.path, error.strerror or error)
            return False
        with self._lock:
            self._writing.discard(name)
            self._files[name] = len(value)
            self._seen.pop(name, None)
        return True

    def discard(self, key: str) -> None:
        """Drops a block whose file turned out damaged, so a later save writes it anew."""
        name = key.replace("/", "-")
        with self._lock:
            size = self._files.pop(name, None)
            if size is None:
                return
            self._bytes -= size
            self._evicted.append(name)
        self._file(key).unlink(missing_ok=True)

    def take_evicted(self) -> list[str]:
        """The keys (as file names) evicted since the last call."""
        with self._lock:
            evicted, self._evicted = self._evicted, []
        return evicted

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def close(self) -> None:
        pass

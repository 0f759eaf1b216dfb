"""The disk tier: framed block values as files under one directory, with a capacity in bytes
and least-recently-used eviction. It needs no server. Only blocks seen at least
``min_seen`` times are written (KVBM's rule), so one-off prompts do not wear the disk.

The tier touches only files it wrote: they live in a folder of the directory named by the
identity of the model and the layout (``register_layout``), and only that folder's ``*.kv``
files are counted against the capacity and evicted. So the directory may hold other files,
and engines of other models or layouts, each with its own folder and its own capacity.

A path that is empty, a directory that cannot be created or written, a capacity below one
block, or, in the tier's folder, a ``*.kv`` link to nothing or a ``*.part`` directory is an
error at start-up. A full disk is not: the tier warns and starts reading what the folder
holds, writing nothing; and a capacity beyond what the filesystem has free (plus what the
folder already holds) is cut to that, with a warning. A write that fails at run time (the disk
is full, or went read-only) removes its partial file and stops writing with one warning; reads
go on. A file that cannot be read (deleted or replaced under the engine) is forgotten: that
load fails, and the next save of the block writes it anew.

Engines of one model on one machine may share the folder: a write goes to a ``*.part`` file
named by its process, and one starting up removes only those of processes no longer running
(before it probes whether it can write: a full disk's leftovers must not keep it from
starting). Each engine counts and evicts the files it wrote; one whose file another evicted
(or a clean-up removed) finds it gone at its next save of the block, and writes it again.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import stat
import threading
import warnings
from collections import OrderedDict, deque
from collections.abc import Sequence
from pathlib import Path

__all__ = ["DiskStore"]

log = logging.getLogger("atb_mem.tiers")

# Keys whose sightings are counted before the counts are forgotten.
_MAX_TRACKED = 1 << 16

# An identity that can name the layout's folder as it is; any other is named by its digest.
_PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")


def _name(key: str) -> str:
    return key.replace("/", "-")


# What a write fails with when the filesystem, or the user's quota on it, is full.
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def _free_bytes(path: Path) -> int:
    """Bytes the filesystem holding ``path`` has free for this user (unknown: unlimited)."""
    try:
        status = os.statvfs(path)
    except OSError:
        return 1 << 62
    return status.f_bavail * status.f_frsize


def _writer_alive(part_name: str) -> bool:
    """Whether the process that writes ``NAME.PID-THREAD.part`` still runs. A name without
    a pid is an older version's. A pid means something on this machine only: engines on
    several hosts should not share one folder."""
    match = re.fullmatch(r".*\.(\d+)-\d+\.part", part_name)
    if match is None:
        return False
    try:
        os.kill(int(match.group(1)), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # someone else's process, or not a pid we can ask about
    return True


class DiskStore:
    """``KVStore`` over the files of ``path``, at most ``capacity_bytes`` of them for the
    layout the connector registers. Files an earlier run of that layout left are kept, oldest
    first."""

    name = "DISK"
    medium = "disk"

    def __init__(self, path: str | os.PathLike[str], capacity_bytes: int, *,
                 min_seen: int = 2) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"the disk tier's path must be a str or a path, got "
                            f"{type(path).__name__}")
        if not os.fspath(path).strip():  # Path("") is the working directory
            raise ValueError("the disk tier's path is empty: name the directory it may fill "
                             "(kv_offload disk=(PATH, SIZE))")
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) \
                or capacity_bytes < 1:
            raise ValueError(f"the disk tier's capacity must be a positive number of bytes, "
                             f"got {capacity_bytes!r}")
        if isinstance(min_seen, bool) or not isinstance(min_seen, int) or min_seen < 1:
            raise ValueError(f"min_seen must be a positive int, got {min_seen!r}")
        self.path = Path(path).expanduser()  # "~/kv" as a shell reads it
        self.layout_path: Path | None = None
        """The folder of this tier's files (once ``register_layout`` named it)."""
        self.capacity_bytes = capacity_bytes
        self.min_seen = min_seen
        self.writable = True
        self.errors = 0
        self._lock = threading.Lock()
        self._files: OrderedDict[str, int] = OrderedDict()  # key -> size, least recent first
        self._seen: dict[str, int] = {}
        # Keys evicted since take_evicted (KV events read them); the newest only, when no
        # one does.
        self._evicted: deque[str] = deque(maxlen=_MAX_TRACKED)
        self._writing: set[str] = set()  # keys whose file is being written
        self._bytes = 0

    def register_layout(self, identity: str, value_bytes: int) -> None:
        """Opens the folder of ``identity`` (created if need be) and takes the files an
        earlier run left there as held. Nothing is written before: a capacity below one
        value of ``value_bytes`` is refused first."""
        if self.layout_path is not None:
            raise RuntimeError(f"the disk tier at {str(self.path)!r} serves one layout")
        if not isinstance(identity, str) or not identity:
            raise ValueError(f"the layout identity must be a non-empty str, got {identity!r}")
        if self.capacity_bytes < value_bytes:
            raise ValueError(f"the disk tier's capacity (kv_offload disk SIZE) of "
                             f"{self.capacity_bytes} bytes holds no block of {value_bytes} "
                             f"bytes")
        folder = self.path / (identity if _PLAIN_NAME.fullmatch(identity)
                              else hashlib.sha256(identity.encode()).hexdigest()[:32])
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            self._stop_unless_full(error)
        found = self._scan(folder) if folder.is_dir() else []  # first: dead writers' partials
        probe = folder / ".atb-mem-probe"
        try:
            if self.writable:
                probe.write_bytes(b"ok")
                probe.unlink()
        except OSError as error:
            probe.unlink(missing_ok=True)
            self._stop_unless_full(error)
        held = sum(size for _, _, size in found)
        room = _free_bytes(folder if folder.is_dir() else self.path) + held
        if self.writable and room < self.capacity_bytes:
            warnings.warn(f"atb-mem: the disk tier's capacity of {self.capacity_bytes} bytes "
                          f"is more than its filesystem at {str(self.path)!r} has free "
                          f"({room - held} bytes, and {held} the folder holds): it keeps at "
                          f"most {room}", stacklevel=2)
            self.capacity_bytes = room
            self.writable = room >= value_bytes
        with self._lock:
            self.layout_path = folder
            for _, name, size in sorted(found):
                self._files[name] = size
                self._bytes += size

    def _stop_unless_full(self, error: OSError) -> None:
        """Start-up could not write the folder: a full filesystem stops the tier's writes,
        with a warning (its reads go on); anything else refuses the tier."""
        if error.errno not in _NO_SPACE:
            raise ValueError(f"the disk tier's directory {str(self.path)!r} is not writable: "
                             f"{error.strerror or error}") from None
        self.writable = False
        warnings.warn(f"atb-mem: the disk tier's filesystem at {str(self.path)!r} has no space "
                      f"left: it reads the blocks it holds and writes none", stacklevel=4)

    @staticmethod
    def _scan(folder: Path) -> list[tuple[float, str, int]]:
        """(mtime, name, size) of the files an earlier run left in ``folder``; refuses what
        would make a later read or write fail for good."""
        found = []
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.name.endswith(".part"):
                    if entry.is_dir(follow_symlinks=False):
                        raise ValueError(f"the disk tier's folder {str(folder)!r} holds a "
                                         f"directory {entry.name!r} where it writes files: "
                                         f"remove it")
                    if not _writer_alive(entry.name):  # a write a dead process left
                        Path(entry.path).unlink(missing_ok=True)
                elif entry.name.endswith(".kv"):
                    try:
                        status = entry.stat()
                    except FileNotFoundError:
                        raise ValueError(f"the disk tier's folder {str(folder)!r} holds "
                                         f"{entry.name!r}, a link to nothing: remove "
                                         f"it") from None
                    if not stat.S_ISREG(status.st_mode):
                        raise ValueError(f"the disk tier's folder {str(folder)!r} holds "
                                         f"{entry.name!r}, which is not a file: remove it")
                    found.append((status.st_mtime, entry.name[:-len(".kv")], status.st_size))
        return found

    def _file(self, key: str) -> Path:
        if self.layout_path is None:
            raise RuntimeError("the disk tier has no layout yet: call register_layout first")
        return self.layout_path / (_name(key) + ".kv")

    def exists(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [_name(key) in self._files for key in keys]

    def files_exist(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key's file is in the folder now, whoever wrote it (``exists`` knows
        this tier's own writes only): the lookup of a process that reads what others write."""
        return [self._file(key).is_file() for key in keys]

    def get(self, key: str) -> bytes | None:
        """The file's bytes; also a file another engine sharing the folder wrote (which
        this tier does not count as its own)."""
        name = _name(key)
        with self._lock:
            held = name in self._files
            if held:
                self._files.move_to_end(name)
        try:
            return self._file(key).read_bytes()
        except OSError:  # deleted or replaced under the engine: no longer held
            if held:
                self._forget(name)
            return None

    def put(self, key: str, value: bytes) -> bool:
        name = _name(key)
        with self._lock:
            if len(self._seen) > _MAX_TRACKED:
                self._seen.clear()  # forget counts rather than grow without bound
            seen = self._seen.get(name, 0) + 1
            self._seen[name] = seen
            if name in self._files:
                if self._file(key).is_file():
                    return False
                # Another engine sharing the folder evicted it, or a clean-up removed it:
                # gone, though counted as held. It was seen often enough to be written.
                self._drop(name)
                seen = self.min_seen
            if not self.writable or name in self._writing or seen < self.min_seen \
                    or len(value) > self.capacity_bytes:
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
        # Named by its writer, so that an engine starting on this folder knows whether the
        # write is still under way.
        writer = f"{os.getpid()}-{threading.get_ident()}"
        partial = self._file(key).with_name(f"{name}.{writer}.part")
        try:
            partial.write_bytes(value)
            partial.replace(self._file(key))  # readers never see half a file
        except OSError as error:
            # What a full disk left of the file would stay until a restart, and take the
            # room a restart needs.
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
            # A partial write removed under it (by an engine that could not tell it was
            # live) costs this block, not the tier.
            folder = self.layout_path
            lost = isinstance(error, FileNotFoundError) and folder is not None \
                and folder.is_dir()
            with self._lock:
                self._writing.discard(name)
                self._bytes -= len(value)
                self.writable = self.writable and lost
                self.errors += 1
            if lost:
                log.warning("atb-mem: a disk tier write was removed before it landed: %s", key)
                return False
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
        if self._forget(_name(key)):
            self._file(key).unlink(missing_ok=True)

    def _forget(self, name: str) -> bool:
        """Stops holding ``name`` (whether it was held). Its next save writes it at once: it
        was seen often enough to be written before, and a load just missed it."""
        with self._lock:
            if name not in self._files:
                return False
            self._drop(name)
            self._seen[name] = self.min_seen - 1
        return True

    def _drop(self, name: str) -> None:
        """Stops holding ``name``, which is held (the lock held): its file is gone."""
        self._bytes -= self._files.pop(name)
        self._evicted.append(name)

    def take_evicted(self) -> list[str]:
        """The keys (as file names) evicted since the last call."""
        with self._lock:
            evicted = list(self._evicted)
            self._evicted.clear()
        return evicted

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def close(self) -> None:
        pass

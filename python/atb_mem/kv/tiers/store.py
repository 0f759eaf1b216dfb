"""What a tier below the host keeps, and how a block's bytes travel to it and back.

A ``KVStore`` maps a key to the bytes of one KV block (every layer's K and V, as
``KVTensors`` lays one block out). Keys name a block by the prefix cache's chain hash plus an
identity of the model and the layout (``block_key``), so engines that share a store share
blocks only when their K/V bytes would be the same. Every value is framed with its length, a
CRC-32 and a digest of its key (``frame``/``unframe``): a truncated or corrupted chunk, or an
intact one under another block's key (a file moved or restored over the wrong name), is
detected on load, the load fails, and the block is recomputed — never served.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

__all__ = ["KVStore", "block_key", "frame", "framed_size", "key_hash", "layout_identity",
           "unframe"]

_MAGIC = b"ATB2"
_HEADER = struct.Struct("<4sIQ16s")  # magic, crc32, payload length, key digest
_NO_KEY = bytes(16)


class KVStore(Protocol):
    """A tier below the host: a disk directory, or a store shared across engines.

    A store may also have ``register_layout(identity, value_bytes)``, which the connector
    calls once before any other call: the identity its keys carry and the framed size of
    every value. The store raises ValueError there if it cannot hold a value (the error is
    the engine's at start-up); the disk tier keeps its files in a folder of that identity."""

    name: str
    """The tier in metrics (``"DISK"``, ``"MOONCAKE"``)."""
    medium: str
    """The tier's medium in KV events: ``"disk"`` or ``"store"``."""

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is held (one batched call)."""

    def get(self, key: str) -> bytes | None:
        """The framed value, or None when it is not held or cannot be read."""

    def put(self, key: str, value: bytes) -> bool:
        """Stores a framed value; False when the tier could not take it."""

    def close(self) -> None: ...


def _key_digest(key: str | None) -> bytes:
    return _NO_KEY if key is None else hashlib.blake2b(key.encode(), digest_size=16).digest()


def frame(payload: bytes | memoryview, checksum: bool = True, key: str | None = None
          ) -> bytes:
    """``payload`` with its header: length, CRC-32 (0 when ``checksum`` is off) and a
    digest of the ``key`` it is stored under."""
    crc = zlib.crc32(payload) if checksum else 0
    return _HEADER.pack(_MAGIC, crc, len(payload), _key_digest(key)) + bytes(payload)


def framed_size(payload_bytes: int) -> int:
    """The bytes ``frame`` makes of a payload of ``payload_bytes``."""
    return _HEADER.size + payload_bytes


def unframe(value: bytes | None, expected_len: int, checksum: bool = True,
            key: str | None = None) -> bytes | None:
    """The payload of a framed value, or None if it is missing, truncated, of the wrong
    length, framed for another ``key`` or (with ``checksum``) corrupted."""
    if value is None or len(value) < _HEADER.size:
        return None
    magic, crc, length, framed_key = _HEADER.unpack_from(value)
    payload = value[_HEADER.size:]
    if magic != _MAGIC or length != expected_len or len(payload) != length:
        return None
    if framed_key != _key_digest(key):
        return None
    if checksum and zlib.crc32(payload) != crc:
        return None
    return payload


def layout_identity(**parts: Any) -> str:
    """A short digest of what makes two engines' blocks byte-identical: the model, the dtype,
    the block size and layout, the tensor-parallel rank."""
    text = repr(sorted(parts.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def block_key(identity: str, hash_words: np.ndarray | Sequence[int]) -> str:
    """The store key of the block whose chain hash is ``hash_words`` (two uint64)."""
    return f"atb/{identity}/{int(hash_words[0]):016x}{int(hash_words[1]):016x}"


def key_hash(key: str) -> tuple[int, int]:
    """The chain hash (two uint64) a ``block_key`` names."""
    digits = key.rsplit("/", 1)[-1].rsplit("-", 1)[-1]
    return int(digits[:16], 16), int(digits[16:32], 16)

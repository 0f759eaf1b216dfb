"""A disk tier as the tests build it."""

from __future__ import annotations

from pathlib import Path

from atb_mem.kv.tiers import DiskStore


def disk(path: Path, capacity_bytes: int, layout: str = "m", value_bytes: int = 100,
         min_seen: int = 2) -> DiskStore:
    """A disk tier registered for ``layout``'s values of ``value_bytes``, as the connector
    registers it."""
    store = DiskStore(path, capacity_bytes, min_seen=min_seen)
    store.register_layout(layout, value_bytes)
    return store

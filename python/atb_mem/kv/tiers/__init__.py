"""Tiers below the host: the disk tier (files under a directory) and a KV store shared across
engines (Mooncake Store), under one connector that looks prompts up in them, loads what they
hold while other requests run, and writes computed blocks through to them."""

from atb_mem.kv.tiers.connector import TierConnector
from atb_mem.kv.tiers.counters import TierCounters
from atb_mem.kv.tiers.disk import DiskStore
from atb_mem.kv.tiers.mooncake import MooncakeStore, parse_mooncake_url
from atb_mem.kv.tiers.store import KVStore, block_key, frame, layout_identity, unframe

__all__ = ["DiskStore", "KVStore", "MooncakeStore", "TierConnector", "TierCounters",
           "block_key", "frame", "layout_identity", "open_store", "parse_mooncake_url",
           "unframe"]


def open_store(url: str) -> KVStore:
    """The store a ``kv_store`` URL names: ``mooncake://HOST:PORT[?options]``."""
    if not isinstance(url, str):
        raise TypeError(f"kv_store must be a URL string, got {type(url).__name__}")
    if url.startswith("mooncake://"):
        return MooncakeStore(url)
    raise ValueError(f"kv_store {url!r}: the scheme must be mooncake://")

"""The paged KV cache.

- ``cache_pool``: ``KVCachePool``, blocks handed to sequences (the bookkeeping is the Rust
  core's) with the bytes that hold their K/V;
- ``tensors``: ``KVTensors``, those bytes and the one way they move (``execute(moves)``);
- ``planning``: ``plan_kv_cache``, sizing a cache from memory figures;
- ``attention``: a reference paged attention that reads K/V through a block table.

A hybrid model's layers form KV-cache groups (``KVCacheGroup``); ``explain_prefix`` says why a
prefix hit stops where it does (``PrefixExplanation``, ``MISS_REASONS``).
"""

from atb_mem._types import MISS_REASONS, GroupPrefix, KVCacheGroup, PrefixExplanation, StateGroup

__all__ = ["MISS_REASONS", "GroupPrefix", "KVCacheGroup", "PrefixExplanation", "StateGroup"]

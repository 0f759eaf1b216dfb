"""The paged KV cache: `KVCachePool`, with construction from the seeds' config form."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from atb_mem import _core
from atb_mem.mem_pool import MemPool

__all__ = ["KVCachePool"]

# Config keys and the constructor argument each one sets.
_CONFIG_KEYS = {
    "max_pages": "num_blocks",
    "num_blocks": "num_blocks",
    "page_size": "block_size",
    "block_size": "block_size",
    "num_layers": "num_layers",
    "num_kv_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "dtype": "dtype",
    "enable_prefix_caching": "enable_prefix_caching",
}


class KVCachePool(_core.KVCachePool):
    """Paged KV cache: ``num_blocks`` blocks of ``block_size`` token slots.

    Block 0 is the reserved null block (block tables are padded with it), so
    ``num_blocks - 1`` blocks hold tokens. See ``_core.pyi`` for every method.
    """

    __slots__ = ("_mem_pool", "_region")

    def __new__(cls, num_blocks: int, block_size: int, *, pool: MemPool | None = None,
                **kwargs: Any) -> KVCachePool:
        """``pool``: a ``MemPool`` to take the block region from, as one allocation of
        ``num_blocks * bytes_per_block`` bytes, given back by ``close()``."""
        if pool is not None and not isinstance(pool, _core.MemPool):
            raise TypeError(f"pool must be a MemPool, got {type(pool).__name__}")
        self = super().__new__(cls, num_blocks, block_size, **kwargs)
        self._mem_pool = pool
        self._region = None
        if pool is not None:
            self._region = pool.malloc(self.num_blocks * self.bytes_per_block)
        return self

    @property
    def mem_pool(self) -> MemPool | None:
        """The ``MemPool`` the block region came from, if any."""
        return getattr(self, "_mem_pool", None)

    @property
    def region(self) -> _core.Allocation | None:
        """The block region's allocation in ``mem_pool`` (None when closed or pool-less)."""
        return getattr(self, "_region", None)

    def close(self) -> None:
        """Gives the block region back to its ``MemPool``. Idempotent."""
        region, self._region = getattr(self, "_region", None), None
        pool = getattr(self, "_mem_pool", None)
        if region is not None and pool is not None and not pool.closed:
            pool.free(region)

    def __enter__(self) -> KVCachePool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # the pool may be gone at interpreter exit
            pass

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> KVCachePool:
        """Builds a pool from a config dict in the seeds' form.

        ``{"memory_mode": "paged", "page_size": 64, "max_pages": 1024}`` plus, optionally,
        ``num_layers``, ``num_kv_heads``, ``head_dim``, ``dtype`` and
        ``enable_prefix_caching``. ``max_pages`` counts every block, the null block included
        (it is ``num_blocks``); ``page_size`` is ``block_size``. Unknown keys are an error
        rather than silently ignored.
        """
        if not isinstance(config, Mapping):
            raise TypeError(f"config must be a mapping, got {type(config).__name__}")
        mode = config.get("memory_mode", "paged")
        if mode != "paged":
            raise ValueError(f"memory_mode must be 'paged' for a KVCachePool, got {mode!r}")
        unknown = sorted(set(config) - set(_CONFIG_KEYS) - {"memory_mode"})
        if unknown:
            raise ValueError(
                f"unknown config key(s) {unknown}; expected some of "
                f"{sorted({*_CONFIG_KEYS, 'memory_mode'})}"
            )
        kwargs: dict[str, Any] = {}
        for key, value in config.items():
            if key == "memory_mode":
                continue
            argument = _CONFIG_KEYS[key]
            if argument in kwargs and kwargs[argument] != value:
                raise ValueError(f"config sets {argument} twice with different values")
            kwargs[argument] = value
        for required, aliases in (("num_blocks", "max_pages"), ("block_size", "page_size")):
            if required not in kwargs:
                raise ValueError(f"config needs {aliases!r} (or {required!r})")
        num_blocks = kwargs.pop("num_blocks")
        block_size = kwargs.pop("block_size")
        return cls(num_blocks, block_size, **kwargs)

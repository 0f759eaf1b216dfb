"""What the tiers below the host did, as the ``TierConnector`` counts it (the metrics read a
copy at scrape time)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["LOAD_SECONDS_BUCKETS", "TierCounters"]

# Upper bounds (seconds) of the load-latency histogram's buckets, Prometheus-style.
LOAD_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, float("inf"))


@dataclass
class TierCounters:
    """What the tiers below the host did since the engine started. Per tier (a store's
    ``name``): blocks loaded from it and blocks written to it."""

    offered_blocks: int = 0
    """Blocks past the device's and the host's hit that a store held when a request came."""
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    load_failures: int = 0
    """Loads recomputed instead: a block missing or damaged, a load late
    (``load_timeout_s``), or its copy to the device raised."""
    corrupt_blocks: int = 0
    saved_blocks: int = 0
    saved_bytes: int = 0
    dropped_saves: int = 0
    """Saves dropped: the writer was ``MAX_PENDING_SAVES`` behind, or copying out failed."""
    store_errors: int = 0
    """Calls to the stores that failed (unreachable, refusing, a failed write)."""
    raised_puts: int = 0
    """Of ``store_errors``, writes that raised rather than returned False."""
    loaded_by_tier: dict[str, int] = field(default_factory=dict)
    saved_by_tier: dict[str, int] = field(default_factory=dict)
    load_seconds_buckets: list[int] = field(
        default_factory=lambda: [0] * len(LOAD_SECONDS_BUCKETS))
    """Loads (request admitted to blocks in place) by latency: cumulative, per bucket of
    ``LOAD_SECONDS_BUCKETS``."""
    load_seconds_sum: float = 0.0

    def copy(self) -> TierCounters:
        """A copy whose dicts and lists are its own."""
        return TierCounters(**{**self.__dict__,
                               "loaded_by_tier": dict(self.loaded_by_tier),
                               "saved_by_tier": dict(self.saved_by_tier),
                               "load_seconds_buckets": list(self.load_seconds_buckets)})

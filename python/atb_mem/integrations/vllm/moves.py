"""What the connector's two sides say to each other each step: the rows vLLM scheduled
(``Scheduled``, scheduler side in) and the moves every worker makes (``TierMoves``,
scheduler side out, pickled to the workers)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["HOST", "Scheduled", "TierMoves", "VllmBlock", "group_ids", "whole"]

HOST = "HOST"
"""The host tier's name in hit counts (the stores use theirs: ``DISK``, ``MOONCAKE``)."""

VllmBlock = int | tuple[int, ...]
"""A block of a request in vLLM's cache: its id, or with several KV-cache groups (vLLM's
hybrid manager) one id per group; 0 is vLLM's null block, where a sliding window let the
block go (a model of windowed layers only has one group, and null blocks too)."""


def group_ids(block: VllmBlock) -> tuple[int, ...]:
    """The block's id in each KV-cache group (one group: its id alone)."""
    return block if isinstance(block, tuple) else (block,)


def whole(block: VllmBlock) -> bool:
    """Whether every group still holds the block (a save reads all of them)."""
    return all(group_ids(block))


@dataclass
class TierMoves:
    """One step's moves, executed by every worker in this order. Plain lists: it travels
    pickled to worker processes."""

    tail_saves: list[tuple[str, VllmBlock, int]] = field(default_factory=list)
    """(request, vLLM block, host block): an ended request's last, partly filled block,
    whose vLLM block vLLM holds until the workers report the request (``finished_sending``).
    Copied first: every other move of the step was planned after the request ended, so none
    reads a host block the tail's took over (the index no longer had it)."""
    host_copies: list[tuple[int, int]] = field(default_factory=list)
    """(host block, host block): a hit ending inside a block, copied whole into the
    request's own block first (the index counts its pieces as computed there)."""
    host_loads: list[tuple[int, VllmBlock]] = field(default_factory=list)
    """(host block, vLLM block): copied before the forward, after ``host_copies``."""
    store_loads: dict[str, list[tuple[int, int, VllmBlock]]] = field(default_factory=dict)
    """Per request: (hash word 0, hash word 1, vLLM block), fetched asynchronously."""
    disk_loads: dict[str, list[tuple[int, int, VllmBlock]]] = field(default_factory=dict)
    """Per request: (hash word 0, hash word 1, vLLM block), read from the disk before the
    forward (a small local load: no step spent waiting for it)."""
    saves: list[tuple[VllmBlock, int]] = field(default_factory=list)
    """(vLLM block, host block): copied after the forward."""
    puts: list[tuple[bool, VllmBlock, int, int, tuple[str, ...]]] = field(default_factory=list)
    """(from host, block, hash word 0, hash word 1, stores): written to those stores after
    the saves, from the host block (or, without a host tier, the vLLM block)."""
    idle: bool = False
    """No forward this step: a worker may wait a little for its loads."""

    def __bool__(self) -> bool:
        return bool(self.tail_saves or self.host_copies or self.host_loads or self.store_loads
                    or self.disk_loads or self.saves or self.puts)


@dataclass(frozen=True)
class Scheduled:
    """A request vLLM scheduled this step, as ``build`` needs it."""

    req_id: str
    num_computed_tokens: int
    num_scheduled_tokens: int
    new_block_ids: Sequence[VllmBlock] | None = None
    resumed: bool = False
    """``new_block_ids`` replace the request's blocks (it came back from preemption)."""

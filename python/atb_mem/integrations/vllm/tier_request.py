"""The scheduler side's record of a request: its tokens and block hashes, its host
sequence and the hits each tier offered, its vLLM blocks and what of them was saved."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from atb_mem.integrations.vllm.moves import VllmBlock

__all__ = ["TierRequest"]


@dataclass
class TierRequest:
    """What the scheduler side knows of one request of vLLM's, from its lookup to its end."""

    tokens: Sequence[int]
    """The request's tokens, read live (vLLM appends the ones it samples)."""
    salt: str | None
    seq_id: int | None
    """Its sequence in the host index (None: no host tier, or the index was full)."""
    hashes: np.ndarray
    num_computed: int
    host_table: list[int]
    host_whole: int
    partial: bool
    """Whether the host's hit ends inside block ``host_whole`` (copied into its own)."""
    holders: list[tuple[str, ...]]
    """Per block before the last token's: the stores holding it."""
    store_run: int
    hit_tokens: dict[str, int] = field(default_factory=dict)
    loading: list[tuple[int, str, int]] = field(default_factory=list)
    """(block index, store, tokens) of its disk and store loads in flight: counted served
    once they land."""
    vllm_blocks: list[VllmBlock] = field(default_factory=list)
    committed: bool = False
    saved: int = 0
    saves_end: int | None = None
    """A block no group's save can read (a window let it go before it was saved): nothing
    from it on is saved, as a hit needs every block before it."""
    asked: tuple[Any, ...] = ()
    """The lookup's arguments and answer, which an unchanged lookup gets again."""
    loads_now: bool = False
    """Its disk blocks are read before the forward of the step that admits it."""

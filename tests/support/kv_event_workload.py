"""What the KV-event tests share: a router that knows only the events, and random pool
operations (stores, evictions, swaps, resets) that produce them."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from atb_mem.events import BlockRemoved, BlockStored, KVCacheEvent

operation = st.one_of(
    st.tuples(st.just("alloc"), st.integers(0, 5),
              st.lists(st.integers(0, 2), min_size=1, max_size=9)),
    st.tuples(st.just("compute"), st.integers(0, 5)),
    st.tuples(st.just("free"), st.integers(0, 5)),
    st.tuples(st.just("swap_out"), st.integers(0, 5)),
    st.tuples(st.just("swap_in"), st.integers(0, 5)),
    st.tuples(st.just("reset"),),
)


def apply(pool: Any, step: tuple[Any, ...]) -> None:
    """Runs one operation; one the pool refuses (an unknown id, no room) changes nothing."""
    name, *args = step
    try:
        if name == "alloc":
            pool.alloc_sequence(args[0], args[1])
        elif name == "compute":
            if not pool.is_swapped(args[0]):
                pool.mark_computed(args[0])
        elif name == "free":
            pool.free_sequence(args[0])
        elif name == "swap_out":
            pool.swap_out([args[0]])
        elif name == "swap_in":
            pool.swap_in([args[0]])
            pool.mark_computed(args[0])  # the bytes are back
        else:
            pool.reset_prefix_cache()
    except (ValueError, KeyError, MemoryError, RuntimeError):
        pass


class Router:
    """What a router knows: the hashes each medium holds, from the events alone."""

    def __init__(self) -> None:
        self.blocks: dict[str, set[int]] = {"device": set(), "host": set()}
        self.last_event_id = 0

    def replay(self, events: list[KVCacheEvent]) -> None:
        for event in events:
            assert event.event_id == self.last_event_id + 1
            self.last_event_id = event.event_id
            if isinstance(event, BlockStored):
                assert not self.blocks[event.medium] & set(event.block_hashes)
                self.blocks[event.medium] |= set(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= self.blocks[event.medium]
                self.blocks[event.medium] -= set(event.block_hashes)
            else:
                self.blocks = {"device": set(), "host": set()}

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
# With windows: a running sequence decodes, so its windowed groups release blocks early.
hybrid_operation = st.one_of(operation, st.tuples(st.just("decode"), st.integers(0, 5),
                                                  st.integers(1, 4)))


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
        elif name == "decode":
            for token in range(args[1]):
                pool.append_tokens([args[0]], token_ids=[token % 3])
                pool.mark_computed(args[0])
        else:
            pool.reset_prefix_cache()
    except (ValueError, KeyError, MemoryError, RuntimeError):
        pass


class Router:
    """What a router knows: the hashes each medium holds, from the events alone."""

    def __init__(self) -> None:
        self.blocks: dict[str, set[int]] = {"device": set(), "host": set()}
        """Per medium, the hashes of one-group pools' blocks."""
        self.grouped: dict[str, set[tuple[int, int]]] = {"device": set(), "host": set()}
        """Per medium, the (group, hash) of grouped pools' blocks."""
        self.last_event_id = 0

    def replay(self, events: list[KVCacheEvent]) -> None:
        for event in events:
            assert event.event_id == self.last_event_id + 1
            self.last_event_id = event.event_id
            if isinstance(event, BlockStored | BlockRemoved) and event.group is not None:
                names = {(event.group, int(block)) for block in event.block_hashes}
                held = self.grouped[event.medium]
                if isinstance(event, BlockStored):
                    assert not held & names, "stored twice"
                    held |= names
                else:
                    assert names <= held, "removed but not stored"
                    held -= names
            elif isinstance(event, BlockStored):
                assert not self.blocks[event.medium] & set(event.block_hashes)
                self.blocks[event.medium] |= set(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= self.blocks[event.medium]
                self.blocks[event.medium] -= set(event.block_hashes)
            else:
                self.blocks = {"device": set(), "host": set()}
                self.grouped = {"device": set(), "host": set()}

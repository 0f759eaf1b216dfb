"""What a request asks the prefix cache to keep, for ``eviction_policy="priority"``
(TensorRT-LLM's ``KvCacheRetentionConfig``, in seconds).

A token asks for the highest priority of the ranges that hold it (generated tokens for
``decode``'s too; tokens nothing holds for ``default_priority``), and a block takes its
least wanted token's: it is reused only whole. Priorities run from 0 (evicted first) to 100
(kept longest); a duration ends a priority (it falls back to 35), ``None`` keeps it while
the block is cached. A cached block another request hits keeps the highest priority any of
them gave it. At most 64 ranges. ``"priority"`` is the default eviction policy; the others
keep no priorities and refuse a retention that asks for any.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_PRIORITY", "MAX_PRIORITY", "MAX_RANGES", "Retention"]

DEFAULT_PRIORITY = 35
MAX_PRIORITY = 100
MAX_RANGES = 64
_SECOND_NS = 1_000_000_000
_LONGEST_NS = 2**63 - 1
_LONGEST_S = _LONGEST_NS / _SECOND_NS
_MOST_TOKENS = 2**63

Range = tuple[int, int | None, int, float | None]


def _priority(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"a retention priority must be an int, got {type(value).__name__}")
    if not 0 <= value <= MAX_PRIORITY:
        raise ValueError(f"retention priorities run from 0 to {MAX_PRIORITY}, got {value}")
    return value


def _duration_ns(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"a retention duration must be seconds or None, got "
                        f"{type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"a retention duration must be finite and not negative, got {value}")
    if value >= _LONGEST_S:  # past 292 years: as good as for ever, and an int64 still
        return _LONGEST_NS
    return int(value * _SECOND_NS)


def _token(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _MOST_TOKENS:
        raise ValueError(f"a retention range's {name} must be an int in [0, 2**63), got "
                         f"{value!r}")
    return value


@dataclass(frozen=True)
class Retention:
    """``ranges``: (start, end or None for the prompt's end, priority, duration_s or None);
    ``decode``: (priority, duration_s or None) for generated tokens."""

    ranges: tuple[Range, ...] = ()
    decode: tuple[int, float | None] | None = None
    default_priority: int = DEFAULT_PRIORITY

    def __post_init__(self) -> None:
        ranges = tuple(self.ranges)
        if len(ranges) > MAX_RANGES:
            raise ValueError(f"a retention takes at most {MAX_RANGES} token ranges, got "
                             f"{len(ranges)}")
        for entry in ranges:
            if not isinstance(entry, tuple | list) or len(entry) != 4:
                raise ValueError(f"a retention range is (start, end, priority, duration_s), "
                                 f"got {entry!r}")
            start, end, priority, duration = entry
            _token("start", start)
            if end is not None and _token("end", end) <= start:
                raise ValueError(f"a retention range ends after it starts, got {start}..{end}")
            _priority(priority)
            _duration_ns(duration)
        object.__setattr__(self, "ranges", tuple(tuple(entry) for entry in ranges))
        if self.decode is not None:
            if not isinstance(self.decode, tuple | list) or len(self.decode) != 2:
                raise ValueError(f"decode retention is (priority, duration_s), got "
                                 f"{self.decode!r}")
            _priority(self.decode[0])
            _duration_ns(self.decode[1])
            object.__setattr__(self, "decode", tuple(self.decode))
        _priority(self.default_priority)

    @classmethod
    def of(cls, ranges: Iterable[Any] | None, decode: Any = None) -> Retention | None:
        """``SamplingParams``' ``retention`` and ``decode_retention`` as one (None: none)."""
        if not ranges and decode is None:
            return None
        return cls(tuple(ranges or ()), decode)

    def core_args(self) -> tuple[list[tuple[int, int | None, int, int | None]],
                                 tuple[int, int | None] | None, int]:
        """The core's arguments: durations in nanoseconds."""
        ranges = [(start, end, priority, _duration_ns(duration))
                  for start, end, priority, duration in self.ranges]
        decode = None if self.decode is None else (self.decode[0],
                                                    _duration_ns(self.decode[1]))
        return ranges, decode, self.default_priority

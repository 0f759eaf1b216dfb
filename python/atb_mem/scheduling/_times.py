"""Times and durations from the Python API, in the core's nanoseconds."""

from __future__ import annotations

import numbers
from typing import Any, cast

MAX_NS = 2**63 - 1  # the core keeps times in 64-bit signed nanoseconds

SECOND_NS = 1_000_000_000
MILLISECOND_NS = 1_000_000


def to_ns(name: str, value: Any, unit_ns: int, unit: str) -> int:
    """``value``, a number of ``unit`` (each ``unit_ns`` nanoseconds), in nanoseconds.

    NaN and the infinities are numbers but no time: they are a ValueError naming ``name``
    here, like a negative time or one beyond the core's 64 bits, rather than an
    OverflowError from ``round()`` or a NaN that slips past every comparison.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of {unit}, got {value!r}")
    # A numbers.Real compares like a float (typeshed's Real cannot say so); an int exactly.
    number = cast(float, value)
    # Every comparison with NaN is false, so this one test refuses NaN too; and it compares
    # an int exactly, never converting one too large for a float.
    if not 0 <= number <= MAX_NS / unit_ns:
        raise ValueError(f"{name} must be a finite number of {unit} from 0 to "
                         f"{MAX_NS / unit_ns:.6g}, got {value!r}")
    # min(): at the very top, rounding through a float can land one past the limit.
    return min(round(float(number) * unit_ns), MAX_NS)

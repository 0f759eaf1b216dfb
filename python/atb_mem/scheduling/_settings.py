"""Changing a scheduler's settings while requests flow, the same way for both schedulers:
the changes go over the settings the next step (or batch) would run with, a name that is no
setting is refused, and the owner's core validates the result before anything changes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def merged_settings(known: Sequence[str], base: Mapping[str, Any],
                    changes: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``changes`` over it; ``ValueError`` for a name not in ``known``."""
    unknown = sorted(set(changes) - set(known))
    if unknown:
        raise ValueError(f"unknown setting(s) {unknown}; expected some of {list(known)}")
    return dict(base) | dict(changes)

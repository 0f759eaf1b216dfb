"""Byte sizes as people write them: ``"64GiB"``, ``"14GB"``, ``1048576``."""

from __future__ import annotations

import re

__all__ = ["parse_size"]

_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1024**3, "gb": 1000**3, "gib": 1024**3, "t": 1024**4,
          "tb": 1000**4, "tib": 1024**4}


def parse_size(text: str | int) -> int:
    """``"64GiB"`` → bytes. KB/MB/GB/TB are decimal, KiB/MiB/GiB/TiB and bare K/M/G/T binary;
    an int is bytes already."""
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        raise TypeError(f"a size is a string like '8GiB' or a number of bytes, got "
                        f"{type(text).__name__}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"a size must not be negative, got {text}")
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size (e.g. 64GiB, 14GB, 1048576)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])

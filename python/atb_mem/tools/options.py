"""The command line's value types (sizes, comma-separated lists) and what every subcommand
shares: the console, ``--json`` output, the optional matplotlib."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from typing import Any

import click
from rich.console import Console

from atb_mem._core import KV_DTYPES

_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1024**3, "gb": 1000**3, "gib": 1024**3, "t": 1024**4,
          "tb": 1000**4, "tib": 1024**4}


def parse_size(text: str) -> int:
    """``"64GiB"`` → bytes. KB/MB/GB/TB are decimal, KiB/MiB/GiB/TiB and bare K/M/G/T binary."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size (e.g. 64GiB, 14GB, 1048576)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


class _Size(click.ParamType):
    name = "SIZE"

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_size(value)
        except ValueError as error:
            self.fail(str(error), param, ctx)


class CommaList(click.ParamType):
    def __init__(self, kind: Callable[[str], Any], name: str) -> None:
        self.kind, self.name = kind, name

    def convert(self, value: Any, param: Any, ctx: Any) -> list[Any]:
        if isinstance(value, list):
            return value
        try:
            items = [self.kind(part) for part in str(value).split(",") if part.strip()]
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of {self.name}", param, ctx)
        if not items:
            self.fail("the list is empty", param, ctx)
        return items


SIZE = _Size()
DTYPES = list(KV_DTYPES)
# Wide tables when the output is not a terminal (a file, a CI log): rich would use 80 columns.
console = Console(width=None if sys.stdout.isatty() else 160)


def write_json(path: str | None, payload: Any) -> None:
    if path:
        with open(path, "w") as handle:
            json.dump(payload, handle, indent=2)
            handle.write("\n")


def require_matplotlib() -> Any:
    """matplotlib.pyplot, drawing to files; a one-line error when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise click.ClickException(
            "--plot needs matplotlib: pip install 'atb-mem[plot]'") from error
    return plt

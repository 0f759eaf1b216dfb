"""The command line's value types (sizes, comma-separated lists) and what every subcommand
shares: the console, ``--json`` output, the optional matplotlib."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import click
from rich.console import Console

from atb_mem._core import KV_CACHE_DTYPES, KV_DTYPES
from atb_mem._sizes import parse_size
from atb_mem.integrations.attention_backends import ATTENTION_BACKENDS


class _Size(click.ParamType):
    name = "SIZE"

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_size(value)
        except ValueError as error:
            self.fail(str(error), param, ctx)


class _Offload(click.ParamType):
    """``host=SIZE`` → ``("host", bytes)``; ``disk=PATH:SIZE`` → ``("disk", (PATH, bytes))``."""

    name = "TIER=SIZE"

    def convert(self, value: Any, param: Any, ctx: Any) -> tuple[str, Any]:
        if isinstance(value, tuple):
            return value
        tier, equals, size = str(value).partition("=")
        tier = tier.strip()
        if not equals or not tier:
            self.fail(f"{value!r} is not TIER=SIZE (host=8GiB, disk=PATH:100GiB)", param, ctx)
        try:
            if tier != "disk":
                return tier, parse_size(size)
            path, colon, disk_size = size.rpartition(":")
            if not colon or not path:
                raise ValueError(f"disk={size!r} is not PATH:SIZE")
            return tier, (path, parse_size(disk_size))
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


def offload_tiers(tiers: tuple[tuple[str, Any], ...]) -> dict[str, Any] | None:
    """``--kv-offload`` values as ``Engine``'s ``kv_offload``: each tier once."""
    if not tiers:
        return None
    offload: dict[str, Any] = {}
    for tier, size in tiers:
        if tier in offload:
            raise click.BadParameter(f"{tier} is given twice", param_hint="--kv-offload")
        offload[tier] = size
    return offload


SIZE = _Size()
OFFLOAD = _Offload()
DTYPES = list(KV_DTYPES)
KV_CACHE_DTYPE_OPTION = click.option(
    "--kv-cache-dtype", type=click.Choice(list(KV_CACHE_DTYPES)), default="auto",
    show_default=True,
    help="How the KV cache stores K/V: the model's dtype (auto), or quantized per token and "
         "KV head, int8 or fp8_e4m3 (about twice the tokens in the same memory).")
# Wide tables when the output is not a terminal (a file, a CI log): rich would use 80 columns.
console = Console(width=None if sys.stdout.isatty() else 160)


def model_options(defaults: dict[str, int]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--model-config`` or the dimension flags it stands for (``--layers``, ``--kv-heads``,
    ``--head-dim``, ``--dtype``); :func:`model_dimensions` resolves them with the same
    ``defaults`` (a flag without one must be given when no model config is)."""
    options = [
        click.option("--model-config", type=click.Path(exists=True), default=None,
                     help="A transformers config.json (or its checkpoint directory) giving "
                          "layers, KV heads, head dim, dtype and layer types."),
        *[click.option(f"--{name.replace('_', '-')}", name, type=click.IntRange(min=1),
                       default=None, help=f"(default {defaults[name]})" if name in defaults
                       else "(or --model-config)")
          for name in ("layers", "kv_heads", "head_dim")],
        click.option("--dtype", type=click.Choice(DTYPES), default=None,
                     help="(default float16, or the model config's)"),
    ]

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


def engine_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The options every command that builds an ``Engine`` from a checkpoint takes: where it
    runs (``--device``), in which dtype, its KV cache's blocks and its attention backend."""
    options = [
        click.option("--device", default=None,
                     help="cpu, cuda, cuda:1, ... (default: cuda if any)."),
        click.option("--dtype", type=click.Choice(["auto", "float32", "float16", "bfloat16"]),
                     default="auto", show_default=True),
        click.option("--block-size", type=click.IntRange(min=1), default=16,
                     show_default=True),
        click.option("--num-blocks", type=click.IntRange(min=2), default=None,
                     help="KV-cache blocks (default: sized from memory)."),
        click.option("--attention-backend",
                     type=click.Choice(ATTENTION_BACKENDS), default="auto",
                     show_default=True,
                     help="Paged attention: atb-mem's CPU kernel, FlashInfer's (CUDA), or the "
                          "torch reference; auto picks the kernel the device has."),
        KV_CACHE_DTYPE_OPTION,
    ]
    for option in reversed(options):
        command = option(command)
    return command


def model_dimensions(model_config: str | None, layers: int | None, kv_heads: int | None,
                     head_dim: int | None, dtype: str | None,
                     defaults: dict[str, int]) -> tuple[int, int, int, str, Any]:
    """(layers, kv_heads, head_dim, dtype, the ModelKVConfig or None) from the options of
    :func:`model_options`: a model config excludes the flags it stands for."""
    from atb_mem.kv.model_config import read_model_config

    flags = {"--layers": layers, "--kv-heads": kv_heads, "--head-dim": head_dim,
             "--dtype": dtype}
    if model_config is not None:
        given = [flag for flag, value in flags.items() if value is not None]
        if given:
            raise click.UsageError(f"--model-config gives the model's dimensions: drop "
                                   f"{', '.join(given)}")
        try:
            model = read_model_config(model_config)
        except ValueError as error:
            raise click.BadParameter(str(error), param_hint="--model-config") from error
        return model.num_layers, model.num_kv_heads, model.head_dim, model.dtype, model
    resolved = {"layers": layers or defaults.get("layers"),
                "kv_heads": kv_heads or defaults.get("kv_heads"),
                "head_dim": head_dim or defaults.get("head_dim")}
    missing = [f"--{name.replace('_', '-')}" for name, value in resolved.items() if value is None]
    if missing:
        raise click.UsageError(f"give --model-config, or {', '.join(missing)}")
    return (int(resolved["layers"] or 0), int(resolved["kv_heads"] or 0),
            int(resolved["head_dim"] or 0), dtype or "float16", None)


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

"""The `atb-mem` command: capacity planning and benchmarks.

    atb-mem plan --total-memory 80GiB --model-memory 16GiB --layers 32 --kv-heads 8 \\
        --head-dim 128 --dtype float16 --max-model-len 8192
    atb-mem plan --total-memory 80GiB --model-memory 16GiB --model-config config.json \\
        --max-model-len 8192
    atb-mem bench ops [--quick] [--json out.json]
    atb-mem generate MODEL_DIR --prompt TEXT [--max-tokens N] [--temperature T]
    atb-mem serve MODEL_DIR [--host 127.0.0.1] [--port 8000] [engine options]
    atb-mem ctl [--url URL] --get | --set KEY=VALUE ... [--then KEY=VALUE] [--live]

Every subcommand takes ``--json PATH`` for machine-readable results. Errors are one line on
stderr and a non-zero exit code: 2 for a bad command line, 1 for anything else.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from functools import partial
from typing import Any

import click
from rich.table import Table

import atb_mem
from atb_mem.kv.planning import plan_kv_cache
from atb_mem.tools.bench import bench
from atb_mem.tools.ctl import ctl
from atb_mem.tools.generate import generate
from atb_mem.tools.options import (
    KV_CACHE_DTYPE_OPTION,
    OFFLOAD,
    SIZE,
    CommaList,
    console,
    model_dimensions,
    model_options,
    offload_tiers,
    write_json,
)
from atb_mem.tools.serve import serve
from atb_mem.tools.tuning import tune


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(atb_mem.__version__, prog_name="atb-mem")
def cli() -> None:
    """atb-mem: the KV-cache memory layer of an LLM inference server."""


@cli.command()
@click.option("--total-memory", type=SIZE, required=True, help="Device memory, e.g. 80GiB.")
@click.option("--model-memory", type=SIZE, required=True, help="Weights, e.g. 16GiB.")
@model_options({})
@click.option("--max-model-len", type=click.IntRange(min=1), required=True)
@click.option("--utilization", "utilizations", type=CommaList(float, "numbers"),
              default="0.8,0.85,0.9,0.95", show_default=True,
              help="gpu_memory_utilization values to tabulate.")
@click.option("--block-sizes", type=CommaList(int, "ints"), default="16,32,64,128",
              show_default=True)
@click.option("--safety", type=click.FloatRange(0, 1, min_open=True), default=0.9,
              show_default=True)
@click.option("--kv-offload", type=OFFLOAD, multiple=True,
              help="Tiers below the device, host=SIZE and disk=PATH:SIZE: the tokens of "
                   "prefix each tier holds are tabulated.")
@KV_CACHE_DTYPE_OPTION
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
def plan(total_memory: int, model_memory: int, model_config: str | None, layers: int | None,
         kv_heads: int | None, head_dim: int | None, dtype: str | None, max_model_len: int,
         utilizations: list[float], block_sizes: list[int], safety: float,
         kv_offload: tuple[tuple[str, Any], ...], kv_cache_dtype: Any,
         json_path: str | None) -> None:
    """Capacity table: blocks, bytes per block and max_num_seqs by utilization and block size;
    with --kv-offload, the tokens of prefix the device, the host and the disk tier hold."""
    layers, kv_heads, head_dim, dtype, model = model_dimensions(model_config, layers, kv_heads,
                                                                head_dim, dtype, {})
    groups = model.group_arguments() if model is not None else {}
    offload = offload_tiers(kv_offload) or {}
    if set(offload) - {"host", "disk"}:
        raise click.BadParameter("plan sizes host=SIZE and disk=PATH:SIZE",
                                 param_hint="--kv-offload")
    host = offload.get("host", 0)
    disk = offload["disk"][1] if "disk" in offload else 0
    rows, errors = [], []
    for utilization in utilizations:
        for block_size in block_sizes:
            try:
                sizing = partial(plan_kv_cache, total_memory, model_memory,
                                 gpu_memory_utilization=utilization, block_size=block_size,
                                 num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim,
                                 dtype=dtype, max_model_len=max_model_len, safety=safety,
                                 host_offload_bytes=host, disk_offload_bytes=disk,
                                 kv_cache_dtype=kv_cache_dtype)
                result, every_block = sizing(**groups), sizing()
            except ValueError as error:
                errors.append(f"utilization {utilization}, block size {block_size}: {error}")
                continue
            rows.append({"gpu_memory_utilization": utilization, "block_size": block_size,
                         "num_blocks": result.num_blocks,
                         "bytes_per_block": result.bytes_per_block,
                         "usable_bytes": result.usable_bytes,
                         "bytes_per_seq": result.bytes_per_seq,
                         "max_num_seqs": result.max_num_seqs,
                         "num_groups": result.num_groups,
                         "device_tokens": result.device_tokens,
                         "num_host_blocks": result.num_host_blocks,
                         "host_tokens": result.host_tokens,
                         "num_disk_blocks": result.num_disk_blocks,
                         "disk_tokens": result.disk_tokens,
                         "state_blocks_per_seq": result.state_blocks_per_seq,
                         "checkpoint_bytes": result.checkpoint_bytes,
                         "max_num_seqs_keeping_every_block": every_block.max_num_seqs})
    if not rows:
        raise click.ClickException(errors[0])
    quantized = "" if kv_cache_dtype == "auto" else f", K/V in {kv_cache_dtype}"
    table = Table(title=f"KV-cache capacity ({dtype}{quantized}, max_model_len {max_model_len})")
    columns = ["utilization", "block size", "blocks", "bytes/block", "usable GiB",
               "max_num_seqs"] + (["keeping every block"] if groups else []) \
        + (["device tokens"] if host or disk else []) + (["host tokens"] if host else []) \
        + (["disk tokens"] if disk else [])
    states = rows[0]["state_blocks_per_seq"] > 0
    columns += ["state blocks/seq", "checkpoint MiB"] if states else []
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        cells = [f"{row['gpu_memory_utilization']:.2f}", str(row["block_size"]),
                 f"{row['num_blocks']:,}", f"{row['bytes_per_block']:,}",
                 f"{row['usable_bytes'] / 2**30:.2f}", f"{row['max_num_seqs']:,}"]
        if groups:
            cells.append(f"{row['max_num_seqs_keeping_every_block']:,}")
        if host or disk:
            cells.append(f"{row['device_tokens']:,}")
        if host:
            cells.append(f"{row['host_tokens']:,}")
        if disk:
            cells.append(f"{row['disk_tokens']:,}")
        if states:
            cells += [str(row["state_blocks_per_seq"]), f"{row['checkpoint_bytes'] / 2**20:.2f}"]
        table.add_row(*cells)
    console.print(table)
    if groups:
        console.print(f"{rows[0]['num_groups']} KV-cache groups: sliding-window and chunked "
                      "layers cost their window, not the full length")
    if states:
        console.print("recurrent layers: every sequence holds its states; a prefix hit resumes "
                      "from a checkpoint of them, cached beside the K/V (at most one per "
                      "state_checkpoint_interval blocks of a prefix)")
    for skipped in errors:
        console.print(f"[yellow]skipped[/yellow] {skipped}")
    write_json(json_path, {"rows": rows, "skipped": errors})


cli.add_command(bench)
cli.add_command(ctl)
cli.add_command(generate)
cli.add_command(serve)
cli.add_command(tune)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: click's errors and any failure become one line on stderr."""
    try:
        cli.main(args=list(argv) if argv is not None else None, prog_name="atb-mem",
                 standalone_mode=False)
    except click.exceptions.Exit as done:
        return done.exit_code
    except click.ClickException as error:
        print(f"atb-mem: error: {error.format_message()}", file=sys.stderr)
        return error.exit_code
    except click.exceptions.Abort:
        print("atb-mem: aborted", file=sys.stderr)
        return 130
    except (ValueError, TypeError, OSError, atb_mem.AtbMemError) as error:
        print(f"atb-mem: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The `atb-mem` command, run end to end in a child interpreter (``python -m atb_mem``, what
the console script runs too)."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import atb_mem
from atb_mem.tools.options import parse_size
from tests.support.data import AZURE_CODE_TRACE

PLAN = ["plan", "--total-memory", "80GiB", "--model-memory", "16GiB", "--layers", "32",
        "--kv-heads", "8", "--head-dim", "128", "--max-model-len", "8192"]


def atb_mem_command(*args: str) -> subprocess.CompletedProcess:
    # The module, not an installed console script: a script installed from another checkout
    # would run that checkout's code.
    return subprocess.run([sys.executable, "-m", "atb_mem", *args], capture_output=True,
                          text=True, timeout=300, check=False)


def test_plan_table_and_json_agree_with_plan_kv_cache(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    result = atb_mem_command(*PLAN, "--utilization", "0.85,0.9", "--block-sizes", "16,64",
                             "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "max_num_seqs" in result.stdout
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 4
    for row in rows:
        expected = atb_mem.plan_kv_cache(
            80 << 30, 16 << 30, gpu_memory_utilization=row["gpu_memory_utilization"],
            block_size=row["block_size"], num_layers=32, num_kv_heads=8, head_dim=128,
            dtype="float16", max_model_len=8192)
        assert row["num_blocks"] == expected.num_blocks
        assert row["max_num_seqs"] == expected.max_num_seqs
        assert row["bytes_per_block"] == 2 * 32 * row["block_size"] * 8 * 128 * 2


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_plan_counts_quantized_rows_and_their_scales(tmp_path: Path,
                                                     kv_cache_dtype: str) -> None:
    out = tmp_path / "plan.json"
    result = atb_mem_command(*PLAN, "--utilization", "0.9", "--block-sizes", "16",
                             "--kv-cache-dtype", kv_cache_dtype, "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert f"K/V in {kv_cache_dtype}" in result.stdout
    (row,) = json.loads(out.read_text())["rows"]
    # A row: 128 one-byte codes and a four-byte scale, against float16's 256 bytes.
    assert row["bytes_per_block"] == 2 * 32 * 16 * 8 * (128 + 4)
    unquantized = atb_mem.plan_kv_cache(80 << 30, 16 << 30, gpu_memory_utilization=0.9,
                                        block_size=16, num_layers=32, num_kv_heads=8,
                                        head_dim=128, dtype="float16", max_model_len=8192)
    assert row["num_blocks"] >= 1.9 * unquantized.num_blocks
    refused = atb_mem_command(*PLAN, "--kv-cache-dtype", "int4")
    assert refused.returncode != 0 and "int4" in refused.stderr


def test_plan_with_a_host_tier_says_what_each_tier_holds(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    result = atb_mem_command(*PLAN, "--block-sizes", "16,128", "--utilization", "0.9",
                             "--kv-offload", "host=64GiB", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "host tokens" in result.stdout
    for row in json.loads(out.read_text())["rows"]:
        host_blocks = (64 << 30) // row["bytes_per_block"]
        assert row["num_host_blocks"] == host_blocks
        assert row["host_tokens"] == host_blocks * row["block_size"] == 512 * 1024
        assert row["device_tokens"] == (row["num_blocks"] - 1) * row["block_size"]
    refused = atb_mem_command(*PLAN, "--kv-offload", "host=64GiB", "--kv-offload", "host=1GiB")
    assert refused.returncode == 2 and "host is given twice" in refused.stderr
    with_disk = atb_mem_command(*PLAN, "--block-sizes", "16", "--utilization", "0.9",
                                "--kv-offload", f"disk={tmp_path}:1TiB", "--json", str(out))
    assert with_disk.returncode == 0 and "disk tokens" in with_disk.stdout, with_disk.stderr
    [row] = json.loads(out.read_text())["rows"]
    assert row["num_disk_blocks"] == (1 << 40) // (row["bytes_per_block"] + 16)
    assert row["disk_tokens"] == row["num_disk_blocks"] * 16
    bad = atb_mem_command(*PLAN, "--kv-offload", "disk=1TiB")
    assert bad.returncode == 2 and "is not PATH:SIZE" in bad.stderr


def model_config(tmp_path: Path) -> Path:
    """A Gemma-3-like config.json: 32 layers, 5 sliding to 1 full, 8 KV heads of 128."""
    path = tmp_path / "config.json"
    types = ["full_attention" if (layer + 1) % 6 == 0 else "sliding_attention"
             for layer in range(32)]
    path.write_text(json.dumps({"dtype": "float16", "text_config": {
        "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "sliding_window": 1024, "layer_types": types}}))
    return path


def test_plan_from_a_model_config_counts_windows(tmp_path: Path) -> None:
    """The Gemma-like config plans KV-cache groups: sliding layers cost their window, so
    more sequences fit than the same dimensions given as flags (every block kept), which
    the table shows beside them."""
    by_flags, by_config = tmp_path / "flags.json", tmp_path / "config.json.out"
    assert atb_mem_command(*PLAN, "--json", str(by_flags)).returncode == 0
    result = atb_mem_command(*PLAN[:5], "--model-config", str(model_config(tmp_path)),
                             "--max-model-len", "8192", "--json", str(by_config))
    assert result.returncode == 0, result.stderr
    assert "7 KV-cache groups" in result.stdout and "keeping every block" in result.stdout
    flags, config = (json.loads(path.read_text())["rows"] for path in (by_flags, by_config))
    for plain, grouped in zip(flags, config, strict=True):
        assert grouped["max_num_seqs_keeping_every_block"] == plain["max_num_seqs"]
        assert grouped["max_num_seqs"] > 3 * plain["max_num_seqs"]
        assert grouped["bytes_per_block"] * 32 == plain["bytes_per_block"] * 5


def test_plan_from_a_hybrid_model_config_shows_its_states(tmp_path: Path) -> None:
    """A Granite-4.0-H-like config (Mamba2 and attention layers): the table gives the
    blocks a sequence's states take and the memory of one state checkpoint."""
    path, out = tmp_path / "config.json", tmp_path / "plan.json"
    path.write_text(json.dumps({
        "model_type": "granitemoehybrid", "num_hidden_layers": 4, "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "dtype": "bfloat16",
        "layers_block_type": ["mamba", "attention", "mamba", "attention"],
        "mamba_expand": 2, "mamba_n_heads": 8, "mamba_n_groups": 1, "mamba_d_state": 5,
        "mamba_d_conv": 4, "mamba_d_head": 16}))
    result = atb_mem_command(*PLAN[:5], "--model-config", str(path), "--max-model-len", "512",
                             "--block-sizes", "16", "--utilization", "0.9", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "checkpoint MiB" in result.stdout and "state_checkpoint_interval" in result.stdout
    [row] = json.loads(out.read_text())["rows"]
    assert row["state_blocks_per_seq"] > 0
    assert row["checkpoint_bytes"] == row["state_blocks_per_seq"] * row["bytes_per_block"]


def test_a_model_config_and_its_flags_do_not_mix(tmp_path: Path) -> None:
    both = atb_mem_command(*PLAN, "--model-config", str(model_config(tmp_path)))
    assert both.returncode == 2 and "drop --layers, --kv-heads, --head-dim" in both.stderr
    neither = atb_mem_command(*PLAN[:5], "--max-model-len", "8192")
    assert neither.returncode == 2 and "give --model-config, or --layers" in neither.stderr
    bad = tmp_path / "bad.json"
    bad.write_text('{"num_hidden_layers": 2}')
    refused = atb_mem_command(*PLAN[:5], "--model-config", str(bad), "--max-model-len", "64")
    assert refused.returncode == 2 and "num_attention_heads" in refused.stderr


def test_bench_fragmentation_sizes_tokens_from_a_model_config(tmp_path: Path) -> None:
    """Tokens sized from the config; a hybrid model also replays with KV-cache groups, which
    on the same memory keep more requests running (windows of 128 against prompts around
    300 tokens)."""
    config = model_config(tmp_path)
    hybrid = json.loads(config.read_text())
    hybrid["text_config"]["sliding_window"] = 128
    config.write_text(json.dumps(hybrid))
    out = tmp_path / "fragmentation.json"
    result = atb_mem_command("bench", "fragmentation", "--requests", "60", "--block-sizes", "16",
                             "--memory", "384MiB", "--model-config", str(config),
                             "--json", str(out))
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["bytes_per_token"] == 2 * 32 * 8 * 128 * 2
    by_strategy = {row["strategy"]: row for row in report["results"]}
    plain, grouped = by_strategy["paged"], by_strategy["paged, groups"]
    assert grouped["peak_concurrency"] > plain["peak_concurrency"], (grouped, plain)
    assert grouped["preemptions"] < plain["preemptions"]


@pytest.mark.parametrize(("args", "code", "fragment"), [
    (["plan", "--total-memory", "8XB", "--model-memory", "1", "--layers", "1", "--kv-heads", "1",
      "--head-dim", "1", "--max-model-len", "1"], 2, "not a size"),
    ([*PLAN[:4], "99GiB", *PLAN[5:]], 1, "does not fit"),
    ([*PLAN, "--utilization", "0.5,abc"], 2, "comma-separated"),
    ([*PLAN, "--dtype", "float8"], 2, "float8"),
    ([*PLAN, "--layers", "0"], 2, "layers"),
    (["plan"], 2, "Missing option"),
    ([*PLAN[:5], "--max-model-len", "64"], 2, "give --model-config"),
    (["frobnicate"], 2, "No such command"),
    ([*PLAN, "--json", "/nonexistent/dir/out.json"], 1, "No such file"),
])
def test_bad_input_is_one_line_and_a_nonzero_exit(args: list[str], code: int,
                                                  fragment: str) -> None:
    result = atb_mem_command(*args)
    assert result.returncode == code
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("atb-mem: error:") and fragment in lines[0]


def test_bench_ops_quick(tmp_path: Path) -> None:
    out = tmp_path / "ops.json"
    result = atb_mem_command("bench", "ops", "--quick", "--json", str(out))
    assert result.returncode == 0, result.stderr
    results = json.loads(out.read_text())["results"]
    assert [r["unit"] for r in results] == ["ns", "us", "us", "ns", "us"]
    assert all(r["value"] > 0 for r in results)
    assert 0.5 < results[2]["block_hit_rate"] < 1


def test_help_version_and_module_entry() -> None:
    assert atb_mem_command("--version").stdout.strip().endswith(atb_mem.__version__)
    assert "plan" in atb_mem_command("--help").stdout
    result = atb_mem_command("bench", "--help")
    assert result.returncode == 0 and "ops" in result.stdout


def test_console_script_names_the_entry_point() -> None:
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    target = re.search(r'^atb-mem = "([\w.]+):(\w+)"$', pyproject, flags=re.M)
    assert target, "pyproject.toml declares no atb-mem console script"
    module, function = target.groups()
    from atb_mem.tools.cli import main

    assert getattr(importlib.import_module(module), function) is main


def test_sizes_accept_units() -> None:
    assert parse_size("64GiB") == 64 << 30
    assert parse_size("14GB") == 14 * 10**9
    assert parse_size("1.5 TiB") == int(1.5 * 2**40)
    assert parse_size("4096") == 4096
    for bad in ("", "GiB", "-1GiB", "5 parsecs"):
        with pytest.raises(ValueError):
            parse_size(bad)


TRACE = AZURE_CODE_TRACE


@pytest.mark.parametrize("source", ["synthetic", "azure"])
def test_bench_fragmentation_numbers_are_consistent(tmp_path: Path, source: str) -> None:
    out = tmp_path / "fragmentation.json"
    args = ["bench", "fragmentation", "--requests", "200", "--block-sizes", "1,16,256",
            "--memory", "2GiB", "--json", str(out)]
    if source == "azure":
        args += ["--trace", str(TRACE)]
    result = atb_mem_command(*args)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    by_name = {(r["strategy"], r["block_size"]): r for r in report["results"]}
    paged = [by_name[("paged", size)] for size in (1, 16, 256)]
    contiguous_max = by_name[("contiguous-max", None)]
    exact = by_name[("contiguous-exact", None)]
    assert paged[0]["internal_fragmentation"] == 0  # a block of one slot is always full
    assert [p["internal_fragmentation"] for p in paged] == sorted(
        p["internal_fragmentation"] for p in paged)
    assert contiguous_max["internal_fragmentation"] > paged[1]["internal_fragmentation"]
    assert contiguous_max["peak_concurrency"] <= paged[1]["peak_concurrency"]
    # contiguous-max reserves max_model_len per running sequence: its reserved token-seconds
    # are that times the time-integral of concurrency (mean concurrency × makespan of steps).
    steps_time = contiguous_max["reserved_token_seconds"] / report["max_model_len"]
    assert steps_time / contiguous_max["mean_concurrency"] <= contiguous_max["makespan"] + 1e-9
    assert exact["external_fragmentation"] is not None
    assert paged[1]["external_fragmentation"] is None
    for result in report["results"]:
        assert result["requests"] == 200
        assert result["throughput"] == pytest.approx(result["output_tokens"] / result["makespan"])
        assert 0 <= result["internal_fragmentation"] < 1
        assert result["latency_p50"] <= result["latency_p90"] <= result["latency_p99"]
        assert result["internal_fragmentation"] == pytest.approx(
            1 - result["used_token_seconds"] / result["reserved_token_seconds"])
        assert 1 <= result["mean_concurrency"] <= result["peak_concurrency"]


def test_bench_fragmentation_plot(tmp_path: Path) -> None:
    png = tmp_path / "fragmentation.png"
    result = atb_mem_command("bench", "fragmentation", "--requests", "50", "--block-sizes",
                             "16", "--plot", str(png))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert result.returncode == 1 and "pip install 'atb-mem[plot]'" in result.stderr
        assert "Traceback" not in result.stderr
    else:
        assert result.returncode == 0 and png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(("content", "fragment"), [
    (None, "does not exist"),
    ("time,prompt,output\n1,2,3\n", "expected columns"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.1,-5,3\n", "line 2"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.1,5,3\n"
     "2023-11-16 18:17:01.1,5,3\n", "not sorted"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,5,3\n", "cannot parse"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "no requests"),
])
def test_bad_traces_are_refused_in_one_line(tmp_path: Path, content: str | None,
                                            fragment: str) -> None:
    trace = tmp_path / "trace.csv"
    if content is not None:
        trace.write_text(content)
    result = atb_mem_command("bench", "fragmentation", "--trace", str(trace))
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and "Traceback" not in result.stderr


def test_tune_finds_the_best_feasible_configuration(tmp_path: Path) -> None:
    out = tmp_path / "tune.json"
    result = atb_mem_command("tune", "--trace", str(TRACE), "--requests", "120", "--trials",
                             "12", "--latency-p99", "30", "--speedup", "20", "--json", str(out))
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    feasible = [t for t in report["trials"] if "infeasible" not in t]
    assert len(report["trials"]) == 12 and feasible
    assert report["best"]["value"] == max(t["value"] for t in feasible)
    assert report["best"]["latency_p99"] <= 30
    assert len({round(t["value"], 6) for t in feasible}) > 1  # the search space matters here
    assert all(t["value"] == 0 for t in report["trials"] if "infeasible" in t)
    for trial in report["trials"]:
        assert trial["block_size"] in (8, 16, 32, 64, 128)
        assert 0.5 <= trial["gpu_memory_utilization"] <= 0.99


def test_tune_picks_the_eviction_policy_by_replaying_it(tmp_path: Path) -> None:
    """A cache too small for the trace's prefixes (4 GiB at most for the KV): the policies
    differ, and the one that saved the most prefill is the one named."""
    out = tmp_path / "tune.json"
    result = atb_mem_command("tune", "--trace", str(TRACE), "--requests", "200", "--trials",
                             "6", "--latency-p99", "1000", "--total-memory", "20GiB",
                             "--model-memory", "16GiB", "--activation-bytes-per-token", "1KiB",
                             "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "eviction policy at" in result.stdout
    report = json.loads(out.read_text())
    rows = report["eviction_policies"]
    assert {row["eviction_policy"] for row in rows} == {"lru", "lfu", "slru", "priority"}
    saved = [row["prefill_tokens_saved"] for row in rows]
    assert saved == sorted(saved, reverse=True) and saved[0] > saved[-1]
    assert report["best"]["eviction_policy"] == rows[0]["eviction_policy"]
    assert report["best"]["hash_block_size"] == rows[0]["hash_block_size"]


def test_tune_refuses_impossible_bounds_in_one_line() -> None:
    for args, fragment in [
        (["--latency-p99", "0.000001", "--trials", "3", "--requests", "30"], "no configuration"),
        (["--latency-p99", "5", "--model-memory", "90GiB"], "model"),
        (["--latency-p99", "-1"], "latency-p99"),
        (["--latency-p99", "5", "--policies", "lru,mru"], "unknown eviction policies"),
    ]:
        result = atb_mem_command("tune", *args)
        lines = result.stderr.strip().splitlines()
        assert result.returncode != 0 and len(lines) == 1 and fragment in lines[0]


def test_bench_prefix_compares_policies_on_the_same_replay(tmp_path: Path) -> None:
    out = tmp_path / "prefix.json"
    result = atb_mem_command("bench", "prefix", "--trace", str(TRACE), "--requests", "300",
                             "--cache-blocks", "256,1024,4096", "--block-sizes", "16",
                             "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "hit rate" in result.stdout
    rows = json.loads(out.read_text())["rows"]
    assert {row["policy"] for row in rows} == {"lru", "lfu", "slru", "priority"}
    for row in rows:
        assert 0 <= row["hit_rate"] <= 1
        assert row["prefill_tokens_saved"] == pytest.approx(row["hit_rate"] *
                                                            row["prompt_tokens"])
    # LRU is a stack algorithm: a larger cache never hits less on the same replay.
    lru = [row["prefill_tokens_saved"] for row in rows if row["policy"] == "lru"]
    assert lru == sorted(lru) and lru[0] < lru[-1]
    # The same requests for every policy at a size: prompts replayed agree.
    for size in {row["cache_tokens"] for row in rows}:
        assert len({row["prompt_tokens"] for row in rows if row["cache_tokens"] == size}) == 1
    bad = atb_mem_command("bench", "prefix", "--trace", str(TRACE), "--policies", "mru")
    assert bad.returncode == 1 and "unknown eviction_policy 'mru'" in bad.stderr
    bad = atb_mem_command("bench", "prefix", "--trace", str(TRACE), "--hash-block-sizes", "0")
    assert bad.returncode != 0 and "block sizes must be >= 1" in bad.stderr


def test_bench_prefix_with_hits_finer_than_a_block(tmp_path: Path) -> None:
    """System prompts and conversation histories end inside 128-token blocks: hits every 16
    tokens on those blocks save prefill whole-block hits do not, on the same replay."""
    out = tmp_path / "prefix.json"
    result = atb_mem_command("bench", "prefix", "--trace", str(TRACE), "--requests", "300",
                             "--cache-blocks", "256,1024", "--block-sizes", "16,128",
                             "--hash-block-sizes", "16,32", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "128/16" in result.stdout and "128/32" in result.stdout
    rows = json.loads(out.read_text())["rows"]
    assert not any(row["block"] == "16/16" for row in rows)
    by = {(row["cache_tokens"], row["policy"], row["block"]): row for row in rows}
    # On this replay LRU saves more with the pieces at both sizes; the other policies count
    # a partial hit's source as a hit, which shifts their evictions either way.
    for (tokens, policy, block), row in by.items():
        if block == "128/16" and policy == "lru":
            plain = by[(tokens, policy, "128")]["prefill_tokens_saved"]
            assert row["prefill_tokens_saved"] > plain, (tokens, policy)
            assert row["hash_block_size"] == 16 and row["block_size"] == 128


def test_bench_prefix_plot(tmp_path: Path) -> None:
    png = tmp_path / "prefix.png"
    result = atb_mem_command("bench", "prefix", "--trace", str(TRACE), "--requests", "50",
                             "--block-sizes", "16", "--cache-blocks", "64,256",
                             "--plot", str(png))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert result.returncode == 1 and "pip install 'atb-mem[plot]'" in result.stderr
    else:
        assert result.returncode == 0 and png.read_bytes()[:4] == b"\x89PNG"

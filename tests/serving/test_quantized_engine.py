"""An Engine over quantized KV blocks (``kv_cache_dtype="int8"`` / ``"fp8_e4m3"``).

A token's quantized rows depend on its own K/V alone, so with quantized KV every request's
greedy tokens are the same whether its prefix was recomputed, hit in the device cache,
promoted from the host tier, loaded from the disk tier or from Mooncake (a real
``mooncake_master`` on 127.0.0.1), or its sequence swapped out and back
(unused blocks poisoned so that they read back as NaN; eager and compiled), on Llama, Qwen3
and Gemma 3 (sliding-window layers). The negative control rescales the cached rows of a
prefix: the hit that reads them then gives other tokens, so the comparison can fail. The torch
reference path (CUDA's) writes the kernel's bytes and gives its tokens; bf16 rows on SDPA read
what their rows hold. Bad combinations are refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atb_mem.serving import Engine, SamplingParams
from atb_mem.serving.kv_sizing import kv_cache_shape
from tests.support.models import first_samples, model_pair, random_prompt, run_poisoned
from tests.support.mooncake import mooncake_master

QUANTIZED = ["int8", "fp8_e4m3"]
ARCHITECTURES = ["llama", "qwen3", "gemma3"]  # Gemma 3: sliding-window and full layers
# The disk tier and Mooncake serve models of full-attention layers only (any kv_cache_dtype).
FULL_ATTENTION = ["llama", "qwen3"]


def groups(architecture: str) -> int:
    """KV-cache groups of the model: each takes a block of its own per four tokens."""
    return 2 if architecture == "gemma3" else 1
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPT = random_prompt(21, 26)
FOLLOW_UP = [*PROMPT[:20], *random_prompt(22, 7)]  # shares its first five blocks


def tokens(engine: Engine, label: str, prompt: list[int]) -> list[int]:
    result: list[int] = run_poisoned(engine, {0: [(label, prompt, GREEDY)]})[label][0][0]
    return result


def engine(model: Any, kv_cache_dtype: str, **kwargs: Any) -> Engine:
    return Engine(model, num_blocks=48, block_size=4, kv_cache_dtype=kv_cache_dtype, **kwargs)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_a_prefix_hit_reads_what_a_recompute_writes(architecture: str,
                                                    kv_cache_dtype: str) -> None:
    model, _ = model_pair(architecture)
    recomputing = engine(model, kv_cache_dtype, enable_prefix_caching=False, enforce_eager=True)
    want = [tokens(recomputing, "a", PROMPT), tokens(recomputing, "b", FOLLOW_UP)]
    for enforce_eager in (True, False):
        hitting = engine(model, kv_cache_dtype, enforce_eager=enforce_eager)
        assert tokens(hitting, "a", PROMPT) == want[0]
        assert hitting.kv_cache.explain_prefix(FOLLOW_UP).hit_tokens == 20
        assert tokens(hitting, "b", FOLLOW_UP) == want[1], (architecture, enforce_eager)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_the_torch_reference_writes_and_reads_rows_as_the_kernel_does(
        architecture: str, kv_cache_dtype: str, device: str) -> None:
    """The reference path (CUDA's; on the CPU with ``attention_backend="torch"``): its hits
    and recomputes give the CPU kernel's tokens, and on the CPU the first layer's rows (its
    K/V comes from the embeddings alone) are the kernel's byte for byte."""
    model, _ = model_pair(architecture)
    kernel = engine(model, kv_cache_dtype, enforce_eager=True)
    want = [tokens(kernel, "a", PROMPT), tokens(kernel, "b", FOLLOW_UP)]
    for enable_prefix_caching in (False, True):
        reference = engine(model.to(device), kv_cache_dtype, attention_backend=(
            "torch" if device == "cpu" else "auto"), enable_prefix_caching=enable_prefix_caching)
        assert reference.runner.kernel is None
        got = [tokens(reference, "a", PROMPT)]
        hit = reference.kv_cache.explain_prefix(FOLLOW_UP).hit_tokens
        got.append(tokens(reference, "b", FOLLOW_UP))
        assert (got, hit) == (want, 20 if enable_prefix_caching else 0), architecture
    if device == "cpu":  # a GPU's projections round otherwise
        layer_0 = [cached_rows(serving, PROMPT[:20])[0] for serving in (kernel, reference)]
        assert bool((layer_0[0] == layer_0[1]).all())


def cached_rows(serving: Engine, prefix: list[int]) -> Any:
    """The rows of the blocks the prefix cache holds for ``prefix``: a sequence that hits
    them, looked at and let go."""
    kv_cache = serving.kv_cache
    kv_cache.alloc_sequence(1 << 40, prefix)
    blocks = kv_cache.block_table(1 << 40)[:-1]         # the last one is the new token's
    assert kv_cache.num_computed(1 << 40) == len(prefix) - 4
    rows = kv_cache.kv_cache[:, :, blocks.tolist()].clone()
    kv_cache.free_sequence(1 << 40)
    return rows


@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_rescaled_cached_rows_change_the_tokens_of_a_hit(kv_cache_dtype: str) -> None:
    """The negative control: the same hit over rows whose scales were changed."""
    model, _ = model_pair("llama")
    hitting = engine(model, kv_cache_dtype, enforce_eager=True)
    tokens(hitting, "a", PROMPT)
    want = tokens(hitting, "b", FOLLOW_UP)
    cache = hitting.kv_cache
    cached = [int(block) for block in np.flatnonzero(np.isin(
        np.arange(cache.num_blocks), cache.unused_blocks(), invert=True))[1:]]
    rows = cache.kv_cache[:, :, cached]                 # [layers, 2, blocks, slots, heads, row]
    head_dim = cache.head_dim
    if kv_cache_dtype == "int8":  # the bfloat16 scale: one more to its exponent doubles it
        scale = rows[..., head_dim:head_dim + 2].contiguous().view(dtype=_torch().int16)
        rows[..., head_dim:head_dim + 2] = (scale + 128).view(dtype=_torch().uint8)
    else:  # the f32 scale, doubled
        scale = rows[..., head_dim:head_dim + 4].contiguous().view(dtype=_torch().float32)
        rows[..., head_dim:head_dim + 4] = (scale * 2).view(dtype=_torch().uint8)
    cache.kv_cache[:, :, cached] = rows
    assert cache.explain_prefix(FOLLOW_UP).hit_tokens >= 20
    assert tokens(hitting, "c", FOLLOW_UP) != want


def _torch() -> Any:
    import torch

    return torch


@pytest.mark.parametrize("architecture", FULL_ATTENTION)
@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_the_disk_tier_serves_quantized_blocks_to_their_own_dtype_only(
        architecture: str, kv_cache_dtype: str, tmp_path: Path) -> None:
    model, _ = model_pair(architecture)
    recomputing = engine(model, kv_cache_dtype, enable_prefix_caching=False, enforce_eager=True)
    want = tokens(recomputing, "a", FOLLOW_UP)

    def disk_engine(kind: str) -> Engine:
        return Engine(model, num_blocks=12, block_size=4, max_num_seqs=1, enforce_eager=True,
                      kv_offload={"disk": (str(tmp_path), "16MiB")}, kv_cache_dtype=kind)

    def on_disk(serving: Engine) -> int:
        assert serving.tiers is not None
        return sum(count for medium, count in serving.tiers.explain_prefix(FOLLOW_UP).tiers
                   if medium == "disk")

    writer = disk_engine(kv_cache_dtype)
    for round_ in range(2):  # saves of one step land while the next runs
        tokens(writer, f"w{round_}", PROMPT)
        assert writer.tiers is not None and writer.tiers.wait_for_saves(60)
    writer.shutdown()
    # Another dtype's engine finds nothing: the dtype is part of the blocks' keys.
    other = "auto" if kv_cache_dtype != "auto" else "int8"
    assert on_disk(disk_engine(other)) == 0
    reader = disk_engine(kv_cache_dtype)
    assert on_disk(reader) == 20
    assert tokens(reader, "r", FOLLOW_UP) == want
    reader.shutdown()


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_prefixes_promoted_from_the_host_tier_give_a_recomputes_tokens(
        architecture: str, kv_cache_dtype: str) -> None:
    """A device of 7 usable blocks (per group) keeps one request: each repeated prompt's
    prefix comes from the host."""
    model, _ = model_pair(architecture)
    prompts = [random_prompt(30 + seed, 13) for seed in range(4)]  # 3 blocks, 5 with outputs
    recomputing = engine(model, kv_cache_dtype, enable_prefix_caching=False, enforce_eager=True)
    want = [tokens(recomputing, f"a{index}", prompt) for index, prompt in enumerate(prompts)]
    offloading = Engine(model, num_blocks=8 * groups(architecture), block_size=4,
                        max_num_seqs=1, enforce_eager=True,
                        kv_offload={"host": 64 * 1024 * groups(architecture)},
                        kv_cache_dtype=kv_cache_dtype)
    for round_ in range(2):
        got = [tokens(offloading, f"{round_}-{index}", prompt)
               for index, prompt in enumerate(prompts)]
        assert got == want, round_
    assert offloading.kv_cache.stats()["prefix_cache_host_hit_tokens"] >= 3 * 12


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_sequences_swapped_out_and_back_give_a_roomy_caches_tokens(
        architecture: str, kv_cache_dtype: str) -> None:
    model, _ = model_pair(architecture)
    prompts = [random_prompt(40 + seed, 9) for seed in range(4)]
    arrivals = {0: [(f"r{index}", prompt, GREEDY) for index, prompt in enumerate(prompts)]}
    roomy = engine(model, kv_cache_dtype, enforce_eager=True)
    want = first_samples(roomy, arrivals)
    swapping = Engine(model, num_blocks=8 * groups(architecture), block_size=4,
                      max_num_seqs=4, enforce_eager=True, preemption="swap",
                      num_host_blocks=32 * groups(architecture), kv_cache_dtype=kv_cache_dtype)
    got = first_samples(swapping, arrivals)
    assert swapping.scheduler.stats()["preemptions"] > 0
    assert got == want


@pytest.mark.parametrize("architecture", FULL_ATTENTION)
@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_prefixes_loaded_from_mooncake_give_a_recomputes_tokens(
        architecture: str, kv_cache_dtype: str) -> None:
    """A device that keeps no earlier prompt: the second round's prefixes come from the store."""
    model, _ = model_pair(architecture)
    prompts = [random_prompt(50 + seed, 13) for seed in range(3)]
    recomputing = engine(model, kv_cache_dtype, enable_prefix_caching=False, enforce_eager=True)
    want = [tokens(recomputing, f"a{index}", prompt) for index, prompt in enumerate(prompts)]
    with mooncake_master() as master:
        storing = Engine(model, num_blocks=8, block_size=4, max_num_seqs=1, enforce_eager=True,
                         kv_store=master.url, kv_cache_dtype=kv_cache_dtype)
        try:
            assert storing.tiers is not None
            for round_ in range(2):
                got = [tokens(storing, f"{round_}-{index}", prompt)
                       for index, prompt in enumerate(prompts)]
                assert got == want, round_
                assert storing.tiers.wait_for_saves(60)
            assert storing.tiers.counters.loaded_by_tier == {"MOONCAKE": 3 * len(prompts)}
        finally:
            storing.shutdown()


def test_bad_kv_cache_dtypes_and_combinations_are_refused() -> None:
    model, _ = model_pair("llama")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        Engine(model, num_blocks=16, block_size=4, kv_cache_dtype="int4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="FlashInfer does not read"):
        Engine(model, num_blocks=16, block_size=4, kv_cache_dtype="int8",
               attention_backend="flashinfer")
    assert kv_cache_shape(model, 1, "fp8_e4m3")["kv_cache_dtype"] == "fp8_e4m3"
    assert "kv_cache_dtype" not in kv_cache_shape(model)


@pytest.mark.parametrize("architecture", ["qwen3", "gemma3"])
@pytest.mark.parametrize("kv_cache_dtype", QUANTIZED)
def test_bf16_rows_on_sdpa_read_what_their_rows_hold(architecture: str, kv_cache_dtype: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 on a CPU with AMX tiles: rows of 16 new tokens or more take torch's SDPA over what
    their rows read back as (fresh rows over their own, a later chunk and a prefix hit over
    the rows gathered from the cache), so a hit gives a recompute's tokens, and the kernel
    alone (reading the same rows) gives them too."""
    from atb_mem.integrations.cpu_attention import CpuPagedAttention, CpuPagedStep

    torch = _torch()
    model = model_pair(architecture)[0].to(torch.bfloat16)
    long = random_prompt(40, 60)
    arrivals = {0: [("long", long, GREEDY)],  # chunks of 24 after 0 and 24 cached
                12: [("hit", long[:48] + random_prompt(41, 20), GREEDY)]}
    from atb_mem.integrations import cpu_attention
    from atb_mem.kv.quantized_rows import dequantize_tensor_rows

    contexts: list[int] = []
    keys: list[Any] = []                          # what SDPA is given, in the split's order
    attend_split, sdpa = CpuPagedStep._attend_split, cpu_attention.sdpa_attention

    def spy(self: CpuPagedStep, split: Any, group: int, kind: Any, queries: Any,
            caches: Any, *args: Any) -> Any:
        keys.clear()
        out = attend_split(self, split, group, kind, queries, caches, *args)
        for (start, end), context, key in zip(split.sdpa_rows, split.contexts, keys,
                                              strict=True):
            slots = split.slots[start:end] if context is None else context.slots
            held = dequantize_tensor_rows(caches[0][slots], kv_cache_dtype)
            assert torch.equal(key[0].transpose(0, 1), held.to(torch.bfloat16))
            contexts.append(0 if context is None else len(slots))
        return out

    def sdpa_spy(query: Any, key: Any, *args: Any) -> Any:
        keys.append(key)
        return sdpa(query, key, *args)

    monkeypatch.setattr(CpuPagedStep, "_attend_split", spy)
    monkeypatch.setattr(cpu_attention, "sdpa_attention", sdpa_spy)

    def serve(sdpa: bool, **kwargs: Any) -> dict[str, list[int]]:
        serving = Engine(model, num_blocks=64, block_size=4, max_num_seqs=6,
                         max_num_batched_tokens=24, kv_cache_dtype=kv_cache_dtype, **kwargs)
        kernel = serving.runner.kernel
        assert isinstance(kernel, CpuPagedAttention)
        if not sdpa:
            kernel.sdpa_min_tokens = None
        return first_samples(serving, arrivals)

    hitting = serve(sdpa=True)
    if CpuPagedAttention(4, torch.bfloat16).sdpa_min_tokens is not None:
        assert {0, 48, 68} <= set(contexts), contexts   # fresh, a later chunk, the hit
    assert serve(sdpa=True, enable_prefix_caching=False) == hitting
    assert serve(sdpa=False) == hitting

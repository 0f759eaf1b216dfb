"""The FlashInfer path: the CSR page tables, the backend choice, and the engine running every
layer FlashInfer can compute through its wrapper — on the CPU through
``tests/support/fake_flashinfer.py`` (FlashInfer's documented semantics in torch), on CUDA
through the real kernel (``-m cuda``). Greedy tokens equal HF's ``generate`` with unused
blocks and the null block NaN-poisoned; negative controls show a wrong window or a table that
keeps released blocks is caught."""

from __future__ import annotations

import sys
import warnings
from typing import Any

import numpy as np
import pytest

from atb_mem.integrations import attention_backends as backends
from atb_mem.integrations import flashinfer as kernels
from atb_mem.integrations.cpu_attention import CpuPagedAttention
from atb_mem.serving import Engine, SamplingParams
from tests.support import fake_flashinfer, models
from tests.support.models import WINDOW, hf_greedy, model_pair, require_transformers

BLOCK_SIZE = 4


def prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 256, size=length).tolist()


# ---- the page table ---------------------------------------------------------------------------

def test_page_table_lists_each_rows_pages_and_last_fill() -> None:
    tables = np.array([[3, 4, 0, 0], [5, 6, 0, 0], [7, 0, 0, 0]], dtype=np.int32)
    table = kernels.PageTable.from_plan(np.array([5, 1, 1]), np.array([5, 8, 1]), tables,
                                        BLOCK_SIZE)
    assert table.qo_indptr.tolist() == [0, 5, 6, 7]
    assert table.kv_indptr.tolist() == [0, 2, 4, 5]
    assert table.kv_indices.tolist() == [3, 4, 5, 6, 7]
    assert table.kv_last_page_len.tolist() == [1, 4, 1]
    assert {array.dtype for array in vars(table).values()} == {np.dtype(np.int32)}


def test_page_table_drops_blocks_a_window_released() -> None:
    tables = np.array([[0, 0, 8, 9, 0], [0, 2, 3, 0, 0]], dtype=np.int32)
    table = kernels.PageTable.from_plan(np.array([1, 2]), np.array([14, 11]), tables,
                                        BLOCK_SIZE)
    assert table.kv_indptr.tolist() == [0, 2, 4]
    assert table.kv_indices.tolist() == [8, 9, 2, 3]
    assert table.kv_last_page_len.tolist() == [2, 3]


@pytest.mark.parametrize("row", [[0, 5, 0, 9], [0, 0, 0, 0], [5, 6, 0, 0]])
def test_page_table_refuses_rows_that_are_not_a_live_run(row: list[int]) -> None:
    with pytest.raises(ValueError, match="not a run of live blocks"):
        kernels.PageTable.from_plan(np.array([1]), np.array([14]), np.array([row]), BLOCK_SIZE)


# ---- choosing the backend -------------------------------------------------------------------

def choose(backend: Any, device: str = "cpu") -> Any:
    torch = models.require_torch()
    return backends.attention_kernel(backend, device, 4, 2, 16, BLOCK_SIZE, torch.float32)


def test_auto_on_the_cpu_is_atb_mems_kernel_and_torch_the_reference() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert isinstance(choose("auto"), CpuPagedAttention)
        assert isinstance(choose("cpu"), CpuPagedAttention)
        assert choose("torch") is None
    with pytest.raises(ValueError, match="runs on the CPU"):
        choose("cpu", "cuda")


def test_without_flashinfer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import fails
    with pytest.raises(RuntimeError, match="FlashInfer cannot serve this model here"):
        choose("flashinfer")
    with pytest.warns(UserWarning, match="using the torch reference attention") as caught:
        assert choose("auto", "cuda") is None  # fails at the import, before touching CUDA
    assert len(caught) == 1 and "\n" not in str(caught[0].message)


def test_an_unknown_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        choose("flash")


# ---- the engine over FlashInfer's semantics (CPU) ---------------------------------------------

@pytest.fixture
def fake_kernel(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """FlashInfer's documented semantics as the ``flashinfer`` module; the null block is
    poisoned with the unused ones before every step. Returns the kernel's calls."""
    require_transformers()
    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer.module())
    poison = models.poison_unused_blocks

    def poison_with_null(kv_cache: Any) -> int:
        kv_cache.kv_cache[:, :, 0] = float("nan")
        return poison(kv_cache) + 1

    monkeypatch.setattr(models, "poison_unused_blocks", poison_with_null)
    fake_flashinfer.CALLS.clear()
    return fake_flashinfer.CALLS


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def arrivals() -> dict[int, list[tuple[str, list[int], SamplingParams]]]:
    """Prompts past 3 windows, arriving mid-way, sharing a prefix; few blocks: preemption."""
    shared = prompt(100, 3 * WINDOW)
    specs = [(0, "a", prompt(1, 11), 2 * WINDOW), (0, "b", prompt(2, 5), 3),
             (0, "c", shared, 3 * WINDOW), (2, "d", prompt(3, 17), 9),
             (2, "e", [*shared, 7, 8], WINDOW), (5, "f", [*shared[:2 * WINDOW], 42], 12)]
    out: dict[int, list[tuple[str, list[int], SamplingParams]]] = {}
    for step, request_id, tokens, max_tokens in specs:
        out.setdefault(step, []).append((request_id, tokens, greedy(max_tokens)))
    return out


BLOCKS = {"llama": 16, "qwen3": 16, "mistral": 14, "gemma3": 28, "gpt_oss": 28, "llama4": 20}


def mismatches(architecture: str) -> tuple[list[str], Engine]:
    model, reference = model_pair(architecture)
    reference.generation_config.eos_token_id = None  # like ignore_eos
    engine = Engine(model, num_blocks=BLOCKS[architecture], block_size=BLOCK_SIZE,
                    max_num_seqs=5, max_num_batched_tokens=24, attention_backend="flashinfer")
    results = models.run_poisoned(engine, arrivals())
    wrong = [request_id for requests in arrivals().values()
             for request_id, tokens, params in requests
             if results[request_id][0][0] != hf_greedy(reference, tokens, params.max_tokens)]
    return wrong, engine


@pytest.mark.parametrize("architecture", list(BLOCKS))
def test_the_engine_on_the_kernel_matches_hf(architecture: str,
                                             fake_kernel: list[dict[str, Any]]) -> None:
    wrong, engine = mismatches(architecture)
    assert wrong == []
    assert engine.scheduler.stats()["preemptions"] > 0
    assert engine.kv_cache.stats()["prefix_cache_hits"] > 0
    assert engine.kv_cache.stats()["blocks_used"] == 0
    windows = {call["window_left"] for call in fake_kernel[1:]}  # [0] is the start-up probe
    # Sliding layers run on the kernel with their window; chunked layers and gpt-oss's sinks
    # stay on the reference (gpt-oss: every layer has sinks, nothing runs on the kernel).
    expected = {"llama": {-1}, "qwen3": {-1}, "mistral": {WINDOW - 1},
                "gemma3": {-1, WINDOW - 1}, "gpt_oss": set(), "llama4": {-1}}
    assert windows == expected[architecture]


def test_a_kernel_without_the_window_is_caught(fake_kernel: list[dict[str, Any]],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    plan = fake_flashinfer.BatchPrefillWithPagedKVCacheWrapper.plan

    def no_window(self: Any, *args: Any, **kwargs: Any) -> None:
        plan(self, *args, **{**kwargs, "window_left": -1})

    monkeypatch.setattr(fake_flashinfer.BatchPrefillWithPagedKVCacheWrapper, "plan", no_window)
    wrong, _ = mismatches("mistral")
    assert wrong


def test_a_page_table_keeping_released_blocks_is_caught(fake_kernel: list[dict[str, Any]],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Listing the null blocks a window left behind reads the poisoned null block."""
    def untrimmed(query_lens: Any, seq_lens: Any, tables: np.ndarray,
                  block_size: int) -> kernels.PageTable:
        pages = -(-np.asarray(seq_lens) // block_size)
        return kernels.PageTable(
            qo_indptr=np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32),
            kv_indptr=np.concatenate([[0], np.cumsum(pages)]).astype(np.int32),
            kv_indices=np.concatenate([row[:n] for row, n in zip(tables, pages, strict=True)])
            .astype(np.int32),
            kv_last_page_len=(seq_lens - (pages - 1) * block_size).astype(np.int32))

    monkeypatch.setattr(kernels.PageTable, "from_plan", untrimmed)
    wrong, _ = mismatches("mistral")
    assert wrong


# ---- the real kernel (CUDA) -------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("architecture", ["llama", "gemma3"])
def test_flashinfer_on_cuda_matches_hf(architecture: str) -> None:
    """fp16, head_dim 64 (a size FlashInfer builds): the same arrivals as above."""
    torch = models.require_torch()
    pytest.importorskip("flashinfer", reason="FlashInfer does not install on this machine")
    transformers = require_transformers()
    shared = {"vocab_size": 256, "hidden_size": 256, "intermediate_size": 512,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 64, "max_position_embeddings": 512}
    torch.manual_seed(0)
    if architecture == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shared))
    else:
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            **shared, sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"]))
    reference = model.to("cuda", torch.float16).eval()
    reference.generation_config.eos_token_id = None
    import copy

    engine = Engine(copy.deepcopy(reference), num_blocks=48, block_size=16, max_num_seqs=5,
                    max_num_batched_tokens=24, attention_backend="flashinfer")
    assert engine.runner.kernel is not None
    results = models.run_poisoned(engine, arrivals())
    for requests in arrivals().values():
        for request_id, tokens, params in requests:
            assert results[request_id][0][0] == hf_greedy(reference, tokens, params.max_tokens)
    assert engine.kv_cache.stats()["blocks_used"] == 0

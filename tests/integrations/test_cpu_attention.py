"""``_core.paged_attention``, the CPU kernel behind ``CpuPagedAttention``, through its binding:
every dtype equals softmax attention in float64 over each row's K/V gathered through its
scrambled block table (unused slots and the null block NaN-poisoned), causal, sliding, chunked
and with sinks; the slot write stores exactly the new rows; bad input is a ValueError naming
the problem that leaves ``out`` and the caches as they were, and the next good call is right."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from atb_mem import _core
from atb_mem.integrations.cpu_attention import numpy_bits, share_torchs_threads
from tests.support.devices import require_torch

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 8, 4, 24
SCALE = HEAD_DIM**-0.5
ROWS = ((1, 9), (1, 4), (5, 13), (6, 6), (1, 22))
"""(query_len, seq_len): decodes over cached context, a later prefill chunk, a first chunk."""
TOKENS = sum(query_len for query_len, _ in ROWS)
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2, "float16": 2e-3}
VISIBILITY: dict[str, dict[str, int]] = {"causal": {}, "window": {"window": 5},
                                         "chunk": {"chunk": 6}}


@dataclass
class Step:
    """One layer's step: torch tensors of ``dtype`` and the rows' int32 plan."""

    dtype: str
    query: Any
    key_cache: Any
    value_cache: Any
    out: Any
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray

    def args(self, **overrides: Any) -> dict[str, Any]:
        """The binding's arguments over numpy views of the step's own memory."""
        return {"query": numpy_bits(self.query), "key_cache": numpy_bits(self.key_cache),
                "value_cache": numpy_bits(self.value_cache), "out": numpy_bits(self.out),
                "query_start_loc": self.query_start_loc, "seq_lens": self.seq_lens,
                "block_tables": self.block_tables, "block_size": BLOCK_SIZE, "scale": SCALE,
                "dtype": self.dtype, **overrides}

    def snapshot(self) -> dict[str, bytes]:
        return {name: numpy_bits(getattr(self, name)).tobytes()
                for name in ("out", "key_cache", "value_cache")}

    def changed_since(self, snapshot: dict[str, bytes]) -> list[str]:
        return [name for name, now in self.snapshot().items() if now != snapshot[name]]

    def slot(self, row: int, position: int) -> int:
        return int(self.block_tables[row, position // BLOCK_SIZE]) * BLOCK_SIZE \
            + position % BLOCK_SIZE


def make_step(dtype: str, seed: int, window: int | None = None, chunk: int | None = None) -> Step:
    """Random K/V at every row's positions in scrambled blocks; NaN everywhere else, the null
    block included — and in place of the blocks before a row's window or chunk."""
    torch = require_torch()
    generator = torch.Generator().manual_seed(seed)
    kind = getattr(torch, dtype)
    caches = [torch.full((NUM_BLOCKS * BLOCK_SIZE, KV_HEADS, HEAD_DIM), float("nan"),
                         dtype=kind) for _ in range(2)]
    blocks = iter(np.random.default_rng(seed).permutation(np.arange(1, NUM_BLOCKS)).tolist())
    tables = np.zeros((len(ROWS), 7), dtype=np.int32)
    for row, (query_len, seq_len) in enumerate(ROWS):
        first = 0  # the first position the row's first query sees
        if window is not None:
            first = max(seq_len - query_len - window + 1, 0)
        elif chunk is not None:
            first = (seq_len - query_len) // chunk * chunk
        for index in range(first // BLOCK_SIZE, (seq_len - 1) // BLOCK_SIZE + 1):
            tables[row, index] = next(blocks)
            start = int(tables[row, index]) * BLOCK_SIZE
            count = min(BLOCK_SIZE, seq_len - index * BLOCK_SIZE)
            for cache in caches:
                cache[start:start + count] = torch.randn(count, KV_HEADS, HEAD_DIM,
                                                         generator=generator).to(kind)
    query = torch.randn(TOKENS, HEADS, HEAD_DIM, generator=generator).to(kind)
    starts = np.concatenate([[0], np.cumsum([query_len for query_len, _ in ROWS])])
    return Step(dtype, query, caches[0], caches[1], torch.full_like(query, float("nan")),
                starts.astype(np.int32), np.array([s for _, s in ROWS], dtype=np.int32), tables)


def reference(step: Step, window: int | None = None, chunk: int | None = None,
              sinks: np.ndarray | None = None) -> Any:
    """Softmax attention in float64 from the step's rounded values, row by row."""
    torch = require_torch()
    out = torch.zeros(step.query.shape, dtype=torch.float64)
    for row, (query_len, seq_len) in enumerate(ROWS):
        for i in range(query_len):
            token, position = int(step.query_start_loc[row]) + i, seq_len - query_len + i
            visible = [j for j in range(position + 1)
                       if (window is None or j > position - window)
                       and (chunk is None or j // chunk == position // chunk)]
            slots = [step.slot(row, j) for j in visible]
            for head in range(HEADS):
                kv_head = head // (HEADS // KV_HEADS)
                keys = step.key_cache[slots, kv_head].double()
                values = step.value_cache[slots, kv_head].double()
                logits = keys @ step.query[token, head].double() * SCALE
                if sinks is not None:
                    logits = torch.cat([logits, torch.tensor([float(sinks[head])],
                                                             dtype=torch.float64)])
                weights = torch.softmax(logits, 0)[:len(slots)]
                out[token, head] = weights @ values
    return out


def assert_attends(step: Step, expected: Any) -> None:
    torch = require_torch()
    tolerance = TOLERANCE[step.dtype]
    torch.testing.assert_close(step.out.double(), expected, rtol=tolerance, atol=tolerance)


# ---- equality with the reference --------------------------------------------------------------

@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("visibility", list(VISIBILITY))
@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_equals_softmax_attention_in_float64(dtype: str, visibility: str,
                                             with_sinks: bool) -> None:
    limits = VISIBILITY[visibility]
    step = make_step(dtype, seed=len(dtype) * 10 + len(visibility) + with_sinks, **limits)
    sinks = np.linspace(-1.0, 2.0, HEADS, dtype=np.float32) if with_sinks else None
    _core.paged_attention(**step.args(sinks=sinks, threads=3, **limits))
    assert_attends(step, reference(step, sinks=sinks, **limits))


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_writes_the_new_rows_into_their_slots_first(dtype: str) -> None:
    """Each row's new tokens go to their slots; one token is PAD (its slot keeps its K/V and
    its new row, all NaN, lands nowhere); every other element of the caches is unchanged."""
    torch = require_torch()
    step = make_step(dtype, seed=7)
    tokens = step.query.shape[0]
    slot_mapping = np.array([step.slot(row, seq_len - query_len + i)
                             for row, (query_len, seq_len) in enumerate(ROWS)
                             for i in range(query_len)], dtype=np.int32)
    pad = 4
    slot_mapping[pad] = -1
    kind = getattr(torch, dtype)
    new_keys, new_values = (torch.randn(tokens, KV_HEADS, HEAD_DIM).to(kind) for _ in range(2))
    new_keys[pad] = new_values[pad] = float("nan")
    expected = [step.key_cache.clone(), step.value_cache.clone()]
    written = torch.from_numpy(slot_mapping[slot_mapping >= 0]).long()
    expected[0][written] = new_keys[slot_mapping >= 0]
    expected[1][written] = new_values[slot_mapping >= 0]
    _core.paged_attention(**step.args(new_keys=numpy_bits(new_keys),
                                      new_values=numpy_bits(new_values),
                                      slot_mapping=slot_mapping))
    assert numpy_bits(step.key_cache).tobytes() == numpy_bits(expected[0]).tobytes()
    assert numpy_bits(step.value_cache).tobytes() == numpy_bits(expected[1]).tobytes()
    assert_attends(step, reference(step))


# ---- bad input --------------------------------------------------------------------------------

def transposed(array: np.ndarray) -> np.ndarray:
    """A non-contiguous array of the same shape and values: a transposed view of a copy."""
    view: np.ndarray = np.ascontiguousarray(array.swapaxes(0, 1)).swapaxes(0, 1)
    return view


def with_table(row: int, index: int, block: int) -> Callable[[dict[str, Any]], None]:
    def change(args: dict[str, Any]) -> None:
        args["block_tables"] = args["block_tables"].copy()
        args["block_tables"][row, index] = block
    return change


def new_kv(slots: list[int], parts: str = "new_keys new_values slot_mapping") -> dict[str, Any]:
    """float32 new K/V for the step's tokens, all PAD but the first ``len(slots)``."""
    mapping = np.full(TOKENS, -1, dtype=np.int32)
    mapping[:len(slots)] = slots
    every = {"new_keys": np.zeros((TOKENS, KV_HEADS, HEAD_DIM), dtype=np.float32),
             "new_values": np.ones((TOKENS, KV_HEADS, HEAD_DIM), dtype=np.float32),
             "slot_mapping": mapping}
    return {name: every[name] for name in parts.split()}


def set_args(**changes: Any) -> Callable[[dict[str, Any]], None]:
    return lambda args: args.update(changes)


def change_args(name: str, change: Callable[[Any], Any]) -> Callable[[dict[str, Any]], None]:
    return lambda args: args.update({name: change(args[name])})


def read_only(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)
    return array


int32 = np.int32
BAD: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("dtype-string", set_args(dtype="float64"), "dtype must be 'float32', 'bfloat16'"),
    ("float64-query", change_args("query", lambda a: a.astype(np.float64)),
     "query must be a numpy float32 array"),
    ("float64-cache", change_args("value_cache", lambda a: a.astype(np.float64)),
     "value_cache must be a numpy float32 array"),
    ("16-bit-dtype-of-f32", set_args(dtype="bfloat16"), "query must be a numpy int16"),
    ("strided-query", change_args("query", transposed), "query must be C-contiguous"),
    ("strided-cache", change_args("key_cache", transposed), "key_cache must be C-contiguous"),
    ("strided-out", change_args("out", transposed), "out must be C-contiguous"),
    # Fortran order is contiguous to numpy's slices, and was read as if it were C order.
    ("fortran-query", change_args("query", np.asfortranarray), "query must be C-contiguous"),
    ("fortran-cache", change_args("value_cache", np.asfortranarray),
     "value_cache must be C-contiguous"),
    ("query-2-D", change_args("query", lambda a: a.reshape(TOKENS, -1)), "query must be 3-D"),
    ("out-shape", change_args("out", lambda a: a[:-1].copy()), "disagree on head_dim or shape"),
    ("block-out-of-range", with_table(2, 1, NUM_BLOCKS), r"block_tables\[1\] = 24 is not a"),
    ("block-negative", with_table(0, 2, -3), r"block_tables\[2\] = -3 is not a block"),
    ("null-block-read", with_table(4, 5, 0), "0 is the null block"),
    ("table-too-narrow", change_args("block_tables", lambda a: a[:, :5].copy()),
     "22 tokens need 6 blocks; its table has 5"),
    ("starts-short", set_args(query_start_loc=np.array([0, 1, 2, 7, 13, 13], dtype=int32)),
     "query_start_loc must run from 0 to the 14 tokens"),
    ("starts-decreasing",
     set_args(query_start_loc=np.array([0, 1, 3, 2, 13, 14], dtype=int32)), "row 2: -1 new"),
    ("starts-count", set_args(query_start_loc=np.array([0, 14], dtype=int32)),
     "query_start_loc has 2 entries for 5 rows"),
    ("seq-len-under-query", set_args(seq_lens=np.array([9, 4, 4, 6, 22], dtype=int32)),
     "row 2: 5 new tokens .* in a sequence of 4"),
    ("window-0", set_args(window=0), "at least 1, got 0\nwhile processing 'window'"),
    ("chunk-0", set_args(chunk=0), "at least 1, got 0\nwhile processing 'chunk'"),
    ("window-and-chunk", set_args(window=4, chunk=8), "a window or a chunk, not both"),
    ("sinks-length", set_args(sinks=np.zeros(HEADS - 1, dtype=np.float32)),
     "sinks has 3 entries for 4 heads"),
    ("slot-beyond-cache", set_args(**new_kv([3, NUM_BLOCKS * BLOCK_SIZE])),
     r"slot_mapping\[1\] = 96 is beyond the cache's 96 slots"),
    ("new-keys-alone", set_args(**new_kv([], "new_keys new_values")),
     "new_keys, new_values and slot_mapping come together"),
    ("slot-mapping-alone", set_args(**new_kv([], "slot_mapping")), "come together"),
    ("threads-0", set_args(threads=0), "at least 1, got 0\nwhile processing 'threads'"),
    ("threads-million", set_args(threads=10**6), "threads must be 1 to 1024, got 1000000"),
    ("same-cache-twice", lambda args: args.update(value_cache=args["key_cache"]),
     "value_cache must be a writable array borrowed nowhere else"),
    ("out-is-query", lambda args: args.update(out=args["query"]), "out must be a writable"),
    ("read-only-out", change_args("out", read_only), "out must be a writable array"),
]


@pytest.mark.parametrize(("change", "message"), [case[1:] for case in BAD],
                         ids=[case[0] for case in BAD])
def test_bad_input_is_a_clear_error_that_changes_nothing(
        change: Callable[[dict[str, Any]], None], message: str) -> None:
    step = make_step("float32", seed=3)
    args = step.args()
    change(args)
    before = step.snapshot()
    with pytest.raises(ValueError, match=message):
        _core.paged_attention(**args)
    assert step.changed_since(before) == []


def test_a_good_call_after_every_refused_one_is_right() -> None:
    step = make_step("float32", seed=5)
    for _, change, message in BAD:
        args = step.args()
        change(args)
        with pytest.raises(ValueError, match=message):
            _core.paged_attention(**args)
    _core.paged_attention(**step.args(threads=2))
    assert_attends(step, reference(step))


@pytest.mark.parametrize("change", [with_table(0, 2, -3), set_args(threads=10**6),
                                    set_args(sinks=np.zeros(1, dtype=np.float32))],
                         ids=["bad-table", "threads", "sinks"])
def test_a_call_refused_after_valid_new_kv_writes_no_slot(
        change: Callable[[dict[str, Any]], None]) -> None:
    step = make_step("float32", seed=11)
    args = step.args(**new_kv([0, 1, 2]))
    change(args)
    before = step.snapshot()
    with pytest.raises(ValueError):
        _core.paged_attention(**args)
    assert step.changed_since(before) == []


# ---- a long prefill on torch's OpenMP team ----------------------------------------------------

def long_prefill(dtype: str, seed: int) -> tuple[Step, Any]:
    """One row's 40 new tokens (80 query vectors per KV head: the kernel's lane-tile path) in
    scrambled blocks, every other slot NaN; and causal attention over them in float64."""
    torch = require_torch()
    tokens, kind = 40, getattr(torch, dtype)
    generator = torch.Generator().manual_seed(seed)
    caches = [torch.full((NUM_BLOCKS * BLOCK_SIZE, KV_HEADS, HEAD_DIM), float("nan"), dtype=kind)
              for _ in range(2)]
    blocks = np.random.default_rng(seed).permutation(np.arange(1, NUM_BLOCKS))
    blocks = blocks[:tokens // BLOCK_SIZE]
    slots = (blocks[:, None] * BLOCK_SIZE + np.arange(BLOCK_SIZE)).reshape(-1)
    for cache in caches:
        cache[slots] = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=generator).to(kind)
    query = torch.randn(tokens, HEADS, HEAD_DIM, generator=generator).to(kind)
    step = Step(dtype, query, caches[0], caches[1], torch.full_like(query, float("nan")),
                np.array([0, tokens], dtype=np.int32), np.array([tokens], dtype=np.int32),
                blocks.astype(np.int32)[None, :])
    group = HEADS // KV_HEADS
    keys, values = (cache[slots].double().repeat_interleave(group, 1).transpose(0, 1)
                    for cache in caches)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query.double().transpose(0, 1), keys, values, is_causal=True, scale=SCALE)
    return step, expected.transpose(0, 1)


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_a_long_prefill_on_torchs_threads_equals_causal_attention(dtype: str) -> None:
    assert share_torchs_threads() is not None, "torch's OpenMP runtime was not found"
    step, expected = long_prefill(dtype, seed=len(dtype))
    for threads in (1, 2, 3):
        step.out.fill_(float("nan"))
        _core.paged_attention(**step.args(threads=threads))
        assert_attends(step, expected)


def test_python_threads_attend_at_once_on_torchs_runtime() -> None:
    """Four Python threads, each its own step, call the kernel at once (the GIL released;
    each caller leads an OpenMP team of its own): every call is right."""
    assert share_torchs_threads() is not None, "torch's OpenMP runtime was not found"
    steps = [long_prefill("float32", seed) for seed in range(4)]
    start = threading.Barrier(len(steps))

    def attend(step: Step, expected: Any) -> None:
        start.wait(timeout=30)
        for _ in range(25):
            step.out.fill_(float("nan"))
            _core.paged_attention(**step.args(threads=2))
            assert_attends(step, expected)

    with ThreadPoolExecutor(len(steps)) as pool:
        for done in [pool.submit(attend, *step) for step in steps]:
            done.result(timeout=120)


def test_use_openmp_refuses_what_is_not_a_loaded_runtime(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="is not a library this process has loaded"):
        _core.use_openmp(tmp_path / "libgomp.so.1")
    with pytest.raises(ValueError, match="has no GOMP_parallel: not an OpenMP runtime"):
        _core.use_openmp(_core.__file__)
    with pytest.raises(ValueError, match="NUL byte"):
        _core.use_openmp("/lib\0gomp.so")
    for relative in ("", "libgomp.so.1"):  # dlopen would take the program, or search
        with pytest.raises(ValueError, match="is not an absolute path"):
            _core.use_openmp(relative)

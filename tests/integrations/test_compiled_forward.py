"""The Engine's compiled forward on the CPU (torch.compile around atb-mem's attention kernel,
an opaque operator): greedy tokens equal HF's own ``generate`` for Llama, Qwen3, Mistral
(sliding), Gemma 3 (sliding and full layers) and gpt-oss (sinks) in a continuous batch with
chunked prefill, prefix hits and preemption, unused blocks NaN-poisoned before every step; the
graphs are compiled at start-up and no step recompiles; a wrong block table through the compiled
graph fails the comparison; two models of one class keep their own weights; ``enforce_eager``,
recurrent models and the torch reference stay eager; a model torch cannot compile (any error
where the eager forward succeeds) runs eager after one warning, while a step the model itself
refuses raises the model's error."""

from __future__ import annotations

from typing import Any

import pytest

from atb_mem.integrations import compiled_forward
from atb_mem.integrations.compiled_forward import CompiledForward
from atb_mem.integrations.forward_plan import ForwardPlan
from atb_mem.serving import Engine, SamplingParams
from tests.support.models import (
    assert_each_matches_hf,
    greedy,
    model_pair,
    random_prompt,
    read_the_previous_rows_first_block,
    require_torch,
    run_poisoned,
)

pytestmark = pytest.mark.usefixtures("compiled")


def arrivals() -> dict[int, list[tuple[str, list[int], SamplingParams]]]:
    """Seven requests at steps 0, 2 and 5: two share a prefix with an earlier one, prompts of
    1 to 29 tokens (several chunks at 24 tokens a step), outputs of 1 to 14."""
    shared = random_prompt(100, 13)
    specs = [(0, "a", random_prompt(1, 11), 14), (0, "b", random_prompt(2, 29), 3),
             (0, "c", shared, 12), (2, "d", random_prompt(3, 17), 9),
             (2, "e", [*shared, 7, 8], 8), (5, "f", [*shared[:9], 42], 12),
             (5, "g", random_prompt(4, 1), 1)]
    found: dict[int, list[tuple[str, list[int], SamplingParams]]] = {}
    for step, request_id, tokens, max_tokens in specs:
        found.setdefault(step, []).append((request_id, tokens, greedy(max_tokens)))
    return found


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def engine_for(model: Any, **options: Any) -> Engine:
    # 19 usable blocks of 4 tokens cannot hold the batch: sequences get preempted.
    return Engine(model, num_blocks=20, block_size=4, max_num_seqs=6,
                  max_num_batched_tokens=24, **options)


@pytest.mark.parametrize("architecture", ["llama", "qwen3", "mistral", "gemma3", "gpt_oss"])
def test_greedy_tokens_equal_hf_through_the_compiled_forward(architecture: str) -> None:
    model, reference = model_pair(architecture)
    engine = engine_for(model)
    forward = engine.runner.forward
    assert isinstance(forward, CompiledForward)
    graphs = compiled_graphs()
    results = run_poisoned(engine, arrivals())
    assert forward.failed is None
    assert compiled_graphs() == graphs, "a step compiled a graph the warm-up had not"
    assert_each_matches_hf(results, reference, arrivals())
    stats = engine.kv_cache.stats()
    assert stats["prefix_cache_hits"] > 0
    # Mistral's window frees blocks behind it: its batch fits without preemption.
    assert (engine.scheduler.stats()["preemptions"] > 0) == (architecture != "mistral")
    assert stats["blocks_used"] == 0


def test_the_forward_compiles_without_a_graph_break() -> None:
    """One graph per step: a break splits the forward into frames compiled apart, each
    paying dynamo's call overhead, and a frame compiled apart around an operator reads its
    output sizes from inductor's disk cache, which another process may have filled for another
    model."""
    from torch._dynamo.utils import counters

    counters["graph_break"].clear()
    engine = engine_for(model_pair("qwen3")[0])
    assert isinstance(engine.runner.forward, CompiledForward)
    assert engine.runner.forward.failed is None
    assert dict(counters["graph_break"]) == {}


def test_two_models_of_one_class_each_get_their_own_weights() -> None:
    """Graphs are cached per class (one forward's code): a second model with other weights
    in the same process must not be served the first one's."""
    engines, references = [], []
    for seed in (0, 1):
        model, reference = model_pair("llama", seed)
        engines.append(engine_for(model))
        references.append(reference)
    for engine, reference in zip(reversed(engines), reversed(references), strict=True):
        assert_each_matches_hf(run_poisoned(engine, arrivals()), reference, arrivals())


def test_a_wrong_block_table_through_the_compiled_graph_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: each row reads the previous row's first block."""
    model, reference = model_pair("llama")
    engine = engine_for(model)
    read_the_previous_rows_first_block(monkeypatch)
    results = run_poisoned(engine, arrivals())
    with pytest.raises(AssertionError):
        assert_each_matches_hf(results, reference, arrivals())


def test_enforce_eager_and_recurrent_models_are_not_compiled() -> None:
    graphs = compiled_graphs()
    model, _ = model_pair("llama")
    assert engine_for(model, enforce_eager=True).runner.forward is model
    model, _ = model_pair("granitemoehybrid")
    assert Engine(model, num_blocks=64, block_size=4).runner.forward is model
    model, _ = model_pair("llama")
    assert engine_for(model, attention_backend="torch").runner.forward is model
    assert compiled_graphs() == graphs


def test_a_model_torch_cannot_compile_runs_eager_after_a_warning(
        monkeypatch: pytest.MonkeyPatch) -> None:
    torch = require_torch()

    def refuse(graph: Any, inputs: Any) -> Any:
        raise RuntimeError("this backend compiles nothing")

    torch._dynamo.reset()  # else the graphs earlier tests compiled for Llama serve it
    compile_model = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: compile_model(
        model, backend=refuse, dynamic=True))
    model, reference = model_pair("llama")
    with pytest.warns(UserWarning, match="cannot compile this model here"):
        engine = engine_for(model)
    forward = engine.runner.forward
    assert isinstance(forward, CompiledForward) and forward.failed is not None
    assert_each_matches_hf(run_poisoned(engine, arrivals()), reference, arrivals())


def test_the_operator_outside_a_step_is_a_clear_error() -> None:
    torch = require_torch()
    op = compiled_forward.paged_attention_op()
    query, key = torch.zeros(1, 4, 3, 16), torch.zeros(1, 2, 3, 16)
    with pytest.raises(RuntimeError, match="runs inside a step"):
        op(query, key, key, 0, 0.25, None)


def test_attend_step_refuses_queries_that_are_not_the_steps_and_writes_nothing() -> None:
    """``attend_step`` (the operator's body) checks the queries against the step's tokens
    before it writes a byte of K/V."""
    torch = require_torch()
    from atb_mem.integrations import transformers as paged

    model, _ = model_pair("llama")
    runner = engine_for(model, enforce_eager=True).runner
    plan = ForwardPlan.warm_up(3, 1)
    step = paged.StepAttention.from_plan(plan, runner.layer_caches,  # type: ignore[arg-type]
                                         runner.kv_cache.block_size, runner.device,
                                         kernel=runner.kernel)
    before = runner.kv_cache.kv_cache.clone()
    key = torch.ones(1, 2, 5, 16)
    with paged.paged_step(step), pytest.raises(ValueError, match="expected the step's 3 tokens"):
        paged.attend_step(0, torch.ones(1, 4, 5, 16), key, key, None, None)
    assert torch.equal(runner.kv_cache.kv_cache, before)


def test_enforce_eager_must_be_a_bool() -> None:
    model, _ = model_pair("llama")
    with pytest.raises(TypeError, match="enforce_eager must be a bool, got str"):
        engine_for(model, enforce_eager="yes")


def test_a_compiled_call_that_fails_where_eager_succeeds_runs_eager_after_a_warning() -> None:
    """Any error, not only dynamo's own: a guard dynamo cannot build (another thread's compile
    changed a library's state midway) raises an AssertionError."""
    torch = require_torch()
    model, _ = model_pair("llama")
    forward = CompiledForward(model)

    def broken(**inputs: Any) -> Any:
        raise AssertionError("Unexpected type <class 'dict'>")

    forward.compiled = broken
    inputs = {"input_ids": torch.tensor([[5, 6, 7]]), "use_cache": False}
    with pytest.warns(UserWarning, match="AssertionError: Unexpected type"):
        output = forward(logits_to_keep=torch.tensor([2]), **inputs)
    assert forward.failed is not None
    with torch.inference_mode():
        expected = model(**inputs).logits[:, -1:]
    torch.testing.assert_close(output.logits, expected)


def test_a_step_the_model_itself_refuses_raises_its_error_and_keeps_the_graphs() -> None:
    torch = require_torch()
    model, _ = model_pair("llama")
    forward = CompiledForward(model)
    calls: list[str] = []

    def refusing(**inputs: Any) -> Any:
        calls.append("compiled")
        raise IndexError("index out of range in self")

    forward.compiled = refusing
    with pytest.raises(IndexError, match="index out of range"):
        forward(logits_to_keep=torch.tensor([0]), input_ids=torch.tensor([[10_000]]),
                use_cache=False)
    assert calls == ["compiled"] and forward.failed is None


def test_a_one_token_step_projects_one_row_and_others_two_at_least() -> None:
    """The vocabulary's projection of a single decode runs on its one row (a matrix-vector
    product); a step of more tokens with one sampled row pads it to two (the graph of
    symbolic sizes); no step compiles a graph the warm-up had not."""
    model, _ = model_pair("llama")
    engine = engine_for(model)
    forward = engine.runner.forward
    assert isinstance(forward, CompiledForward)
    seen: list[tuple[int, int]] = []
    compiled = forward.compiled

    def recording(**inputs: Any) -> Any:
        seen.append((inputs["input_ids"].shape[-1], len(inputs["logits_to_keep"])))
        return compiled(**inputs)

    forward.compiled = recording
    graphs = compiled_graphs()
    engine.add_request("one", random_prompt(7, 6), greedy(4))
    while engine.has_unfinished_requests():
        engine.step()
    assert seen[0] == (6, 2), "a prefill with one sampled row: padded to two"
    assert seen[1:] == [(1, 1)] * 3, "single decodes: one row"
    assert compiled_graphs() == graphs


def test_many_engines_of_one_class_each_run_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every compile of one model class shares its forward's compiled entries, and dynamo runs
    a frame eager, silently, past its recompile limit (8): each engine of a class used two,
    and the fifth in a process ran eager. Each engine now keeps graphs of its own."""
    calls: list[int] = []
    attend = compiled_forward.attend_step

    def counted(*args: Any) -> Any:
        calls.append(1)
        return attend(*args)

    # The graphs' attention operator calls it; an eager forward calls it from elsewhere.
    monkeypatch.setattr(compiled_forward, "attend_step", counted)
    for seed in range(6):
        model, reference = model_pair("llama", seed)
        engine = engine_for(model)
        calls.clear()
        arrivals = {0: [("a", random_prompt(seed, 5), greedy(3))]}
        assert_each_matches_hf(run_poisoned(engine, arrivals), reference, arrivals)
        assert calls, f"engine {seed} ran eager"

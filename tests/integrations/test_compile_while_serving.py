"""An Engine serves on while another thread of the process runs ``torch.compile``.

torch's ``is_compiling()`` is one flag for the whole process, held while any thread compiles;
an engine that took it to mean "this thread is being traced" sent its eager attention into the
compiled path, which recursed (most requests failed with a RecursionError), and a second
engine's constructor raised instead of coming up. Here engine A steps in a loop on a thread of
its own, eager or compiled, while the main thread compiles — a second engine being built, or a
plain function at several shapes — and every one of A's requests must equal HF's ``generate``,
with unused blocks NaN-poisoned before every step.
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import Any

import pytest

from atb_mem.integrations.compiled_forward import CompiledForward
from atb_mem.serving import Engine
from tests.support.models import (
    assert_each_matches_hf,
    greedy,
    hf_tokens,
    model_pair,
    random_prompt,
    require_torch,
    run_poisoned,
    run_with_errors,
)

pytestmark = pytest.mark.usefixtures("compiled")

PROMPTS = [random_prompt(seed, length) for seed, length in ((11, 9), (12, 23), (13, 2))]


class Serving:
    """Engine A stepping on a thread of its own until told to stop: each round queues the
    three prompts under new request ids and runs them to the end."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.rounds: list[dict[int, list[tuple[str, list[int], Any]]]] = []
        self.results: dict[str, Any] = {}
        self.step_times: list[float] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        step = self.engine.step

        def timed_step() -> Any:
            outputs = step()
            self.step_times.append(time.monotonic())
            return outputs

        self.engine.step = timed_step  # type: ignore[method-assign]
        try:
            while not self._stop.is_set() and len(self.rounds) < 2_000:
                number = len(self.rounds)
                arrivals = {0: [(f"{number}-{index}", prompt, greedy(6))
                                for index, prompt in enumerate(PROMPTS)]}
                self.rounds.append(arrivals)
                results, _ = run_with_errors(self.engine, arrivals)
                self.results.update(results)
        except BaseException as error:  # reported by stop()
            self.error = error
        finally:
            self.engine.step = step  # type: ignore[method-assign]

    def __enter__(self) -> Serving:
        self._thread.start()
        # A is stepping before the other thread starts compiling (which then takes most of
        # the GIL): the overlap ``check`` asks for is not left to the threads' start-up.
        deadline = time.monotonic() + 60
        while len(self.step_times) < 3 and self.error is None and time.monotonic() < deadline:
            self._stop.wait(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=600)
        assert not self._thread.is_alive(), "engine A does not stop"

    def check(self, reference: Any, began: float, ended: float) -> None:
        if self.error is not None:
            raise self.error
        during = sum(began <= at <= ended for at in self.step_times)
        assert during > 0, "engine A took no step while the other thread compiled"
        # A request that failed says why before its tokens are compared.
        failed = {request_id: result["error"] for request_id, result in self.results.items()
                  if result["error"] is not None}
        assert not failed, failed
        # Every round asks the same prompts: HF's tokens once for each.
        expected = [hf_tokens(reference, prompt, 6) for prompt in PROMPTS]
        wrong = {request_id: (got, expected[int(request_id.split("-")[1])])
                 for request_id, result in self.results.items()
                 if (got := result[0][0]) != expected[int(request_id.split("-")[1])]}
        assert not wrong, f"{len(wrong)} of {len(self.results)} requests differ from HF " \
                          f"(got, HF's): {wrong}"


def compile_a_function_at_several_shapes(serving: Serving) -> None:
    """A graph per shape, until engine A has stepped a few times meanwhile (the compiles hold
    the GIL most of the time; a cached one takes a few milliseconds)."""
    torch = require_torch()

    def scaled_softplus(x: Any) -> Any:
        return torch.nn.functional.softplus(x * 1.5).sum(dim=-1)

    steps = len(serving.step_times)
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False, recompile_limit=200):
        compiled = torch.compile(scaled_softplus, dynamic=False)
        for size in range(3, 200):
            compiled(torch.ones(size, 4))
            if size > 10 and len(serving.step_times) - steps >= 5:
                break


@pytest.mark.parametrize("a_compiles", [False, True], ids=["A eager", "A compiled"])
def test_an_engine_serves_while_another_engine_is_built(a_compiles: bool) -> None:
    # B's model first: a transformers model class's first instance grows a registry that A's
    # graphs guard, and A would recompile (waiting for B's compile to end) at its next step.
    other, other_reference = model_pair("qwen3")
    model, reference = model_pair("llama")
    engine = Engine(model, num_blocks=64, block_size=4, enforce_eager=not a_compiles)
    assert isinstance(engine.runner.forward, CompiledForward) == a_compiles
    with Serving(engine) as serving:
        began = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            built = Engine(other, num_blocks=64, block_size=4)
        ended = time.monotonic()
    serving.check(reference, began, ended)
    forward = built.runner.forward
    assert isinstance(forward, CompiledForward)
    # B comes up compiled, or eager after a warning that says so.
    said = [str(w.message) for w in caught if "torch.compile" in str(w.message)]
    assert (forward.failed is None) or said, forward.failed
    arrivals = {0: [("b", PROMPTS[1], greedy(6))]}
    assert_each_matches_hf(run_poisoned(built, arrivals), other_reference, arrivals)


@pytest.mark.parametrize("a_compiles", [False, True], ids=["A eager", "A compiled"])
def test_an_engine_serves_while_a_function_is_compiled(a_compiles: bool) -> None:
    model, reference = model_pair("llama")
    engine = Engine(model, num_blocks=64, block_size=4, enforce_eager=not a_compiles)
    with Serving(engine) as serving:
        began = time.monotonic()
        compile_a_function_at_several_shapes(serving)
        ended = time.monotonic()
    serving.check(reference, began, ended)


def test_an_engine_settles_inductors_one_symbolic_trace_before_it_serves(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.fx's symbolic tracer patches ``nn.Module.__call__`` for the whole process while
    it traces, and inductor traces its dummy function that way the first time any thread
    lowers a graph: an eager engine stepping meanwhile failed its requests ("module is not
    installed as a submodule"). Once an engine exists, another thread's compile traces
    nothing that way; with the trace left to the compile (cache cleared), it does."""
    torch = require_torch()
    from torch._inductor.loop_body import InterpreterShim

    traces: list[object] = []
    trace = torch.fx.Tracer.trace

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        # The plain tracer's module calls refuse modules it does not trace (make_fx's
        # tracers, which every compile runs, call them through).
        if type(self) is torch.fx.Tracer:
            traces.append(self)
        return trace(self, *args, **kwargs)

    def compile_a_new_function(scale: float) -> None:
        compiled = torch.compile(lambda x: torch.nn.functional.softplus(x * scale).sum())
        # Lowered here, not read back from an earlier run's cache on disk.
        with torch._inductor.config.patch(fx_graph_cache=False):
            compiled(torch.ones(7, 3))

    Engine(model_pair("llama")[0], num_blocks=64, block_size=4, enforce_eager=True)
    monkeypatch.setattr(torch.fx.Tracer, "trace", counted)
    compile_a_new_function(1.25)
    assert traces == []
    InterpreterShim._dummy_gm.cache_clear()  # as if no engine had settled it
    compile_a_new_function(1.75)
    assert traces != []

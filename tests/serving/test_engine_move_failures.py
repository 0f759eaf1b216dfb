"""A step whose block moves fail, under a model (issue 39, item 2). The core rolls the step
back and names the sequences whose bytes the partial execution destroyed; the engine ends
exactly their requests with ``"error"``, plans the step again in the same call, and every
other request finishes with HF ``generate``'s greedy tokens (unused blocks NaN-poisoned
before every step). A failure that destroyed nothing ends nobody; one that never stops
failing raises after a bounded number of tries instead of hanging."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

import atb_mem
from atb_mem.kv.tensors import MOVE_COPY, MOVE_TO_DEVICE, MOVE_TO_HOST, KVTensors
from atb_mem.serving import Engine, SamplingParams
from atb_mem.serving.step_failures import MOVE_ATTEMPTS
from tests.support.models import hf_tokens, model_pair, random_prompt
from tests.support.models import run_with_errors as run

BLOCK_SIZE = 4
# Where each kind of move reads and writes: (source tier, destination tier).
TIERS = {MOVE_COPY: ("device", "device"), MOVE_TO_HOST: ("device", "host"),
         MOVE_TO_DEVICE: ("host", "device")}


def reused_block(moves: list[list[int]], kinds: tuple[int, ...]) -> int | None:
    """The index of the first move of ``kinds`` that writes a block an earlier move of the same
    list read (freed by it in this step, so the rollback cannot give it back intact)."""
    read: set[tuple[str, int]] = set()
    for index, (kind, source, destination) in enumerate(moves):
        if kind in kinds and (TIERS[kind][1], destination) in read:
            return index
        read.add((TIERS[kind][0], source))
    return None


class FailingMoves:
    """Makes the executor fail where ``where(moves)`` gives an index: the moves up to and with
    that one run (their destinations really are overwritten), then it raises, as a device
    error part-way would. Once, or on every step with ``always``. Before each scheduler step
    it notes which request holds which device block, so the test knows whose bytes a failed
    copy destroyed without asking the code under test."""

    def __init__(self, engine: Engine, monkeypatch: pytest.MonkeyPatch,
                 where: Any, always: bool = False) -> None:
        self.engine, self.where, self.always = engine, where, always
        self.failures = 0
        self.calls = 0          # executor calls with moves
        self.plans = 0          # scheduler steps that returned a plan
        self.failed_at: list[int] = []  # plans returned before each failure
        self.victims: set[str] = set()
        self._holders: dict[tuple[str, int], set[str]] = {}
        execute, plan_step = KVTensors.execute, engine.scheduler.step

        def failing_execute(tensors: KVTensors, moves: Any) -> None:
            moves = np.asarray(moves)
            self.calls += len(moves) > 0
            index = None if (self.failures and not self.always) else self.where(moves.tolist())
            if index is None:
                execute(tensors, moves)
                return
            execute(tensors, moves[:index + 1])
            self.failures += 1
            self.failed_at.append(self.plans)
            written = (TIERS[int(moves[index, 0])][1], int(moves[index, 2]))
            self.victims |= self._holders.get(written, set())
            error = RuntimeError("injected copy failure")
            error.moves_attempted = index + 1  # type: ignore[attr-defined]
            raise error

        def noting_step(*args: Any, **kwargs: Any) -> Any:
            kv, holders = engine.kv_cache, {}
            for seq_id in kv.seq_ids():
                if seq_id in engine._by_seq:
                    request_id = engine._by_seq[seq_id][0].request_id
                    tier = "host" if kv.is_swapped(seq_id) else "device"
                    for block in kv.block_table(seq_id).tolist():
                        holders.setdefault((tier, block), set()).add(request_id)
            self._holders = holders
            plan = plan_step(*args, **kwargs)
            self.plans += 1
            return plan

        monkeypatch.setattr(KVTensors, "execute", failing_execute)
        monkeypatch.setattr(engine.scheduler, "step", noting_step)


def swap_engine(model: Any) -> Engine:
    """A device of 7 usable blocks, swap preemption and a host tier that also keeps evicted
    prefixes: steps that swap a request out and copy into the block it left."""
    return Engine(model, num_blocks=8, block_size=BLOCK_SIZE, preemption="swap",
                  kv_offload={"host": "1MiB"}, max_num_seqs=4, eviction_policy="lru")


def workload(seed: int) -> dict[int, list[tuple[str, list[int], SamplingParams]]]:
    """Eight requests, half sharing a prefix, some with ``n=2`` (forks copy-on-write),
    arriving over the first steps."""
    rng = np.random.default_rng(seed)
    shared = random_prompt(100 + seed, 8)
    arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]] = {}
    for index in range(8):
        tokens = (shared if rng.random() < 0.5 else []) + \
            random_prompt(seed * 10 + index, int(rng.integers(2, 9)))
        params = SamplingParams(max_tokens=int(rng.integers(3, 9)), temperature=0,
                                ignore_eos=True, n=2 if rng.random() < 0.3 else 1)
        arrivals.setdefault(int(rng.integers(0, 10)), []).append((f"r{index}", tokens, params))
    return arrivals


def expected_tokens(reference: Any, arrivals: dict[int, list[tuple[str, list[int],
                                                                   SamplingParams]]]
                    ) -> dict[str, list[int]]:
    return {request_id: hf_tokens(reference, tokens, params.max_tokens)
            for requests in arrivals.values() for request_id, tokens, params in requests}


def overwrite_a_block_the_step_read(moves: list[list[int]]) -> int | None:
    """E.g. a swap-in from host block h, then a demotion into h: the swapped-in request's
    bytes exist only on the device now, and the rollback would make it swapped out again."""
    return reused_block(moves, (MOVE_COPY, MOVE_TO_HOST, MOVE_TO_DEVICE))


def copy_into_a_freed_block(moves: list[list[int]]) -> int | None:
    return reused_block(moves, (MOVE_COPY,))


def first_demotion_or_swap_out(moves: list[list[int]]) -> int | None:
    """A write to a host block no earlier move of the step read: free or a cached prefix's,
    so nothing a request holds is lost."""
    for index, (kind, _, destination) in enumerate(moves):
        if kind == MOVE_TO_HOST:
            swapped_in = {source for k, source, _ in moves[:index] if k == MOVE_TO_DEVICE}
            return None if destination in swapped_in else index
    return None


# (where the moves fail, the workload's seed, whether that destroys a request's bytes): the
# seeds are ones where the failure happens (asserted) while other requests run.
CASES = [(overwrite_a_block_the_step_read, 1, True),
         (copy_into_a_freed_block, 0, False),     # into a block a cached prefix left
         (first_demotion_or_swap_out, 1, False)]


@pytest.mark.parametrize("where, seed, loses", CASES,
                         ids=["swap-in-then-demotion", "copy-over-a-prefix", "host-write"])
def test_a_failed_move_ends_exactly_the_requests_it_destroyed(
        where: Any, seed: int, loses: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    model, reference = model_pair("llama")
    engine = swap_engine(model)
    arrivals = workload(seed)
    _, steps_unharmed = run(swap_engine(model_pair("llama")[0]), arrivals)
    failing = FailingMoves(engine, monkeypatch, where)
    results, ran = run(engine, arrivals)
    assert failing.failures == 1
    assert bool(failing.victims) == loses
    expected = expected_tokens(reference, arrivals)
    assert set(results) == set(expected)
    for request_id, result in results.items():
        samples = [result[index] for index in range(len(result) - 1)]
        assert samples, request_id
        if request_id in failing.victims:
            assert result["error"] is not None and "injected copy failure" in result["error"]
            for tokens, reason in samples:
                assert reason == "error"
                assert tokens == expected[request_id][:len(tokens)]  # HF's, until the loss
        else:
            assert result["error"] is None, (request_id, result["error"])
            assert all(got == (expected[request_id], "length") for got in samples), request_id
    # The step was planned again at once: the engine step that met the failure still ran
    # the model, and with nothing destroyed the run took the very steps of one where nothing
    # failed.
    assert ran[failing.failed_at[0]] > 0
    if not loses:
        assert ran == steps_unharmed
    assert engine.kv_cache.stats()["blocks_used"] == 0
    engine.scheduler._check_invariants()


def test_moves_that_never_stop_failing_raise_after_a_few_tries(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every write to the host fails and destroys nothing: trying again cannot help, so the
    step raises after a bounded number of tries (it must not hang) with nothing changed, and
    once the device works again the same requests finish equal to HF. ``generate`` leaves
    the engine idle when a step raises."""
    model, reference = model_pair("llama")
    engine = swap_engine(model)
    arrivals = workload(1)
    failing = FailingMoves(engine, monkeypatch, first_demotion_or_swap_out, always=True)
    with pytest.raises(atb_mem.BlockMoveError):
        run(engine, arrivals)
    assert failing.failures == MOVE_ATTEMPTS and failing.calls == failing.failures
    assert engine.has_unfinished_requests() and not failing.victims
    engine.scheduler._check_invariants()
    waiting = dict(engine._requests)
    monkeypatch.undo()
    results, _ = run(engine, {})
    expected = expected_tokens(reference, arrivals)
    for request_id in waiting:
        assert results[request_id]["error"] is None
        assert results[request_id][0][1] == "length"

    prompts = [tokens for requests in arrivals.values() for _, tokens, _ in requests]
    params = [one for requests in arrivals.values() for _, _, one in requests]
    FailingMoves(engine, monkeypatch, first_demotion_or_swap_out, always=True)
    with pytest.raises(atb_mem.BlockMoveError):
        engine.generate(prompts, params)
    assert not engine.has_unfinished_requests()  # generate took its requests back
    monkeypatch.undo()
    outputs = engine.generate(prompts, params)
    assert [[one.token_ids for one in output.outputs] for output in outputs] == \
        [[expected[request_id]] * one.n for requests in arrivals.values()
         for request_id, _, one in requests]


def test_the_server_loop_fails_only_the_lost_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """``atb-mem serve``'s engine loop: the request whose bytes a failed move destroyed gets
    its error (a 500 for its client), the others in flight get HF's tokens, no step failed
    as a whole, and the loop serves on. The requests reach the engine together (an admission
    batch of all of them), so the run is the same every time."""
    from atb_mem.scheduling.request_batching import DynamicBatchScheduler
    from atb_mem.serving.engine_loop import ACCEPTED, EngineLoop, RequestFailed

    model, reference = model_pair("llama")
    engine = swap_engine(model)
    requests = [request for arriving in workload(0).values() for request in arriving]
    expected = {name: hf_tokens(reference, tokens, params.max_tokens)
                for name, tokens, params in requests}
    failing = FailingMoves(engine, monkeypatch, overwrite_a_block_the_step_read)
    loop = EngineLoop(engine, admission=DynamicBatchScheduler(len(requests), 600_000.0))

    async def serve() -> dict[str, tuple[str, Any]]:
        """Each request's stream id and its error, or its samples' tokens."""
        streams = {name: loop.submit(tokens, params) for name, tokens, params in requests}
        answers: dict[str, tuple[str, Any]] = {}
        for name, stream in streams.items():
            samples: dict[int, list[int]] = {}
            while name not in answers:
                item = await stream.get()
                if isinstance(item, Exception):
                    answers[name] = (stream.request_id, item)
                elif item is not ACCEPTED:
                    for one in item.outputs:
                        samples.setdefault(one.index, []).extend(one.token_ids)
                    if item.finished:
                        answers[name] = (stream.request_id, sorted(samples.items()))
        return answers

    loop.start()
    try:
        answers = asyncio.run(serve())
        assert failing.failures == 1 and len(failing.victims) == 1
        for name, _, params in requests:
            request_id, answer = answers[name]
            if request_id in failing.victims:
                assert isinstance(answer, RequestFailed)
                assert "injected copy failure" in str(answer)
            else:
                assert answer == [(index, expected[name]) for index in range(params.n)], name
        assert loop.failed_steps == 0 and loop.alive
        again = asyncio.run(serve())  # the same batch again: all of it served
        assert {name: answer for name, (_, answer) in again.items()} == \
            {name: [(index, expected[name]) for index in range(params.n)]
             for name, _, params in requests}
    finally:
        loop.stop()

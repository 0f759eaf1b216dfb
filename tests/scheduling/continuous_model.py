"""The model the continuous-batching state machine checks the scheduler and its cache
against: the requests with their tokens, what a step may change, the check of every plan row
by row, of a failed step, and the invariants after every step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hypothesis import event, note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant

import atb_mem
from atb_mem.kv.tensors import MOVE_COPY, MOVE_TO_DEVICE, MOVE_TO_HOST
from tests.scheduling.fake_runner import FlakyTensors, check_bytes, plan_codes

VOCAB = st.integers(0, 3)
TEMPLATES: list[tuple[int, ...]] = [
    (0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3),
    (1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
    (0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 0),
]
MAX_LIVE = 8
FORK_BASE = 1_000_000  # fork children's ids (the scheduler never sees them)


@dataclass
class Request:
    codes: list[int]  # K/V code of each token: prompt, then the sampled ones
    prompt_len: int
    max_new: int
    by_count: bool
    outputs: int = 0


@dataclass
class Before:
    """What a failed step must leave as it was (but for the requests it ends)."""

    stats: dict[str, Any]
    states: dict[int, str]  # request -> waiting / running / swapped
    seqs: dict[int, tuple[int, bool, int, list[int]]] = field(default_factory=dict)


class ContinuousModel(RuleBasedStateMachine):
    """The model's state, its helpers and checks, and the invariants checked after every
    step; the rules that drive it are in ``SchedulerMachine``."""

    def __init__(self) -> None:
        super().__init__()
        self.kv: atb_mem.KVCachePool | None = None
        self.sched: atb_mem.ContinuousBatchScheduler | None = None
        self.tensors: FlakyTensors | None = None
        self.reqs: dict[int, Request] = {}
        self.forks: dict[int, list[int]] = {}
        self.history: list[tuple[int, ...]] = []  # finished requests' tokens: follow-up turns
        self.ended: set[int] = set()  # requests ended since the last plan
        # Rows of the last plan until it is known to have run (the next step or on_tokens):
        # a request ended meanwhile keeps its blocks, and bytes, until then.
        self.in_flight: set[int] = set()
        self.zombies: dict[int, list[int]] = {}
        self.num_finished = 0
        self.next_id = 1
        self.next_fork = FORK_BASE

    # ------------------------------------------------------------------ helpers

    @property
    def bs(self) -> int:
        assert self.kv is not None
        return self.kv.block_size

    def state_of(self, seq_id: int) -> str:
        assert self.kv is not None
        if seq_id not in self.kv:
            return "waiting"
        return "swapped" if self.kv.is_swapped(seq_id) else "running"

    def before(self) -> Before:
        assert self.kv is not None and self.sched is not None
        kv = self.kv
        seqs = {i: (kv.seq_len(i), kv.is_swapped(i), kv.num_computed(i), kv.block_table(i).tolist())
                for i in kv.seq_ids()}
        return Before(self.sched.stats(), {i: self.state_of(i) for i in self.reqs}, seqs)

    def end(self, seq_id: int) -> None:
        """The model's side of a request ending (abort, finish, or its last token)."""
        assert self.kv is not None
        request = self.reqs.pop(seq_id)
        self.ended.add(seq_id)
        if seq_id in self.in_flight and seq_id in self.kv:
            self.zombies[seq_id] = request.codes  # freed once the plan ran
        else:
            assert seq_id not in self.kv, f"ended request {seq_id} still holds blocks"
        if not request.by_count:
            self.history = [*self.history[-5:], tuple(request.codes)]

    def plan_ran(self) -> None:
        """A step or on_tokens: the last plan ran, and what ends deferred is freed now."""
        assert self.kv is not None
        for seq_id in self.zombies:
            assert seq_id not in self.kv, f"ended request {seq_id} still holds blocks"
        self.zombies = {}
        self.in_flight = set()

    def codes_of(self, seq_id: int) -> list[int]:
        if seq_id in self.forks:
            return self.forks[seq_id]
        if seq_id in self.zombies:
            return self.zombies[seq_id]
        return self.reqs[seq_id].codes

    def check_all_bytes(self) -> None:
        assert self.kv is not None
        for seq_id in self.kv.seq_ids():
            codes = self.codes_of(seq_id)
            if check_bytes(self.kv, seq_id, codes) and self.kv.is_swapped(seq_id):
                event("bytes checked on the host tier")

    # ------------------------------------------------------------------- checks

    def check_plan(self, plan: atb_mem.StepPlan, before: Before) -> None:
        """The plan's rows, tokens, slots and decisions, against the model."""
        assert self.kv is not None and self.sched is not None
        kv, bs, config = self.kv, self.bs, self.sched.config
        rows = [int(i) for i in plan.seq_ids]
        assert len(set(rows)) == len(rows) <= config["max_num_seqs"]
        assert plan.num_batched_tokens == int(plan.query_lens.sum())
        assert plan.num_batched_tokens <= config["max_num_batched_tokens"]
        qsl = plan.query_start_loc.tolist()
        assert qsl == [0, *np.cumsum(plan.query_lens).tolist()]
        n_prefill = len(plan.prefill_seq_ids)
        assert plan.prefill_tokens.tolist() == plan.query_lens[:n_prefill].tolist()
        sampled = []
        for row, seq_id in enumerate(rows):
            request = self.reqs[seq_id]
            positions = plan.positions[qsl[row]:qsl[row + 1]].tolist()
            start, end = positions[0], positions[-1] + 1
            assert positions == list(range(start, end))
            assert end == plan.context_lens[row] == kv.num_computed(seq_id)
            assert end <= len(request.codes)
            assert self.state_of(seq_id) == "running"
            codes = plan_codes(plan)[qsl[row]:qsl[row + 1]].tolist()
            assert codes == request.codes[start:end], f"row {row} ({seq_id}) input ids"
            blocks = kv.block_table(seq_id).tolist()
            slots = [blocks[p // bs] * bs + p % bs for p in positions]
            assert plan.slot_mapping[qsl[row]:qsl[row + 1]].tolist() == slots
            width = plan.block_tables.shape[1]
            assert plan.block_tables[row].tolist() == blocks + [atb_mem.NULL_BLOCK] * (
                width - len(blocks)), f"row {row} ({seq_id}) block table"
            if before.states[seq_id] == "running":
                assert start == before.seqs[seq_id][2], f"{seq_id} resumed at {start}"
            else:
                # Newly admitted: what came from the prefix cache is whole blocks.
                assert start % bs == 0 and start <= (len(request.codes) - 1) // bs * bs
                if start:
                    event("prefix hit")
            if row >= n_prefill:
                assert end - start == 1 and end == len(request.codes)
            if end == len(request.codes):
                sampled.append(seq_id)
        assert [int(i) for i in plan.sample_seq_ids] == sampled
        assert plan.logits_indices.tolist() == [
            qsl[rows.index(seq_id) + 1] - 1 for seq_id in sampled]
        preempted = [int(i) for i in plan.preempted_seq_ids]
        for seq_id in preempted:
            state = self.state_of(seq_id)
            assert state == "waiting" or (state == "swapped" and config["preemption"] == "swap")
            event(f"preempted ({state})")
        stats = self.sched.stats()
        assert stats["preemptions"] == before.stats["preemptions"] + len(preempted)
        assert {int(i) for i in plan.finished_seq_ids} == self.ended
        self.ended = set()
        moves = plan.moves
        assert moves.dtype == np.int32 and moves.shape[1:] == (3,)
        for kind, pairs in ((MOVE_COPY, plan.copies), (MOVE_TO_HOST, plan.swap_out),
                            (MOVE_TO_DEVICE, plan.swap_in)):
            assert pairs.tolist() == moves[moves[:, 0] == kind, 1:].tolist()
            if len(pairs):
                event(f"moves of kind {kind} executed")

    def failed_step(self, before: Before, error: atb_mem.BlockMoveError) -> None:
        """A failed move execution: as before the step, but for the requests it ended."""
        assert self.kv is not None and self.sched is not None and self.tensors is not None
        kv = self.kv
        cause = error.__cause__
        assert isinstance(cause, RuntimeError) and "injected" in str(cause)
        attempted = cause.moves_attempted  # type: ignore[attr-defined]
        moves = self.tensors.last_moves[:attempted]
        damaged = {("host" if kind == MOVE_TO_HOST else "device", int(dst))
                   for kind, _, dst in moves.tolist()}
        expected = {seq_id for seq_id, (_, swapped, _, blocks) in before.seqs.items()
                    if any(("host" if swapped else "device", b) in damaged for b in blocks)}
        aborted = set(error.aborted_seq_ids)
        note(f"moves {self.tensors.last_moves.tolist()} failed after {attempted}; "
             f"aborted {sorted(aborted)}")
        event("step failed" + (": requests ended" if aborted else ": nothing lost"))
        assert aborted == expected, f"ended {sorted(aborted)}, damaged holders {sorted(expected)}"
        stats = dict(before.stats)
        for seq_id in sorted(aborted):
            assert seq_id not in kv and seq_id not in self.sched
            if seq_id in self.forks:
                del self.forks[seq_id]
            elif seq_id in self.zombies:
                del self.zombies[seq_id]
            else:
                stats[before.states[seq_id]] -= 1
                self.end(seq_id)
        assert self.sched.stats() == stats
        for seq_id, seq in before.seqs.items():
            if seq_id not in aborted:
                assert (kv.seq_len(seq_id), kv.is_swapped(seq_id), kv.num_computed(seq_id),
                        kv.block_table(seq_id).tolist()) == seq, f"{seq_id} changed"
        for seq_id in self.reqs:
            assert self.state_of(seq_id) == before.states[seq_id]
        assert len(kv.pending_moves()) == 0
        self.sched._check_invariants()
        self.check_all_bytes()

    # --------------------------------------------------------------- invariants

    @invariant()
    def consistent(self) -> None:
        if self.sched is None:
            return
        assert self.kv is not None
        self.sched._check_invariants()
        stats = self.sched.stats()
        states = [self.state_of(i) for i in self.reqs]
        for name in ("waiting", "running", "swapped"):
            assert stats[name] == states.count(name), (name, stats)
        assert stats["finished"] == self.num_finished
        for seq_id, request in self.reqs.items():
            assert seq_id in self.sched
            assert self.sched.progress(seq_id) == (request.prompt_len, request.outputs,
                                                   request.max_new)
        known = {*self.reqs, *self.forks, *self.zombies}
        assert set(self.kv.seq_ids()) <= known, "the cache holds a sequence nobody knows"
        assert set(self.forks) <= set(self.kv.seq_ids())
        self.check_all_bytes()

"""ContinuousBatchScheduler driven by hypothesis over a KVCachePool holding real bytes.

The machine plays the model runner: after every ``step()`` it writes each planned token's K/V
with ``kv.write_kv`` — key ``[code, position]``, value ``[position, 2 * code + 1]``, where the
code is the token id (or, for a prompt given as a count, a number unique to the request) — so
equal prefixes legitimately hold equal bytes and a prefix hit may serve them. It then samples
a token for each sampling row and reports it with ``on_tokens``.

After every executed step, every sequence on the cache must hold, at each position below its
``num_computed``, exactly the bytes of its reference tokens (prompt, then what was sampled) —
on the device, or on the host tier while swapped out. That catches a prefix hit on a block
that was never computed, block moves executed in a wrong order, and bytes lost on the way.

Requests (token ids from a tiny vocabulary with shared prefixes and follow-up turns, now
and then a count; priorities; an EOS token) come with chunked prefill (a small token budget),
both preemption modes, aborts and finishes (between steps, and between a plan and its
execution), forks made behind the scheduler's back (so decodes copy on write),
``reset_prefix_cache``, ``reconfigure``, and injected failures of the block-move executor: a
failing run of moves may scribble over its destination first, and ``step()`` must raise
``BlockMoveError`` with the scheduler and cache as before the step except the requests it
names — exactly those that held a block the failed execution wrote — and the next step works.
Each plan is also checked row by row against the model (positions, input ids, slots, which
rows sample), and a ``drain`` checks that every request finishes.

The ``test_regression_*`` tests at the end are problems this found, minimised.

``ATB_MEM_LONG=1`` runs 2,000 examples instead of 60.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import atb_mem
from atb_mem.kv.tensors import MOVE_COPY, MOVE_TO_DEVICE, MOVE_TO_HOST, KVTensors, _run_end

LONG = os.environ.get("ATB_MEM_LONG") == "1"

VOCAB = st.integers(0, 3)
TEMPLATES: list[tuple[int, ...]] = [
    (0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3),
    (1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
    (0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 0, 1, 0, 0),
]
GARBAGE = -7777.0
MAX_LIVE = 8
FORK_BASE = 1_000_000  # fork children's ids (the scheduler never sees them)


# ---- the runner's K/V and the byte check ---------------------------------------------------


def kv_rows(codes: Any, positions: Any) -> tuple[np.ndarray, np.ndarray]:
    """``[n, 1, 2]`` key and value rows of tokens with these codes at these positions."""
    codes = np.asarray(codes, dtype=np.float32)
    positions = np.asarray(positions, dtype=np.float32)
    key = np.stack([codes, positions], axis=1)[:, None, :]
    value = np.stack([positions, 2 * codes + 1], axis=1)[:, None, :]
    return key, value


def plan_codes(plan: atb_mem.StepPlan) -> np.ndarray:
    """The code of each planned token (``input_ids``, or the row's request for a count)."""
    row_ids = np.repeat(plan.seq_ids.astype(np.int64), plan.query_lens)
    ids = plan.input_ids.astype(np.int64)
    return np.where(ids >= 0, ids, -1 - row_ids)


def execute_plan(kv: atb_mem.KVCachePool, plan: atb_mem.StepPlan) -> None:
    """The runner's forward pass: every planned token's K/V into its slot, via ``write_kv``."""
    if plan.num_batched_tokens:
        key, value = kv_rows(plan_codes(plan), plan.positions)
        kv.write_kv(0, plan.slot_mapping, key, value)


def check_bytes(kv: atb_mem.KVCachePool, seq_id: int, codes: list[int]) -> int:
    """Raises AssertionError unless every computed position of ``seq_id`` holds the K/V of
    ``codes`` (on the tier the sequence lives on). Returns how many positions it checked."""
    computed = kv.num_computed(seq_id)
    assert computed <= len(codes), f"sequence {seq_id}: {computed} computed of {len(codes)}"
    bs = kv.block_size
    blocks = kv.block_table(seq_id).astype(np.int64)
    assert len(blocks) * bs >= computed
    swapped = kv.is_swapped(seq_id)
    if swapped:
        keys, values = kv.host_kv_cache[0, 0], kv.host_kv_cache[0, 1]
    else:
        keys, values = kv.key_cache(0), kv.value_cache(0)
    positions = np.arange(computed)
    got_key = keys[blocks[positions // bs], positions % bs, 0]
    got_value = values[blocks[positions // bs], positions % bs, 0]
    want_key, want_value = kv_rows(codes[:computed], positions)
    bad = np.nonzero((got_key != want_key[:, 0]).any(axis=1)
                     | (got_value != want_value[:, 0]).any(axis=1))[0]
    if len(bad):
        p = int(bad[0])
        tier = "host" if swapped else "device"
        raise AssertionError(
            f"sequence {seq_id} ({tier}): position {p} of {computed} computed, block "
            f"{int(blocks[p // bs])} offset {p % bs}, holds key {got_key[p].tolist()} value "
            f"{got_value[p].tolist()}; expected key {want_key[p, 0].tolist()} value "
            f"{want_value[p, 0].tolist()} ({len(bad)} positions wrong)")
    return computed


def make_kv(num_blocks: int, block_size: int, num_host_blocks: int | None) -> atb_mem.KVCachePool:
    return atb_mem.KVCachePool(num_blocks, block_size, num_layers=1, num_kv_heads=1, head_dim=2,
                               dtype="float32", num_host_blocks=num_host_blocks)


class FlakyTensors(KVTensors):
    """The cache's byte executor, with a failure to inject: the ``fail_at``-th run of moves
    of the next ``execute`` (negative: counted from the last) raises, after scribbling over
    its first destination block when ``scribble``, as a copy that died part-way would."""

    __slots__ = ("fail_at", "last_moves", "runs", "scribble")

    def __init__(self, tensors: KVTensors) -> None:
        super().__init__(tensors.backend, tensors.kv, tensors.host_kv)
        self.fail_at: int | None = None
        self.scribble = False
        self.runs = 0
        self.last_moves = np.zeros((0, 3), dtype=np.int32)

    def execute(self, moves: np.ndarray) -> None:
        self.last_moves = np.array(moves, copy=True)
        self.runs = 0
        if self.fail_at is not None and self.fail_at < 0:  # counted from the last run
            ends = [0]
            while ends[-1] < len(moves):
                ends.append(_run_end(self.last_moves, ends[-1]))
            self.fail_at += len(ends) - 1
        super().execute(moves)

    def _copy_run(self, kind: int, src: np.ndarray, dst: np.ndarray) -> None:
        run, self.runs = self.runs, self.runs + 1
        if run == self.fail_at:
            self.fail_at = None
            if self.scribble:
                tier = self.host_kv if kind == MOVE_TO_HOST else self.kv
                tier[:, :, int(dst[0])] = GARBAGE
            raise RuntimeError("injected move failure")
        super()._copy_run(kind, src, dst)


def flaky(kv: atb_mem.KVCachePool) -> FlakyTensors:
    tensors = kv.tensors
    assert tensors is not None
    flaky_tensors = FlakyTensors(tensors)
    kv._tensors = flaky_tensors  # the executor step() passes is kv.tensors.execute
    assert kv._executor == flaky_tensors.execute
    return flaky_tensors


# ---- the machine ---------------------------------------------------------------------------


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


class SchedulerMachine(RuleBasedStateMachine):
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

    # -------------------------------------------------------------------- setup

    @initialize(
        block_size=st.sampled_from([2, 4]),
        num_blocks=st.integers(10, 16),
        num_host_blocks=st.integers(6, 12),
        max_num_seqs=st.integers(2, 6),
        max_num_batched_tokens=st.integers(2, 10),
        preemption=st.sampled_from(["recompute", "swap"]),
        eos=st.sampled_from([None, None, 3]),
    )
    def setup(self, block_size: int, num_blocks: int, num_host_blocks: int, max_num_seqs: int,
              max_num_batched_tokens: int, preemption: str, eos: int | None) -> None:
        self.kv = make_kv(num_blocks, block_size, num_host_blocks)
        self.tensors = flaky(self.kv)
        self.sched = atb_mem.ContinuousBatchScheduler(
            self.kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            preemption=preemption, watermark=0.0, eos_token_id=eos)

    # ----------------------------------------------------------------- requests

    @rule(data=st.data())
    def add_requests(self, data: st.DataObject) -> None:
        for _ in range(data.draw(st.integers(1, 3), label="requests")):
            if len(self.reqs) < MAX_LIVE:
                self.add_request(data)

    def add_request(self, data: st.DataObject) -> None:
        assert self.kv is not None and self.sched is not None
        base = data.draw(st.sampled_from(TEMPLATES + self.history), label="base")
        cut = data.draw(st.integers(0, len(base)), label="cut")
        tail = data.draw(st.lists(VOCAB, max_size=6), label="tail")
        prompt = list(base[:cut]) + tail or [data.draw(VOCAB, label="token")]
        max_new = data.draw(st.integers(1, 8) | st.integers(3, 8), label="max_new_tokens")
        by_count = data.draw(st.integers(0, 7), label="by count?") == 0
        seq_id, self.next_id = self.next_id, self.next_id + 1
        room = (self.kv.num_blocks - 1) * self.bs
        before = self.sched.stats()
        arg: Any = len(prompt) if by_count else prompt
        if len(prompt) + max_new > room:
            with pytest.raises(ValueError, match="fits"):
                self.sched.add_request(seq_id, arg, max_new)
            assert self.sched.stats() == before and seq_id not in self.sched
            event("request too long for the cache: refused")
            return
        priority = data.draw(st.sampled_from([0, 0, 1, 2]), label="priority")
        self.sched.add_request(seq_id, arg, max_new, priority=priority)
        note(f"add {seq_id}: prompt={arg} max_new={max_new} priority={priority}")
        codes = [-1 - seq_id] * len(prompt) if by_count else prompt
        self.reqs[seq_id] = Request(list(codes), len(prompt), max_new, by_count)

    def _end_request(self, data: st.DataObject, how: str) -> None:
        assert self.kv is not None and self.sched is not None
        if not self.reqs:
            return
        seq_id = data.draw(st.sampled_from(sorted(self.reqs)), label=how)
        event(f"{how} a {self.state_of(seq_id)} request")
        if how == "finish":
            self.sched.finish(seq_id)
            self.num_finished += 1
        else:
            self.sched.abort(seq_id)
        note(f"{how} {seq_id}")
        self.end(seq_id)
        assert seq_id not in self.sched

    @rule(data=st.data())
    def end_requests(self, data: st.DataObject) -> None:
        how = data.draw(st.sampled_from(["abort", "finish"] * 2 + ["drain"]), label="end")
        if how == "drain":
            self.drain()
        else:
            self._end_request(data, how)

    @rule(data=st.data())
    def behind_the_back(self, data: st.DataObject) -> None:
        """Besides the serving loop: forks and their end, a prefix-cache reset, new settings."""
        kind = data.draw(st.sampled_from(["fork", "fork", "free_fork", "reset", "reconfigure"]),
                         label="cache op")
        if kind == "reconfigure":
            self.reconfigure(data)
        elif kind == "fork":
            self.fork(data)
        elif kind == "free_fork":
            self.free_fork(data)
        else:
            self.reset_prefix_cache()

    def reconfigure(self, data: st.DataObject) -> None:
        """New settings while requests flow (applied at the next step; a lower max_num_seqs
        than the sequences running preempts the extra ones)."""
        assert self.sched is not None
        changes = {
            "max_num_seqs": data.draw(st.integers(1, 6), label="max_num_seqs"),
            "max_num_batched_tokens": data.draw(st.integers(1, 10), label="token budget"),
            "preemption": data.draw(st.sampled_from(["recompute", "swap"]), label="preemption"),
        }
        self.sched.reconfigure(**changes)
        note(f"reconfigure {changes}")

    def reset_prefix_cache(self) -> None:
        assert self.kv is not None
        free = self.kv.num_free_blocks
        self.kv.reset_prefix_cache()
        assert self.kv.stats()["blocks_cached"] == 0 and self.kv.num_free_blocks == free

    def fork(self, data: st.DataObject) -> None:
        """A sequence forked behind the scheduler's back: its parent's next decode into their
        shared, partly filled last block copies it first."""
        assert self.kv is not None
        kv = self.kv
        parents = [i for i in sorted(self.reqs) if self.state_of(i) == "running"]
        if not parents or len(self.forks) >= 3:
            return
        # Mostly the oldest parent whose next decode copies: a preemption then frees blocks
        # for that copy, and the copy must run after the victim's blocks went to the host.
        copying = [i for i in parents if kv.seq_len(i) % self.bs
                   and kv.num_computed(i) == kv.seq_len(i) == len(self.reqs[i].codes) - 1]
        if copying and data.draw(st.integers(0, 3), label="copying parent?"):
            parent = copying[0]
        else:
            parent = data.draw(st.sampled_from(parents), label="fork parent")
        child, self.next_fork = self.next_fork, self.next_fork + 1
        self.kv.fork(parent, child)
        self.forks[child] = self.reqs[parent].codes[: self.kv.seq_len(parent)]
        note(f"fork {parent} -> {child}")

    def free_fork(self, data: st.DataObject) -> None:
        assert self.kv is not None
        if self.forks:
            child = data.draw(st.sampled_from(sorted(self.forks)), label="free fork")
            self.kv.free_sequence(child)
            del self.forks[child]

    # --------------------------------------------------------------------- step

    @rule(data=st.data())
    def serve(self, data: st.DataObject) -> None:
        """Arrivals (maybe), then steps: the loop of a server (one rule, so that hypothesis'
        swarm testing, which turns whole rules off, never leaves requests without steps)."""
        for _ in range(data.draw(st.integers(0, 2), label="arrivals")):
            if len(self.reqs) < MAX_LIVE:
                self.add_request(data)
        if data.draw(st.integers(0, 3), label="fork first?") == 0:
            self.fork(data)
        for _ in range(data.draw(st.integers(1, 4), label="steps")):
            fail = data.draw(st.sampled_from([None, None, 0, -1, -1, 1]), label="fail at run")
            scribble = data.draw(st.booleans(), label="scribble")
            mid = data.draw(st.sampled_from(["none"] * 14 + ["abort", "finish"]), label="mid-plan")
            self.run_step(data, fail, scribble, mid)

    def drain(self) -> None:
        """Runs until every request has finished: nothing may be stuck."""
        assert self.kv is not None
        for child in list(self.forks):
            self.kv.free_sequence(child)
            del self.forks[child]
        for _ in range(500):
            if not self.reqs:
                break
            self.run_step(None, None, False, "none")
        assert not self.reqs, f"requests stuck: {sorted(self.reqs)} ({self.sched.stats()})"
        # An abort with rows in flight frees its blocks once that plan ran: one more step.
        self.run_step(None, None, False, "none")
        assert len(self.kv) == 0
        event("drained")

    def run_step(self, data: st.DataObject | None, fail: int | None, scribble: bool,
                 mid: str) -> None:
        assert self.kv is not None and self.sched is not None and self.tensors is not None
        kv, sched = self.kv, self.sched
        before = self.before()
        self.tensors.fail_at, self.tensors.scribble = fail, scribble
        try:
            plan = sched.step(now=0.0)
        except atb_mem.BlockMoveError as error:
            self.failed_step(before, error)
            self.run_step(data, None, False, "none")  # the next step works
            return
        finally:
            self.tensors.fail_at = None
        self.plan_ran()
        sched._check_invariants()
        self.check_plan(plan, before)
        self.in_flight = {int(i) for i in plan.seq_ids}

        # Requests ended between the plan and its execution: the plan still runs, every row.
        victims: list[int] = []
        if mid != "none" and data is not None and len(plan):
            rows = sorted({int(i) for i in plan.seq_ids})
            victims = data.draw(st.lists(st.sampled_from(rows), min_size=1, unique=True),
                                label=f"{mid} mid-plan")
            for seq_id in victims:
                if mid == "finish":
                    sched.finish(seq_id)
                    self.num_finished += 1
                else:
                    sched.abort(seq_id)
                self.end(seq_id)
            note(f"{mid} {victims} between plan and execution")
            event(f"{mid} between plan and execution")
        execute_plan(kv, plan)  # every row, even of requests ended since it was planned
        self.check_all_bytes()

        sample = [int(i) for i in plan.sample_seq_ids if int(i) not in victims]
        if data is not None:
            tokens = data.draw(st.lists(VOCAB, min_size=len(sample), max_size=len(sample)),
                               label="sampled")
        else:
            tokens = [(seq_id + len(self.reqs[seq_id].codes)) % 4 for seq_id in sample]
        finished = sched.on_tokens(sample, tokens) if sample else np.zeros(0, np.uint64)
        if sample:
            self.plan_ran()
        expected = set()
        for seq_id, token in zip(sample, tokens, strict=True):
            request = self.reqs[seq_id]
            request.codes.append(token if not request.by_count else -1 - seq_id)
            request.outputs += 1
            if request.outputs == request.max_new or token == self.sched.eos_token_id:
                expected.add(seq_id)
        assert {int(i) for i in finished} == expected
        for seq_id in expected:
            self.end(seq_id)
            self.num_finished += 1
            assert seq_id not in kv

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


SchedulerMachine.TestCase.settings = settings(
    max_examples=2000 if LONG else 60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_scheduler_state_machine = SchedulerMachine.TestCase


# ---- controls ------------------------------------------------------------------------------


def run_to_completion(kv: atb_mem.KVCachePool, sched: atb_mem.ContinuousBatchScheduler,
                      seq_id: int, codes: list[int]) -> None:
    """Steps until ``seq_id`` finishes, sampling token 3 each time, checking its bytes."""
    while seq_id in sched:
        plan = sched.step(now=0.0)
        execute_plan(kv, plan)
        check_bytes(kv, seq_id, codes)
        sched.on_tokens(plan.sample_seq_ids, [3] * len(plan.sample_seq_ids))
        codes.extend([3] * len(plan.sample_seq_ids))


def test_positive_control_identical_prompt_is_a_prefix_hit() -> None:
    kv = make_kv(16, 4, None)
    sched = atb_mem.ContinuousBatchScheduler(kv, max_num_batched_tokens=6, watermark=0.0)
    prompt = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    sched.add_request(1, prompt, 3)
    run_to_completion(kv, sched, 1, list(prompt))
    sched.add_request(2, prompt, 3)
    plan = sched.step(now=0.0)
    assert plan.seq_ids.tolist() == [2] and len(plan.prefill_seq_ids) == 1
    assert plan.query_lens[0] < len(prompt)  # 8 of the 10 tokens came from the cache
    assert plan.positions[0] == 8
    execute_plan(kv, plan)
    assert check_bytes(kv, 2, prompt) == len(prompt)


def test_negative_control_check_bytes_sees_one_wrong_byte() -> None:
    kv = make_kv(16, 4, 4)
    sched = atb_mem.ContinuousBatchScheduler(kv, max_num_batched_tokens=64, watermark=0.0)
    prompt = [2, 1, 0, 3, 3, 1]
    sched.add_request(1, prompt, 5)
    plan = sched.step(now=0.0)
    execute_plan(kv, plan)
    assert check_bytes(kv, 1, prompt) == 6
    block, offset = int(kv.block_table(1)[1]), 1  # position 5
    kv.value_cache(0)[block, offset, 0, 1] += 1
    with pytest.raises(AssertionError, match="position 5 of 6"):
        check_bytes(kv, 1, prompt)
    kv.value_cache(0)[block, offset, 0, 1] -= 1
    check_bytes(kv, 1, prompt)
    # On the host tier too.
    kv.swap_out([1])
    check_bytes(kv, 1, prompt)
    kv.host_kv_cache[0, 0, int(kv.block_table(1)[0]), 2, 0, 0] = GARBAGE
    with pytest.raises(AssertionError, match=r"\(host\): position 2"):
        check_bytes(kv, 1, prompt)
    # And a wrong reference token, as a prefix hit on another prompt's bytes would read.
    with pytest.raises(AssertionError, match="position 0"):
        check_bytes(kv, 1, [0, *prompt[1:]])


# ---- regressions ---------------------------------------------------------------------------


def test_regression_abort_between_plan_and_execution_serves_unwritten_blocks() -> None:
    """A request aborted after ``step()`` planned its prefill but before the runner executed
    the plan. The contract says the plan is still executed, every row ("even of requests
    aborted in the meantime"), because the blocks it computes joined the prefix cache when it
    was planned. But ``write_kv`` refuses the aborted rows' slots ("no sequence holds" their
    blocks), so a runner using it cannot write them — and the next identical prompt is served
    those never-written blocks as a prefix hit. Either ``write_kv`` must accept the rows of the
    plan just made, or an abort before execution must take their blocks out of the cache."""
    kv = make_kv(16, 4, None)
    sched = atb_mem.ContinuousBatchScheduler(kv, max_num_batched_tokens=64, watermark=0.0)
    prompt = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    sched.add_request(1, prompt, 3)
    plan = sched.step(now=0.0)
    sched.abort(1)  # the client went away while the forward pass was being launched
    refused = None
    try:
        execute_plan(kv, plan)  # every row, as the contract says
    except ValueError as error:  # found: "slot 4 is in block 1, which no sequence holds"
        refused = error
    sched.add_request(2, prompt, 3)
    plan = sched.step(now=0.0)
    execute_plan(kv, plan)
    try:
        check_bytes(kv, 2, prompt)
    except AssertionError as error:
        raise AssertionError(f"{error}; write_kv refused the aborted rows: {refused}") from None


def test_regression_abort_between_plan_and_execution_leaves_a_same_step_hit_unwritten() -> None:
    """The same, within one plan: request 2 (the same prompt, admitted in the same step) hits
    the blocks request 1's row computes — vLLM's rule, safe because the forward writes every
    row before attention reads. Request 1 is aborted before execution; ``write_kv`` refuses
    the plan (request 1's last block is held by nobody now), a runner can then write only the
    surviving rows, and request 2 — live, in this very plan — reads 8 positions nobody wrote.
    So it is ``write_kv`` (or abort, deferring its frees until the plan ran) that must give."""
    kv = make_kv(16, 4, None)
    sched = atb_mem.ContinuousBatchScheduler(kv, max_num_batched_tokens=64, watermark=0.0)
    prompt = [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    sched.add_request(1, prompt, 3)
    sched.add_request(2, prompt, 3)
    plan = sched.step(now=0.0)
    assert plan.seq_ids.tolist() == [1, 2] and plan.query_lens.tolist() == [10, 2]
    sched.abort(1)
    refused = None
    try:
        execute_plan(kv, plan)  # every row, as the contract says
    except ValueError as error:  # found: "slot 12 is in block 3, which no sequence holds"
        refused = error
        keep = np.repeat(plan.seq_ids != 1, plan.query_lens)  # what write_kv still takes
        key, value = kv_rows(plan_codes(plan)[keep], plan.positions[keep])
        kv.write_kv(0, plan.slot_mapping[keep], key, value)
    try:
        check_bytes(kv, 2, prompt)
    except AssertionError as error:
        raise AssertionError(f"{error}; write_kv refused the plan: {refused}") from None


def test_regression_lowering_max_num_seqs_while_running_overfills_the_batch() -> None:
    """``reconfigure(max_num_seqs=2)`` with 4 sequences running: the next plan still has 4
    rows (more than a runner sized for 2 takes) and the scheduler's own invariant check
    fails ("4 running > max_num_seqs 2"). The next step should keep the batch within the new
    limit (preempting or pausing the extra sequences), or reconfigure should refuse."""
    kv = atb_mem.KVCachePool(64, 4, device=None)
    sched = atb_mem.ContinuousBatchScheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    for seq_id in range(4):
        sched.add_request(seq_id, 4, 8)
    plan = sched.step(now=0.0)
    sched.on_tokens(plan.sample_seq_ids, [1] * len(plan.sample_seq_ids))
    try:
        sched.reconfigure(max_num_seqs=2)
    except ValueError:
        return  # refusing while 4 run would be a fix too
    plan = sched.step(now=0.0)
    assert sched.config["max_num_seqs"] == 2
    assert len(plan) <= 2, f"{len(plan)} rows planned with max_num_seqs=2"
    sched._check_invariants()


def test_regression_swapped_out_while_its_token_is_pending_never_runs_again() -> None:
    """Pipelined sampling (``on_tokens`` for plan N reported after plan N+1 was made, which
    the scheduler allows: "a sequence whose last token was computed waits for its sampled
    token before it is scheduled again"). Request 2 finishes its prefill in plan 1; before
    its token is reported, plan 2 swaps it out to give request 1's decode a block. Then
    ``on_tokens`` refuses its token ("no token to sample now"), and once swapped back in it
    is running with every token computed — waiting for a token that can no longer be
    reported — so it is never scheduled again and holds its blocks forever. (With
    ``preemption="recompute"`` the same request recomputes and samples again.)"""
    kv = make_kv(6, 2, 8)  # 5 usable blocks
    sched = atb_mem.ContinuousBatchScheduler(kv, max_num_batched_tokens=64, preemption="swap",
                                             watermark=0.0)
    sched.add_request(1, [0, 1, 2, 3], 6)  # 2 blocks
    plan0 = sched.step(now=0.0)
    execute_plan(kv, plan0)
    sched.add_request(2, [1, 1, 2, 2, 3, 3], 4)  # 3 blocks: the cache is full
    plan1 = sched.step(now=0.0)  # request 1 waits for its token; request 2 is prefilled
    execute_plan(kv, plan1)
    assert plan1.sample_seq_ids.tolist() == [2]
    sched.on_tokens(plan0.sample_seq_ids, [3])  # plan 0's token, one step late
    plan2 = sched.step(now=0.0)  # request 1's decode needs a block: request 2 is swapped out
    execute_plan(kv, plan2)
    assert plan2.preempted_seq_ids.tolist() == [2] and kv.is_swapped(2)
    with contextlib.suppress(ValueError):  # found: "sequence 2 has no token to sample now"
        sched.on_tokens(plan1.sample_seq_ids, [2])
    pending = plan2.sample_seq_ids.tolist()
    for _ in range(40):
        if pending:
            sched.on_tokens(pending, [3] * len(pending))
        plan = sched.step(now=0.0)
        execute_plan(kv, plan)
        pending = plan.sample_seq_ids.tolist()
    assert 1 not in sched
    assert 2 not in sched, f"request 2 never ran again: {sched.stats()}"


def test_regression_lowering_the_budget_without_chunking_strands_a_request() -> None:
    """``add_request`` refuses, without chunked prefill, a request that may need a prefill
    above ``max_num_batched_tokens``; ``reconfigure`` lowers the budget below one accepted
    already. That request is then admitted (taking its blocks) and never scheduled: it holds
    5 blocks forever. ``reconfigure`` should refuse, or such a prefill be chunked anyway."""
    kv = atb_mem.KVCachePool(64, 4, device=None)
    sched = atb_mem.ContinuousBatchScheduler(kv, max_num_batched_tokens=32,
                                             enable_chunked_prefill=False)
    sched.add_request(1, 20, 4)  # 24 tokens at most: within the budget of 32
    try:
        sched.reconfigure(max_num_batched_tokens=8)
    except ValueError:
        return  # refusing is a fix too
    for _ in range(20):
        plan = sched.step(now=0.0)
        if len(plan.sample_seq_ids):
            sched.on_tokens(plan.sample_seq_ids, [1] * len(plan.sample_seq_ids))
    assert 1 not in sched, f"request 1 never ran: {sched.stats()}, {len(kv)} on the cache"

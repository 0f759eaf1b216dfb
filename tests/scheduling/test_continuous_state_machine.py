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

The model and its checks are in ``continuous_model``, the runner's side in ``fake_runner``;
the problems this found are minimised in ``test_continuous_regressions``.

``ATB_MEM_LONG=1`` runs 2,000 examples instead of 60.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from hypothesis import event, note
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule

import atb_mem
from tests.scheduling.continuous_model import MAX_LIVE, TEMPLATES, VOCAB, ContinuousModel, Request
from tests.scheduling.fake_runner import execute_plan, flaky, make_kv
from tests.support.state_machine import machine_settings

LONG = os.environ.get("ATB_MEM_LONG") == "1"


class SchedulerMachine(ContinuousModel):
    """The rules: requests come and go, the server steps, and the cache is touched behind the
    scheduler's back."""

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


SchedulerMachine.TestCase.settings = machine_settings(max_examples=2000 if LONG else 60)
test_scheduler_state_machine = SchedulerMachine.TestCase

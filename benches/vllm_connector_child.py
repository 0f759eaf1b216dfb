"""The vLLM side of ``benches/vllm_connector.py``: runs in vLLM's virtualenv, in a fresh
process per configuration (``python vllm_connector_child.py JOB.json`` prints ``RESULT
{json}``), and holds ``TimedAtbMemConnector``, which vLLM imports from this module."""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

# AtbMemConnector, timed (below): vLLM imports this file as a module to find it.
CONNECTOR = {"kv_connector": "TimedAtbMemConnector",
             "kv_connector_module_path": "vllm_connector_child",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
         "request_finished", "take_events", "get_external_cache_hit_sources", "start_load_kv",
         "wait_for_save", "get_finished", "get_block_ids_with_load_errors")
_timed: dict[str, type] = {}
_hook_seconds: dict[str, float] = {}


# ---- the connector, timed ----------------------------------------------------------------------

def timed_connector() -> type:
    """``AtbMemConnector`` whose vLLM hooks add the seconds they took to its connector stats
    (``hook_seconds_scheduler``, ``hook_seconds_worker``), which vLLM sums into its frontend
    with the connector's other counts: the connector's own time, apart from the machine's
    noise."""
    if "class" in _timed:
        return _timed["class"]
    from atb_mem.integrations.vllm import AtbMemConnector
    from atb_mem.integrations.vllm.metrics import AtbMemConnectorStats

    def timed(name: str) -> Any:
        original = getattr(AtbMemConnector, name)

        def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                self.hook_seconds += time.perf_counter() - start
        return hook

    def get_kv_connector_stats(self: Any) -> Any:
        start = time.perf_counter()
        stats = AtbMemConnector.get_kv_connector_stats(self) or AtbMemConnectorStats(data={})
        role = "worker" if self._worker is not None else "scheduler"
        stats.data[f"hook_seconds_{role}"] = self.hook_seconds + time.perf_counter() - start
        self.hook_seconds = 0.0
        return stats

    members = {name: timed(name) for name in HOOKS}
    members.update(hook_seconds=0.0, get_kv_connector_stats=get_kv_connector_stats)
    _timed["class"] = type("TimedAtbMemConnector", (AtbMemConnector,), members)
    return _timed["class"]


def __getattr__(name: str) -> Any:
    if name == "TimedAtbMemConnector":  # vLLM's getattr, in each of its processes
        return timed_connector()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def distinct_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def _counters(llm: Any) -> dict[str, float]:
    found: dict[str, float] = {}
    for metric in llm.get_metrics():
        value = getattr(metric, "value", None)
        if isinstance(value, (int, float)):
            labels = getattr(metric, "labels", {}) or {}
            tier = labels.get("tier") or labels.get("direction") or labels.get("source")
            name = f"{metric.name}{{{tier}}}" if tier else metric.name
            found[name] = found.get(name, 0) + value
    return found


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {name: value - before.get(name, 0) for name, value in after.items()
            if value - before.get(name, 0)}


def _cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) so far of this process and of vLLM's processes under it
    (the engine core, its worker), by process title."""
    import psutil

    me = psutil.Process()
    found = {"frontend": sum(me.cpu_times()[:2])}
    for process in me.children(recursive=True):
        try:
            title = " ".join(process.cmdline()).split()[0] or process.name()
            found[title] = found.get(title, 0.0) + sum(process.cpu_times()[:2])
        except psutil.Error:
            continue
    return found


def _params(tokens: int) -> Any:
    from vllm import SamplingParams

    # The two likeliest tokens at each step: how near a tie the greedy choice was.
    return SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, logprobs=2)


def _request_row(output: Any, own_ttft: float) -> dict[str, Any]:
    metrics = output.metrics
    latency = getattr(metrics, "first_token_latency", 0.0) if metrics is not None else 0.0
    return {"prompt": len(output.prompt_token_ids), "cached": output.num_cached_tokens or 0,
            "ttft": latency or own_ttft, "own_ttft": own_ttft,
            "preemptions": getattr(metrics, "num_preemptions", 0) if metrics else 0,
            "tokens": list(output.outputs[0].token_ids),
            "margins": [_margin(step) for step in output.outputs[0].logprobs or []]}


def _margin(step: dict[int, Any]) -> float:
    """The log-probability by which the greedy token beat the next one."""
    best = sorted((entry.logprob for entry in step.values()), reverse=True)
    return float(best[0] - best[1]) if len(best) > 1 else float("inf")


def run_replay(llm: Any, talks: list[list[tuple[list[int], int]]], concurrent: int
               ) -> dict[str, Any]:
    """Every conversation to its end, ``concurrent`` at once, each next turn at the back."""
    engine = llm.llm_engine
    history: dict[int, list[int]] = {c: [] for c in range(len(talks))}
    next_turn = dict.fromkeys(history, 0)
    waiting, active = list(history), []
    arrived: dict[str, float] = {}
    first: dict[str, float] = {}
    # How many engine steps a turn waited for its first token (a load that made it wait a
    # step of its own would show here).
    arrived_step: dict[str, int] = {}
    steps_to_first: dict[str, int] = {}
    steps = 0
    rows: dict[str, dict[str, Any]] = {}
    before, cpu, hooks = _counters(llm), _cpu_seconds(), dict(_hook_seconds)
    start = time.perf_counter()
    while waiting or active or engine.has_unfinished_requests():
        while waiting and len(active) < concurrent:
            c = waiting.pop(0)
            active.append(c)
            message, reply = talks[c][next_turn[c]]
            history[c] = history[c] + message
            request_id = f"{c}-{next_turn[c]}"
            arrived[request_id] = time.perf_counter()
            arrived_step[request_id] = steps
            engine.add_request(request_id, {"prompt_token_ids": history[c]}, _params(reply))
        outputs = engine.step()
        steps += 1
        for output in outputs:
            request_id = output.request_id
            if request_id not in first and output.outputs[0].token_ids:
                first[request_id] = time.perf_counter() - arrived[request_id]
                steps_to_first[request_id] = steps - arrived_step[request_id]
            if not output.finished:
                continue
            c = int(request_id.split("-")[0])
            rows[request_id] = {**_request_row(output, first[request_id]),
                                "steps_to_first": steps_to_first[request_id]}
            history[c] = history[c] + list(output.outputs[0].token_ids)
            next_turn[c] += 1
            active.remove(c)
            if next_turn[c] < len(talks[c]):
                waiting.append(c)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "requests": rows, "cpu_seconds": _delta(_cpu_seconds(), cpu),
            "hook_seconds": _delta(_hook_seconds, hooks),
            "counters": _delta(_counters(llm), before)}


def run_batch(llm: Any, prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    """All ``prompts`` at once; the wall time and the steps that returned output."""
    engine = llm.llm_engine
    before, cpu, hooks = _counters(llm), _cpu_seconds(), dict(_hook_seconds)
    start = time.perf_counter()
    for at, prompt in enumerate(prompts):
        engine.add_request(f"d{at}", {"prompt_token_ids": prompt}, _params(tokens))
    steps, rows = 0, {}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += bool(outputs)
        for output in outputs:
            if output.finished:
                rows[output.request_id] = _request_row(output, 0.0)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "steps": steps, "requests": rows,
            "cpu_seconds": _delta(_cpu_seconds(), cpu),
            "hook_seconds": _delta(_hook_seconds, hooks),
            "counters": _delta(_counters(llm), before)}


def run_one_at_a_time(llm: Any, prompts: list[list[int]]) -> dict[str, Any]:
    before = _counters(llm)
    cached = []
    start = time.perf_counter()
    for prompt in prompts:
        output = llm.generate([{"prompt_token_ids": prompt}], _params(1), use_tqdm=False)[0]
        cached.append(output.num_cached_tokens or 0)
    return {"seconds": time.perf_counter() - start, "cached": cached,
            "counters": _delta(_counters(llm), before)}


def child(job: dict[str, Any]) -> dict[str, Any]:
    """One vLLM with ``job``'s configuration through ``job``'s phases."""
    from vllm import LLM

    arguments: dict[str, Any] = dict(
        model=job["model"], skip_tokenizer_init=True, dtype=job.get("dtype", "float32"),
        enable_prefix_caching=True, max_model_len=job["max_model_len"],
        max_num_seqs=job["max_num_seqs"], enforce_eager=True, disable_log_stats=False,
        seed=0, num_gpu_blocks_override=job["num_blocks"])
    if job.get("extra") is not None:
        arguments["kv_transfer_config"] = {**CONNECTOR,
                                           "kv_connector_extra_config": job["extra"]}
    llm = LLM(**arguments)
    manager = llm.llm_engine.logger_manager
    record = manager.record

    def recorded(*args: Any, **kwargs: Any) -> Any:
        stats = getattr(kwargs.get("scheduler_stats"), "kv_connector_stats", None) or {}
        for key, value in stats.items():
            if key.startswith("hook_seconds_"):
                _hook_seconds[key] = _hook_seconds.get(key, 0.0) + value
        return record(*args, **kwargs)

    manager.record = recorded
    result: dict[str, Any] = {"load_average_before": os.getloadavg()[0]}
    run_batch(llm, distinct_prompts(2, 300, job["vocab"], 10_000 + job["seed"]), 4)  # warm-up
    if "ready" in job:  # a paired run: both vLLMs start measuring together
        Path(job["ready"]).touch()
        deadline = time.monotonic() + 900
        while not Path(job["go"]).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    if "talks" in job:
        result["replay"] = run_replay(llm, job["talks"], job["max_num_seqs"])
    if "distinct" in job:
        result["distinct"] = [run_batch(llm, batch, job["distinct_tokens"])
                              for batch in job["distinct"]]
    if "one_at_a_time" in job:
        result["prefix"] = run_one_at_a_time(llm, job["one_at_a_time"])
    result["load_average_after"] = os.getloadavg()[0]  # the machine's, 1 minute
    return result


if __name__ == "__main__":
    print("RESULT " + json.dumps(child(json.loads(Path(sys.argv[1]).read_text()))), flush=True)

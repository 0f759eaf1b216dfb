"""Runs vLLM's CPU build (in its own virtualenv) for the connector's end-to-end tests.

``python vllm_run.py JOB_JSON``: starts one ``LLM`` (a tiny fp32 checkpoint, token-id
prompts, vLLM's prefix caching off so that only the connector serves a repeat), prints
``READY``, then per phase waits for a line on stdin (the test acts in between: corrupts a
file, kills a server; ``stop`` ends it) and prints ``RESULT {json}``: each prompt's greedy
tokens, their logprobs, ``num_cached_tokens``, and vLLM's counters. Requests of a phase run
one after another, so a repeat can hit what the one before it saved, or ``together``. With
``in_process`` vLLM's scheduler and worker run in this process: a phase may first ``abort``
a request while its load is in flight, and its result says what vLLM and the connector
still hold once every request ended (``held``).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any


def _counters(llm: Any) -> dict[str, float]:
    found: dict[str, float] = {}
    for metric in llm.get_metrics():
        value = getattr(metric, "value", None)
        if isinstance(value, (int, float)):
            labels = getattr(metric, "labels", {}) or {}
            tier = labels.get("tier") or labels.get("direction")
            name = f"{metric.name}{{{tier}}}" if tier else metric.name
            found[name] = found.get(name, 0) + value
    return found


def _drained(llm: Any) -> dict[str, int]:
    """Steps (with 1-token requests) until vLLM holds no request and no load is in flight
    (an aborted request's load ends on a later step); then what is still held."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    worker = get_kv_transfer_group()._worker
    for _ in range(200):
        if not scheduler.requests and not worker.num_loading:
            break
        llm.generate([{"prompt_token_ids": [7]}], SamplingParams(max_tokens=1), use_tqdm=False)
        time.sleep(0.05)
    pool = scheduler.kv_cache_manager.block_pool
    return {"free_blocks": pool.get_num_free_blocks(), "requests": len(scheduler.requests),
            "connector_requests": scheduler.connector._scheduler.num_requests,
            "loading": worker.num_loading}


def _abort_in_flight(llm: Any, prompt: list[int], params: Any) -> bool:
    """Starts ``prompt``, aborts it while its disk or store load is in flight; whether it
    was seen waiting for that load."""
    from vllm.v1.request import RequestStatus

    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    engine.add_request("in-flight", {"prompt_token_ids": prompt}, params)
    waiting = False
    for _ in range(100):
        engine.step()
        if any(request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
               for request in scheduler.requests.values()):
            waiting = True
            break
    engine.abort_request(["in-flight"])
    return waiting


class _EventCounts:
    """Blocks per ``KIND/MEDIUM`` in vLLM's KV-event stream (ZMQ), from a thread."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self.counts: dict[str, int] = {}
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.bind(endpoint)  # vLLM's publisher connects to a host:port endpoint
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        threading.Thread(target=self._listen, daemon=True).start()

    def _listen(self) -> None:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while True:
            _, _, payload = self._socket.recv_multipart()
            try:
                batch = decoder.decode(payload)
            except Exception as error:  # shown in the result
                self.counts[f"undecodable: {error}"] = 1
                continue
            for event in batch.events:
                name = f"{type(event).__name__}/{getattr(event, 'medium', None)}"
                blocks = len(getattr(event, "block_hashes", ()))
                self.counts[name] = self.counts.get(name, 0) + blocks

    def settled(self) -> dict[str, int]:
        """The counts once none changed for half a second (at most 10 s)."""
        last: dict[str, int] | None = None
        for _ in range(20):
            time.sleep(0.5)
            if self.counts == last:
                break
            last = dict(self.counts)
        return dict(self.counts)


def main() -> None:
    job = json.loads(sys.argv[1])
    if job.get("in_process"):  # the scheduler and the worker inspectable from here
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    arguments: dict[str, Any] = dict(
        model=job["model"], skip_tokenizer_init=True, dtype="float32",
        enable_prefix_caching=False, max_model_len=job.get("max_model_len", 2048),
        max_num_seqs=job.get("max_num_seqs", 8), enforce_eager=True, disable_log_stats=False,
        seed=0)
    if job.get("in_process"):
        arguments["distributed_executor_backend"] = "uni"
    events = None
    if job.get("kv_events_port"):
        endpoint = f"tcp://127.0.0.1:{job['kv_events_port']}"
        arguments["kv_events_config"] = {"enable_kv_cache_events": True, "publisher": "zmq",
                                         "endpoint": endpoint}
        events = _EventCounts(endpoint)
    if job.get("num_blocks"):
        arguments["num_gpu_blocks_override"] = job["num_blocks"]
    if job.get("extra") is not None:
        arguments["kv_transfer_config"] = {
            "kv_connector": job.get("connector", "AtbMemConnector"),
            "kv_connector_module_path": job.get("module", "atb_mem.integrations.vllm"),
            "kv_role": "kv_both", "kv_connector_extra_config": job["extra"]}
    try:
        llm = LLM(**arguments)
    except Exception as error:
        print("STARTUP_ERROR " + json.dumps(f"{type(error).__name__}: {error}"), flush=True)
        return
    print("READY", flush=True)
    for phase in job["phases"]:
        line = sys.stdin.readline()
        if not line or line.strip() == "stop":
            break
        params = SamplingParams(max_tokens=phase.get("max_tokens", 8), temperature=0,
                                logprobs=0)
        result: dict[str, Any] = {"tokens": [], "logprobs": [], "cached": []}
        if "abort" in phase:
            result["waited"] = _abort_in_flight(llm, phase["abort"], params)
        together = phase.get("together", False)  # one batch: they compete for blocks
        batches = [phase["prompts"]] if together else [[prompt] for prompt in phase["prompts"]]
        outputs = [output for batch in batches for output in llm.generate(
            [{"prompt_token_ids": prompt} for prompt in batch], params, use_tqdm=False)]
        for output in outputs:
            completion = output.outputs[0]
            result["tokens"].append(list(completion.token_ids))
            result["logprobs"].append([
                float(step[token].logprob) for step, token in
                zip(completion.logprobs or [], completion.token_ids, strict=True)])
            result["cached"].append(output.num_cached_tokens)
        if job.get("in_process"):
            result["held"] = _drained(llm)
        if events is not None:
            result["events"] = events.settled()
        scheduler_config = llm.llm_engine.vllm_config.scheduler_config
        result["hybrid_manager"] = not scheduler_config.disable_hybrid_kv_cache_manager
        print("RESULT " + json.dumps({**result, "counters": _counters(llm)}), flush=True)


if __name__ == "__main__":
    main()

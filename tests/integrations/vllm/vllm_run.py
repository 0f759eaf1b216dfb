"""Runs vLLM's CPU build (in its own virtualenv) for the connector's end-to-end tests.

``python vllm_run.py JOB_JSON``: starts one ``LLM`` (a tiny fp32 checkpoint, token-id
prompts, vLLM's prefix caching off so that only the connector serves a repeat), prints
``READY``, then per phase waits for a line on stdin (the test acts in between: corrupts a
file, kills a server; ``stop`` ends it) and prints ``RESULT {json}``: each prompt's greedy
tokens, their logprobs, ``num_cached_tokens``, and vLLM's counters. Requests of a phase run
one after another, so a repeat can hit what the one before it saved.
"""

from __future__ import annotations

import json
import sys
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


def main() -> None:
    job = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams

    arguments: dict[str, Any] = dict(
        model=job["model"], skip_tokenizer_init=True, dtype="float32",
        enable_prefix_caching=False, max_model_len=job.get("max_model_len", 2048),
        max_num_seqs=job.get("max_num_seqs", 8), enforce_eager=True, disable_log_stats=False,
        seed=0)
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
        result: dict[str, list[Any]] = {"tokens": [], "logprobs": [], "cached": []}
        for prompt in phase["prompts"]:
            output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
            completion = output.outputs[0]
            result["tokens"].append(list(completion.token_ids))
            result["logprobs"].append([
                float(step[token].logprob) for step, token in
                zip(completion.logprobs or [], completion.token_ids, strict=True)])
            result["cached"].append(output.num_cached_tokens)
        print("RESULT " + json.dumps({**result, "counters": _counters(llm)}), flush=True)


if __name__ == "__main__":
    main()

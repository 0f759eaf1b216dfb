"""Prefix-cache replays for ``atb-mem bench prefix``: prompts with shared prefixes generated
deterministically from a trace's lengths, replayed through a ``KVCachePool`` (bookkeeping
only) per eviction policy, block size and cache size.

A request's prompt is one of a few system prompts (of 300 to 2,000 tokens, the popular ones
more often; real ones end anywhere, not at a block boundary), then either a new user message
as long as the trace's prompt says, or — for about a third of the requests — the next turn
of one of the last few conversations: its whole history (prompts and replies) and a short
new message. Requests run one at a time: what is measured is which cached prefixes each
policy keeps, not how requests overlap.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import atb_mem
from atb_mem._core import EVICTION_POLICIES
from atb_mem.tools.simulate import Request, load_trace

__all__ = ["EVICTION_POLICIES", "PrefixRequest", "best_policy", "prefix_requests",
           "replay_prefixes"]


SEED = 0
SYSTEM_PROMPTS = (300, 700, 1200, 2000)
SYSTEM_WEIGHTS = (0.5, 0.25, 0.15, 0.1)
FOLLOW_UP_SHARE = 0.3
RECENT_CONVERSATIONS = 16  # a follow-up continues one of these
VOCAB = 32_000


@dataclass(frozen=True)
class PrefixRequest:
    prompt: list[int]
    output: list[int]
    system: int  # the system prompt's tokens, at the prompt's start


def prefix_requests(trace: str | list[Request], limit: int | None = None
                    ) -> list[PrefixRequest]:
    """The trace's requests (a file, or its loaded requests) as prompts with shared
    prefixes (deterministic)."""
    rng = np.random.default_rng(SEED)
    systems = [rng.integers(0, VOCAB, size).tolist() for size in SYSTEM_PROMPTS]
    histories: list[tuple[int, list[int]]] = []
    requests = []
    traced_requests = load_trace(trace, limit) if isinstance(trace, str) else trace[:limit]
    for traced in traced_requests:
        output = rng.integers(0, VOCAB, min(traced.output, 512)).tolist()
        if histories and rng.random() < FOLLOW_UP_SHARE:
            turn = len(histories) - 1 - int(rng.integers(min(len(histories),
                                                              RECENT_CONVERSATIONS)))
            system_tokens, history = histories[turn]
            prompt = history + rng.integers(0, VOCAB, 32).tolist()
            histories[turn] = (system_tokens, prompt + output)
        else:
            system = systems[int(rng.choice(len(systems), p=SYSTEM_WEIGHTS))]
            system_tokens = len(system)
            message = max(16, traced.prompt - len(system))
            prompt = system + rng.integers(0, VOCAB, message).tolist()
            histories.append((system_tokens, prompt + output))
        requests.append(PrefixRequest(prompt, output, system_tokens))
    return requests


def replay_prefixes(requests: list[PrefixRequest], num_blocks: int, block_size: int,
                    policy: str, hash_block_size: int | None = None) -> dict[str, float]:
    """Replays ``requests`` one at a time; returns the hit rate (prompt tokens served from the
    cache), the prefill tokens saved, the evictions and the requests too long to run."""
    kv = atb_mem.KVCachePool(num_blocks, block_size, device=None, eviction_policy=policy,
                             hash_block_size=hash_block_size)
    core = kv.core  # several calls per request: the core's, without a Python frame each
    room = (num_blocks - 1) * block_size
    prompt_tokens = saved = skipped = 0
    for seq_id, request in enumerate(requests):
        if len(request.prompt) + len(request.output) > room:
            skipped += 1
            continue
        saved += core.alloc_sequence(seq_id, request.prompt)
        if policy == "priority":  # the application pins its system prompts
            core.set_retention(seq_id, [(0, request.system, 100, None)])
        prompt_tokens += len(request.prompt)
        core.mark_computed(seq_id)
        if request.output:
            core.append_tokens([seq_id], len(request.output), token_ids=request.output)
            core.mark_computed(seq_id)
        core.free_sequence(seq_id)
    stats = kv.stats()
    return {"hit_rate": saved / max(1, prompt_tokens), "prefill_tokens_saved": saved,
            "prompt_tokens": prompt_tokens, "evictions": stats["evictions"],
            "skipped": skipped}


def best_policy(requests: list[PrefixRequest], cache_tokens: int, block_size: int,
                policies: list[str]) -> list[dict[str, float | str | int]]:
    """Every policy (and, on blocks a 16-token hash divides, ``hash_block_size=16``) replayed
    at one cache size, the most prefill saved first: what ``atb-mem tune`` picks from."""
    pieces: list[int | None] = [None]
    if block_size > 16 and block_size % 16 == 0:
        pieces.append(16)
    rows: list[dict[str, float | str | int]] = []
    num_blocks = max(2, cache_tokens // block_size)
    for policy in policies:
        for piece in pieces:
            result = replay_prefixes(requests, num_blocks, block_size, policy, piece)
            rows.append({"eviction_policy": policy, "hash_block_size": piece or block_size,
                         **result})
    rows.sort(key=lambda row: -float(row["prefill_tokens_saved"]))
    return rows

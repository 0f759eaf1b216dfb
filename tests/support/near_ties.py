"""HF equality for bfloat16, where rounding alone may pick another of two nearly equal
tokens: a request may leave HF's greedy tokens only at a near tie, where HF's margin between
its token and the engine's is at most twice the largest difference between HF's own two
attention paths (sdpa and eager) at that position. After the first differing token the two
continue from different text, so that is the only one a request can be judged by."""

from __future__ import annotations

from typing import Any

from tests.support.models import hf_tokens, require_torch


def hf_last_logits(reference: Any, tokens: list[int], implementation: str) -> Any:
    """HF's float64 logits after ``tokens`` with the attention ``implementation``."""
    torch = require_torch()
    before = reference.config._attn_implementation
    reference.set_attn_implementation(implementation)
    try:
        with torch.inference_mode():
            logits = reference(torch.tensor([tokens], device=reference.device)).logits
    finally:
        reference.set_attn_implementation(before)
    return logits[0, -1].double()


def assert_each_matches_hf_up_to_near_ties(
        results: dict[str, Any], reference: Any,
        arrivals: dict[int, list[tuple[str, list[int], Any]]]) -> list[str]:
    """Every request of ``arrivals`` (``run_poisoned``'s) got HF's greedy tokens up to its
    first differing token, and that one is a near tie. Returns the requests that differ."""
    differing = []
    for requests in arrivals.values():
        for request_id, prompt, params in requests:
            expected = hf_tokens(reference, prompt, params.max_tokens)
            got = results[request_id][0][0]
            assert len(got) == len(expected), f"{request_id}: {got} against HF's {expected}"
            if got == expected:
                continue
            at = next(index for index, (a, b) in enumerate(zip(got, expected, strict=True))
                      if a != b)
            context = prompt + expected[:at]
            sdpa = hf_last_logits(reference, context, "sdpa")
            noise = float((sdpa - hf_last_logits(reference, context, "eager")).abs().max())
            margin = float(sdpa[expected[at]] - sdpa[got[at]])
            assert margin <= 2 * noise, (
                f"{request_id}: token {at} is {got[at]} against HF's {expected[at]}, HF's margin "
                f"{margin:.4g} above twice its sdpa-eager difference {noise:.4g}")
            differing.append(request_id)
    return differing

"""Choosing each sequence's next token from its logits.

A row that cannot be sampled (logits with NaN or +inf, a generator that refuses) fails
alone: its error comes back beside the other rows' tokens, so the engine ends that request
and the rest of the batch goes on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from atb_mem.serving.params import SamplingParams

if TYPE_CHECKING:
    import torch

__all__ = ["SampledTokens", "sample", "sample_generator"]


class SampledTokens(NamedTuple):
    tokens: np.ndarray
    """int32 ``[rows]``; -1 where the row failed."""
    failures: dict[int, Exception]
    """The rows that failed, with why."""


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> SampledTokens:
    """One token per row of ``logits`` (``[rows, vocab]``), by the row's params; a row with a
    generator draws from it alone."""
    import torch

    # One pass over the vocabulary: a row's maximum is NaN where it holds a NaN (max
    # propagates it) and +inf where it holds +inf, and its index is the greedy token.
    highest, tokens = logits.max(dim=-1)
    broken = (torch.isnan(highest) | torch.isposinf(highest)).tolist()
    failures: dict[int, Exception] = {}
    for row, (row_params, generator) in enumerate(zip(params, generators, strict=True)):
        if broken[row]:
            # NaN or +inf logits come from the model (or stale K/V), never from the request:
            # no token drawn from them means anything (-inf is a masked token, and fine).
            failures[row] = FloatingPointError("the model's logits for this sequence hold NaN "
                                               "or +inf")
            continue
        if row_params.greedy:
            continue
        try:
            tokens[row] = _draw(logits[row], row_params, generator)
        except (RuntimeError, ValueError) as error:  # torch's refusals
            failures[row] = error
    out = tokens.to(torch.int32).cpu().numpy()
    out[list(failures)] = -1
    return SampledTokens(out, failures)


def _draw(logits: torch.Tensor, params: SamplingParams,
          generator: torch.Generator | None) -> torch.Tensor:
    import torch

    # In float32: a float16 row divided by a small temperature overflows.
    scores = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1:
        ordered, order = torch.sort(scores, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always).
        drop = torch.cumsum(probs, dim=-1) - probs >= params.top_p
        scores = scores.scatter(0, order, ordered.masked_fill(drop, float("-inf")))
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[0]


def sample_generator(params: SamplingParams, index: int, device: Any) -> torch.Generator | None:
    """Sample ``index``'s own generator when the request is seeded (``seed + index``)."""
    if params.seed is None or params.greedy:
        return None
    import torch

    return torch.Generator(device=device).manual_seed(params.seed + index)

"""Choosing each sequence's next token from its logits."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from atb_mem.serving.params import SamplingParams

if TYPE_CHECKING:
    import torch

__all__ = ["sample"]


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> np.ndarray:
    """One token per row of ``logits`` (``[rows, vocab]``), by the row's params; a row with a
    generator draws from it alone. Returns int32 ``[rows]``."""
    import torch

    tokens = logits.argmax(dim=-1)
    for row, (row_params, generator) in enumerate(zip(params, generators, strict=True)):
        if row_params.greedy:
            continue
        scores = logits[row] / row_params.temperature
        if row_params.top_k > 0 and row_params.top_k < scores.shape[-1]:
            kth = torch.topk(scores, row_params.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if row_params.top_p < 1:
            ordered, order = torch.sort(scores, descending=True)
            probs = torch.softmax(ordered, dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (the first token always).
            drop = torch.cumsum(probs, dim=-1) - probs >= row_params.top_p
            scores = scores.scatter(0, order, ordered.masked_fill(drop, float("-inf")))
        probs = torch.softmax(scores, dim=-1)
        tokens[row] = torch.multinomial(probs, 1, generator=generator)[0]
    return tokens.to(torch.int32).cpu().numpy()

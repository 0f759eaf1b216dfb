"""What a request's prompt may be, and which tokens end a sequence."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["Prompt", "eos_token_ids", "prompt_list", "prompt_token_ids"]

Prompt = str | Sequence[int]
"""Text (the engine needs a tokenizer) or token ids."""


def prompt_list(prompts: Any) -> list[Prompt]:
    """One prompt (text or token ids) or a sequence of them, as a list of prompts."""
    one: list[Prompt] = [prompts]
    if isinstance(prompts, str) or (isinstance(prompts, np.ndarray) and prompts.ndim == 1):
        return one
    items = list(prompts)
    if items and not isinstance(items[0], str | Sequence | np.ndarray):
        return one  # token ids
    return items


def prompt_token_ids(prompt: Prompt, tokenizer: Any, vocab_size: int) -> list[int]:
    """A prompt's token ids, checked: text is tokenized (it needs a tokenizer); ids must be
    ints in ``[0, vocab_size)``; none is empty."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer: give Engine one, or token ids")
        token_ids = list(tokenizer(prompt)["input_ids"])
    else:
        token_ids = np.asarray(prompt).reshape(-1).tolist()
    if not token_ids:
        raise ValueError("the prompt is empty")
    for token in token_ids:
        if isinstance(token, bool) or not isinstance(token, int) or \
                not 0 <= token < vocab_size:
            raise ValueError(f"prompt token {token!r} is not an id in [0, {vocab_size})")
    return [int(token) for token in token_ids]


def eos_token_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    generation = getattr(model, "generation_config", None)
    for source in (getattr(generation, "eos_token_id", None),
                   getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source is not None:
            ids.update(int(token) for token in source)
    return frozenset(ids)

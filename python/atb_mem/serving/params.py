"""What a request asks for (vLLM's names), and what it gets back."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from atb_mem.kv.retention import Range, Retention

__all__ = ["GREEDY_BELOW", "SEED_LIMIT", "CompletionOutput", "FinishReason", "RequestOutput",
           "SamplingParams"]

FinishReason = Literal["stop", "length", "abort", "error"]

GREEDY_BELOW = 1e-5
"""A ``temperature`` below this is greedy (vLLM's floor): dividing logits by less overflows
them to infinity, and sampling from the result would be greedy anyway."""

SEED_LIMIT = 2**64
"""Seeds are 64-bit: sample ``i`` of ``n`` draws from ``seed + i``, so ``seed + n - 1`` must
stay below this."""


def _int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return value


def _float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {value}")
    return number


@dataclass(frozen=True)
class SamplingParams:
    """How to sample a request's tokens.

    ``temperature`` 0 is greedy, and so is any below ``GREEDY_BELOW`` (1e-5); ``top_k`` -1 (or
    0) and ``top_p`` 1 keep every token. A ``seed`` gives the request its own generator
    (sample ``i`` of ``n`` uses ``seed + i``, so ``seed + n - 1 < 2**64``), so its tokens are
    the same run after run, whatever else is in the batch. ``n`` samples share
    one prefill of the prompt. A request stops at ``max_tokens`` new tokens, at one of
    ``stop_token_ids``, or at the tokenizer's end-of-sequence token unless ``ignore_eos``.
    ``priority``: lower numbers are scheduled first. With ``eviction_policy="priority"``,
    ``retention`` = [(start, end or None, priority 0-100, duration_s or None), ...] and
    ``decode_retention`` = (priority, duration_s or None) say what the prefix cache keeps
    longest (see ``atb_mem.kv.retention``).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    n: int = 1
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    priority: int = 0
    retention: tuple[Range, ...] | list[Range] | None = None
    decode_retention: tuple[int, float | None] | None = None
    _retention: Retention | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _int("max_tokens", self.max_tokens, 1)
        _int("n", self.n, 1)
        _int("top_k", self.top_k, -1)
        if _float("temperature", self.temperature) < 0:
            raise ValueError(f"temperature must be at least 0, got {self.temperature}")
        if not 0 < _float("top_p", self.top_p) <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and _int("seed", self.seed, 0) + self.n - 1 >= SEED_LIMIT:
            raise ValueError(f"seed + n - 1 must be below 2**64 (sample i draws from seed + "
                             f"i), got seed={self.seed} with n={self.n}")
        stops = tuple(self.stop_token_ids or ())
        for token in stops:
            _int("a stop token id", token, 0)
        object.__setattr__(self, "stop_token_ids", stops)
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {type(self.ignore_eos).__name__}")
        if _int("priority", self.priority, 0) >= 2**32:
            raise ValueError(f"priority must be below 2**32, got {self.priority}")
        retention = Retention.of(self.retention, self.decode_retention)  # checks them
        object.__setattr__(self, "_retention", retention)
        if retention is not None:
            object.__setattr__(self, "retention", retention.ranges)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def retention_config(self) -> Retention | None:
        """``retention`` and ``decode_retention`` as the scheduler takes them."""
        return self._retention


@dataclass
class CompletionOutput:
    """One of a request's ``n`` samples: its tokens (all of them from ``generate``, this
    step's from ``step``), their text when the engine has a tokenizer, and why it ended."""

    index: int
    token_ids: list[int]
    text: str = ""
    finish_reason: FinishReason | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's samples; ``finished`` once every sample is. ``error`` says why a request
    that failed in the engine (its samples end with ``"error"``) failed; the other requests
    of its step went on."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    error: str | None = None

"""OpenAI's request and response shapes for completions and chat completions (the fields
atb-mem serves; vLLM's extensions ``top_k``, ``stop_token_ids``, ``ignore_eos`` and
``priority`` too, and atb-mem's ``retention`` and ``decode_retention``)."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from atb_mem.serving.params import SEED_LIMIT, CompletionOutput, SamplingParams

__all__ = ["ChatCompletionRequest", "CompletionRequest", "chat_chunk", "chat_response",
           "completion_chunk", "completion_response", "error_body"]


class _Sampling(BaseModel):
    """Fields both endpoints share. Unknown fields are ignored, as OpenAI's own server does
    for ones it does not know; ones that would change the result unseen are refused. Types
    are strict (``"5"`` is not a number, ``"yes"`` not a bool) and numbers finite."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    model: str
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    n: int = Field(1, ge=1, le=64)
    seed: int | None = Field(None, ge=0, lt=SEED_LIMIT)
    stream: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: Any = None
    # vLLM's scheduling priority (lower first), and atb-mem's retention (SamplingParams').
    priority: int = Field(0, ge=0, lt=2**32)
    retention: list[Any] | None = None
    decode_retention: list[Any] | None = None

    def unsupported(self) -> str | None:
        if self.stop:
            return "stop strings are not supported; use stop_token_ids"
        if self.logprobs:
            return "logprobs are not supported"
        return None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        retention = None if self.retention is None else [
            tuple(entry) if isinstance(entry, list) else entry for entry in self.retention]
        decode = None if self.decode_retention is None else tuple(self.decode_retention)
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature,
                              top_p=self.top_p, top_k=self.top_k, seed=self.seed, n=self.n,
                              stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                              priority=self.priority, retention=retention,
                              decode_retention=decode)


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    max_tokens: int | None = Field(16, ge=1)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)


def _header(kind: str, request_id: str, model: str) -> dict[str, Any]:
    return {"id": f"{kind}-{request_id}-{uuid.uuid4().hex[:8]}", "created": int(time.time()),
            "model": model}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_response(request_id: str, model: str, prompt_tokens: int,
                        outputs: list[CompletionOutput]) -> dict[str, Any]:
    return {**_header("cmpl", request_id, model), "object": "text_completion",
            "choices": [{"index": one.index, "text": one.text, "logprobs": None,
                         "finish_reason": one.finish_reason} for one in outputs],
            "usage": _usage(prompt_tokens, sum(len(one.token_ids) for one in outputs))}


def completion_chunk(header: dict[str, Any], one: CompletionOutput) -> dict[str, Any]:
    return {**header, "object": "text_completion",
            "choices": [{"index": one.index, "text": one.text, "logprobs": None,
                         "finish_reason": one.finish_reason}]}


def chat_response(request_id: str, model: str, prompt_tokens: int,
                  outputs: list[CompletionOutput]) -> dict[str, Any]:
    return {**_header("chatcmpl", request_id, model), "object": "chat.completion",
            "choices": [{"index": one.index, "logprobs": None,
                         "message": {"role": "assistant", "content": one.text},
                         "finish_reason": one.finish_reason} for one in outputs],
            "usage": _usage(prompt_tokens, sum(len(one.token_ids) for one in outputs))}


def chat_chunk(header: dict[str, Any], index: int, delta: dict[str, str],
               finish_reason: str | None) -> dict[str, Any]:
    return {**header, "object": "chat.completion.chunk",
            "choices": [{"index": index, "delta": delta, "logprobs": None,
                         "finish_reason": finish_reason}]}


def header(kind: str, request_id: str, model: str) -> dict[str, Any]:
    """The ``id``, ``created`` and ``model`` every chunk of one streamed response shares."""
    return _header(kind, request_id, model)


def error_body(message: str, kind: str = "invalid_request_error",
               param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}

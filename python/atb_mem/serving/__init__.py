"""Serving transformers models through atb-mem: ``Engine``, ``SamplingParams`` and the
outputs (vLLM's names), and the OpenAI-compatible server behind ``atb-mem serve``."""

from atb_mem.serving.engine import Engine
from atb_mem.serving.params import CompletionOutput, FinishReason, RequestOutput, SamplingParams

__all__ = ["CompletionOutput", "Engine", "FinishReason", "RequestOutput", "SamplingParams"]

"""Tiny transformers models built from configs (nothing is downloaded), their HF reference
outputs, and NaN poisoning of the blocks nothing may read."""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest

from tests.support.devices import require_torch

ARCHITECTURES = ["llama", "qwen3", "qwen3_moe"]
# Sliding-window and chunked attention, with a window of WINDOW tokens.
HYBRID_ARCHITECTURES = ["mistral", "gemma3", "gpt_oss", "llama4"]
RECURRENT_ARCHITECTURES = ["granitemoehybrid", "qwen3_next"]
WINDOW = 6

_SHARED = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 512}


def require_transformers() -> Any:
    """transformers; skipped without it, or failed when ATB_MEM_REQUIRE_TORCH is set (CI)."""
    require_torch()
    try:
        import transformers
    except ImportError:
        if os.environ.get("ATB_MEM_REQUIRE_TORCH"):
            pytest.fail("transformers is required here (ATB_MEM_REQUIRE_TORCH is set)")
        pytest.skip("transformers is not installed")
    return transformers


def tiny_model(architecture: str, seed: int = 0) -> Any:
    """A float32 model in eval mode: Llama; Qwen3 (q/k norms, explicit head_dim); Qwen3 with
    Qwen3-0.6B's attention shapes; Qwen3-MoE (4 experts, 2 per token, in every layer)."""
    transformers = require_transformers()
    torch = require_torch()
    if architecture == "llama":
        config = transformers.LlamaConfig(**_SHARED)
        cls = transformers.LlamaForCausalLM
    elif architecture == "qwen3":
        config = transformers.Qwen3Config(**_SHARED, head_dim=32)
        cls = transformers.Qwen3ForCausalLM
    elif architecture == "qwen3_shapes":
        # Qwen3-0.6B's attention: 16 query and 8 KV heads of 128, tied embeddings.
        config = transformers.Qwen3Config(**{**_SHARED, "num_attention_heads": 16,
                                             "num_key_value_heads": 8}, head_dim=128,
                                          tie_word_embeddings=True)
        cls = transformers.Qwen3ForCausalLM
    elif architecture == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**_SHARED, head_dim=16, moe_intermediate_size=32,
                                             num_experts=4, num_experts_per_tok=2,
                                             decoder_sparse_step=1, mlp_only_layers=[])
        cls = transformers.Qwen3MoeForCausalLM
    elif architecture in HYBRID_ARCHITECTURES:
        config, cls = _hybrid_config(transformers, architecture)
    elif architecture in RECURRENT_ARCHITECTURES:
        config, cls = _recurrent_config(transformers, architecture)
    else:
        raise ValueError(architecture)
    torch.manual_seed(seed)
    return cls(config).eval()


def _hybrid_config(transformers: Any, architecture: str) -> tuple[Any, Any]:
    """Mistral (every layer sliding); Gemma 3 text and gpt-oss (sliding and full layers; gpt-oss
    with attention sinks and experts); Llama 4 text (chunked and full layers, experts)."""
    shared = {**_SHARED, "num_hidden_layers": 3}
    mixed = ["sliding_attention", "full_attention", "sliding_attention"]
    if architecture == "mistral":
        return (transformers.MistralConfig(**shared, sliding_window=WINDOW),
                transformers.MistralForCausalLM)
    if architecture == "gemma3":
        return (transformers.Gemma3TextConfig(**shared, head_dim=16, sliding_window=WINDOW,
                                              layer_types=mixed),
                transformers.Gemma3ForCausalLM)
    if architecture == "gpt_oss":
        return (transformers.GptOssConfig(**shared, head_dim=16, sliding_window=WINDOW,
                                          layer_types=mixed, num_local_experts=4,
                                          num_experts_per_tok=2),
                transformers.GptOssForCausalLM)
    # Llama 4: NoPE layers attend fully, the others in chunks (temperature tuning off: it reads
    # positions from HF's own cache, which atb-mem replaces).
    return (transformers.Llama4TextConfig(**shared, head_dim=16, attention_chunk_size=WINDOW,
                                          no_rope_layers=[1, 0, 1], num_local_experts=2,
                                          num_experts_per_tok=1, interleave_moe_layer_step=1,
                                          intermediate_size_mlp=128,
                                          attn_temperature_tuning=False),
            transformers.Llama4ForCausalLM)


def _recurrent_config(transformers: Any, architecture: str) -> tuple[Any, Any]:
    """Recurrent layers beside attention: Granite 4.0-H (Mamba2 mixers, then an attention
    layer, then a Mamba2 one) and Qwen3-Next (gated delta-nets, full attention every third
    layer, experts)."""
    shared = {**_SHARED, "num_hidden_layers": 4}
    if architecture == "granitemoehybrid":
        return (transformers.GraniteMoeHybridConfig(
            **shared, layer_types=["linear_attention", "linear_attention", "full_attention",
                                   "linear_attention"],
            mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16,
            mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, num_local_experts=0,
            shared_intermediate_size=128, position_embedding_type="rope"),
            transformers.GraniteMoeHybridForCausalLM)
    return (transformers.Qwen3NextConfig(
        **shared, head_dim=16, full_attention_interval=3, linear_conv_kernel_dim=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, decoder_sparse_step=1),
        transformers.Qwen3NextForCausalLM)


def model_pair(architecture: str, seed: int = 0) -> tuple[Any, Any]:
    """(a model for the engine, which switches its attention; an identical HF reference)."""
    model = tiny_model(architecture, seed)
    return model, copy.deepcopy(model)


def hf_greedy(reference: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF's own ``generate``: greedy, stopping at the model's EOS like the engine."""
    torch = require_torch()
    with torch.inference_mode():
        out = reference.generate(torch.tensor([prompt], device=reference.device),
                                 max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=0)
    tokens: list[int] = out[0, len(prompt):].tolist()
    return tokens


def hf_tokens(reference: Any, tokens: list[int], count: int) -> list[int]:
    """``hf_greedy`` for ``count`` tokens whatever they are (as ``ignore_eos``)."""
    reference.generation_config.eos_token_id = None
    return hf_greedy(reference, tokens, count)


def assert_each_matches_hf(results: dict[str, Any], reference: Any,
                           arrivals: dict[int, list[tuple[str, list[int], Any]]]) -> None:
    """Every request of ``arrivals`` (``run_poisoned``'s) got HF's greedy tokens."""
    for requests in arrivals.values():
        for request_id, tokens, params in requests:
            expected = hf_tokens(reference, tokens, params.max_tokens)
            got = results[request_id][0][0]
            assert got == expected, f"{request_id}: {got} against HF's {expected}"


def random_prompt(seed: int, length: int) -> list[int]:
    """Token ids of the tiny models' vocabulary, past the special ones."""
    import numpy as np

    return np.random.default_rng(seed).integers(3, 256, size=length).tolist()


def greedy(max_tokens: int) -> Any:
    """``SamplingParams`` for ``max_tokens`` greedy tokens, EOS ignored."""
    from atb_mem.serving import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def poison_unused_blocks(kv_cache: Any) -> int:
    """Fills every block no sequence holds and the prefix cache does not keep with NaN, so a
    stale read turns the logits into NaN. Returns how many blocks."""
    torch = require_torch()
    blocks = torch.from_numpy(kv_cache.unused_blocks()).long().to(kv_cache.kv_cache.device)
    # A quantized cache's rows of 0xFF bytes have a NaN scale: they read back as NaN.
    poison = float("nan") if kv_cache.kv_cache_dtype == "auto" else 0xFF
    kv_cache.kv_cache[:, :, blocks] = poison
    return len(blocks)


def run_poisoned(engine: Any, arrivals: dict[int, list[tuple[str, list[int], Any]]]
                 | None = None) -> dict[str, Any]:
    """Steps ``engine`` until idle, poisoning unused blocks before every step; ``arrivals``
    adds requests before the step of that number. Returns each request's final output."""
    arrivals = dict(arrivals or {})
    results: dict[str, Any] = {}
    step = 0
    while engine.has_unfinished_requests() or arrivals:
        for request_id, prompt, params in arrivals.pop(step, []):
            engine.add_request(request_id, prompt, params)
        poison_unused_blocks(engine.kv_cache)
        for output in engine.step():
            merged = results.setdefault(output.request_id, {})
            for completion in output.outputs:
                tokens, _ = merged.get(completion.index, ([], None))
                merged[completion.index] = (tokens + completion.token_ids,
                                            completion.finish_reason)
        step += 1
        assert step < 10_000, "the engine does not finish"
    return results


def first_samples(engine: Any, arrivals: dict[int, list[tuple[str, list[int], Any]]]
                  ) -> dict[str, list[int]]:
    """``run_poisoned``'s outputs, each request's first sample's tokens."""
    return {request_id: samples[0][0]
            for request_id, samples in run_poisoned(engine, arrivals).items()}


def run_with_errors(engine: Any, arrivals: dict[int, list[tuple[str, list[int], Any]]]
                    ) -> tuple[dict[str, Any], list[int]]:
    """``run_poisoned`` that also keeps each request's error (``results[id]["error"]``),
    and the tokens each step ran."""
    arrivals = dict(arrivals)
    results: dict[str, Any] = {}
    ran: list[int] = []
    while engine.has_unfinished_requests() or arrivals:
        for request_id, tokens, params in arrivals.pop(len(ran), []):
            engine.add_request(request_id, tokens, params)
        poison_unused_blocks(engine.kv_cache)
        for output in engine.step():
            result = results.setdefault(output.request_id, {"error": None})
            result["error"] = output.error
            for one in output.outputs:
                got, _ = result.get(one.index, ([], None))
                result[one.index] = (got + one.token_ids, one.finish_reason)
        ran.append(engine.last_step_tokens)
        assert len(ran) < 2000, "the engine does not finish"
    return results, ran


CORPUS = ["the cache holds blocks of tokens", "a block table maps a sequence to its blocks",
          "prefix caching shares the blocks of a common prompt", "hello world",
          "paged attention reads keys and values through the block table"] * 4


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant{% endif %}")


def save_tiny_checkpoint(path: Any, architecture: str = "llama") -> Any:
    """A model and a BPE tokenizer trained here on a few sentences, saved with
    ``save_pretrained`` to ``path`` (what ``Engine.from_pretrained`` and the CLI load)."""
    transformers = require_transformers()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>",
                                                bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    model = tiny_model(architecture)
    model.resize_token_embeddings(len(fast))
    model.config.eos_token_id = model.generation_config.eos_token_id = fast.eos_token_id
    model.config.bos_token_id = model.generation_config.bos_token_id = fast.bos_token_id
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return fast


def read_the_previous_rows_first_block(monkeypatch: Any) -> None:
    """Negative control for the CPU kernel: every step, each row reads the previous row's
    first block in place of its own (valid blocks, the wrong ones)."""
    import dataclasses

    import numpy as np

    from atb_mem.integrations import transformers as paged

    build = paged.StepAttention.from_plan

    def from_plan(*args: Any, **kwargs: Any) -> Any:
        step = build(*args, **kwargs)
        assert step.kernel is not None
        tables = step.kernel.table_planes.copy()
        tables[:, :, 0] = np.roll(tables[:, :, 0], 1, axis=1)
        return dataclasses.replace(step, kernel=dataclasses.replace(step.kernel,
                                                                    table_planes=tables))

    monkeypatch.setattr(paged.StepAttention, "from_plan", from_plan)

"""``Engine``: a transformers model served through atb-mem's KV cache and scheduler.

Each ``step()`` is one scheduler step (continuous batching, chunked prefill, preemption), one
forward of the model over the step's tokens through ``atb_mem.integrations.transformers``'s
paged attention, and one sampled token per sequence that finished its prefill or decoded. A
request of ``n`` samples is prefilled once, then forked ``n - 1`` times."""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from atb_mem import _core
from atb_mem._types import AttentionBackend, KVCacheDtype, Preemption
from atb_mem.events import KVEventPublisher
from atb_mem.integrations.transformers import ModelRunner
from atb_mem.kv.cache_pool import KVCachePool
from atb_mem.scheduling.continuous import ContinuousBatchScheduler
from atb_mem.serving.kv_sizing import host_tier, kv_cache_shape, num_kv_blocks, tier_connector
from atb_mem.serving.params import CompletionOutput, FinishReason, RequestOutput, SamplingParams
from atb_mem.serving.prompts import Prompt, eos_token_ids, prompt_list, prompt_token_ids
from atb_mem.serving.sampler import sample, sample_generator
from atb_mem.serving.step_failures import planned_step, run_forward

if TYPE_CHECKING:
    import torch

    from atb_mem.distributed.tensor_parallel import PlanBroadcast

__all__ = ["Engine"]


@dataclass
class _Sample:
    """One of a request's ``n`` sequences."""

    seq_id: int
    index: int
    generator: torch.Generator | None
    token_ids: list[int] = field(default_factory=list)
    reported: int = 0          # tokens step() has returned
    text: str = ""
    finish_reason: FinishReason | None = None


@dataclass
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_Sample]
    forked: bool = False
    error: str | None = None


class Engine:
    """Serves a loaded ``PreTrainedModel`` (on its device, in its dtype) with a paged KV cache.

    ``num_blocks=None`` sizes the cache: on an accelerator from its free memory with
    ``plan_kv_cache`` (``gpu_memory_utilization``); on the host from ``kv_cache_memory_bytes``
    (default: what ``max_num_seqs`` sequences of the model's full length need, at most 4 GiB).
    The model runs atb-mem's attention only inside a step; outside, as transformers would.
    ``kv_offload={"host": "8GiB", "disk": (PATH, "100GiB")}``: a host tier that keeps the
    prefix blocks the device evicts, and a disk tier below; ``kv_store="mooncake://H:P"``: a
    store shared across engines (see ``atb_mem.kv.tiers``), whose blocks are keyed by a digest
    of every weight byte, or by ``kv_identity`` (``"org/model@revision"``) where given;
    ``eviction_policy``: ``"priority"`` (``SamplingParams.retention``; LRU where no request
    asks), ``"lru"``, ``"lfu"`` or ``"slru"``; ``hash_block_size``: hits every that many
    tokens; ``state_checkpoint_interval``: blocks between the recurrent states kept for prefix
    hits; ``kv_events`` (``ZmqEventPublisher``) gets the events. ``enforce_eager``: no
    ``torch.compile`` around the CPU kernel (see ``integrations.compiled_forward``).
    ``kv_cache_dtype``: ``"int8"``/``"fp8_e4m3"``, K/V quantized per token (docs/bytes.md)."""

    def __init__(self, model: Any, tokenizer: Any = None, *, num_blocks: int | None = None,
                 block_size: int = 16, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, enable_prefix_caching: bool = True,
                 preemption: Preemption = "recompute", num_host_blocks: int | None = None,
                 kv_offload: Mapping[str, Any] | None = None, kv_store: str | None = None,
                 kv_identity: str | None = None, gpu_memory_utilization: float = 0.9,
                 eviction_policy: str = "priority", kv_cache_memory_bytes: int | None = None,
                 hash_block_size: int | None = None, state_checkpoint_interval: int | None = None,
                 kv_events: KVEventPublisher | None = None, tensor_parallel_size: int = 1,
                 verify_tensor_parallel: bool = False,
                 attention_backend: AttentionBackend = "auto", enforce_eager: bool = False,
                 kv_cache_dtype: KVCacheDtype = "auto") -> None:
        if kv_events is not None and not callable(getattr(kv_events, "publish", None)):
            raise TypeError(f"kv_events must have a publish(events) method (a "
                            f"KVEventPublisher), got {type(kv_events).__name__}")
        self.plan_broadcast: PlanBroadcast | None = None
        if tensor_parallel_size != 1:
            from atb_mem.distributed.tensor_parallel import PlanBroadcast

            self.plan_broadcast = PlanBroadcast.for_model(model, tensor_parallel_size,
                                                          verify_tensor_parallel)
        config = model.config.get_text_config()
        self.model = model
        self.tokenizer = tokenizer
        self.max_model_len: int = int(config.max_position_embeddings)
        self.vocab_size: int = int(config.vocab_size)
        shape = kv_cache_shape(model, tensor_parallel_size, kv_cache_dtype)
        if num_blocks is None:
            num_blocks = num_kv_blocks(model, shape, block_size, max_num_seqs,
                                       self.max_model_len, gpu_memory_utilization,
                                       kv_cache_memory_bytes)
            if self.plan_broadcast is not None:  # every rank holds as many blocks as the least
                num_blocks = self.plan_broadcast.agree_on_minimum(num_blocks)
        tier = host_tier(kv_offload, num_host_blocks, block_size, shape, enable_prefix_caching)
        self.kv_cache = KVCachePool(
            num_blocks, block_size, device=str(model.device), eviction_policy=eviction_policy,
            enable_prefix_caching=enable_prefix_caching, hash_block_size=hash_block_size,
            state_checkpoint_interval=state_checkpoint_interval,
            enable_kv_events=kv_events is not None, **tier, **shape)
        self.tiers = tier_connector(self.kv_cache, model, kv_offload, kv_store, shape,
                                    tensor_parallel_size, kv_identity)
        self.kv_events = kv_events
        self.scheduler = ContinuousBatchScheduler(
            self.kv_cache, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, preemption=preemption)
        self.runner = ModelRunner(model, self.kv_cache, tensor_parallel_size, attention_backend,
                                  enforce_eager)
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        self._requests: dict[str, _Request] = {}
        self._by_seq: dict[int, tuple[_Request, _Sample]] = {}
        self._next_seq_id = itertools.count(1)
        self._ended: list[_Request] = []  # aborted or failed, reported by the next step()
        self.last_step_seconds, self.last_step_tokens = (0.0, 0.0), 0  # (forward, step) s

    # ---- tensor parallelism ----------------------------------------------------------------

    @property
    def is_driver(self) -> bool:
        """Whether this process schedules (always, without tensor parallelism)."""
        return self.plan_broadcast is None or self.plan_broadcast.group.is_driver

    def run_worker(self) -> int:
        """On a tensor-parallel worker rank: runs rank 0's steps until its ``shutdown()``."""
        from atb_mem.distributed.tensor_parallel import run_worker

        if self.is_driver:
            raise RuntimeError("run_worker() is for tensor-parallel ranks other than 0")
        assert self.plan_broadcast is not None  # is_driver holds without one
        return run_worker(self.plan_broadcast, self.kv_cache, self.runner.execute)

    def shutdown(self) -> None:
        """Releases the tensor-parallel workers (on rank 0) and the lower tiers' threads."""
        if self.plan_broadcast is not None and self.is_driver:
            self.plan_broadcast.stop()
        if self.tiers is not None:
            self.tiers.close()

    @classmethod
    def from_pretrained(cls, path: str, *, device: Any = None, dtype: Any = None,
                        **engine_kwargs: Any) -> Engine:
        """Loads a checkpoint directory (model and, if there is one, its tokenizer)."""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        if engine_kwargs.get("tensor_parallel_size", 1) != 1 and device in (None, "cuda") \
                and torch.cuda.is_available():
            device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"  # one device per rank
        model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "auto")
        model = model.to(device or ("cuda" if torch.cuda.is_available() else "cpu")).eval()
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError):
            tokenizer = None
        return cls(model, tokenizer, **engine_kwargs)

    # ---- requests --------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: Prompt,
                    params: SamplingParams | None = None) -> None:
        """Queues a request. Raises (and changes nothing) for a duplicate id, a bad prompt, or
        one that the model's length or the cache could never hold. ``params.n`` is at most
        the scheduler's ``max_num_seqs``: the samples run side by side, and a request waits
        until there is room for all of them."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already running")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        token_ids = prompt_token_ids(prompt, self.tokenizer, self.vocab_size)
        if len(token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"the prompt's {len(token_ids)} tokens plus max_tokens="
                             f"{params.max_tokens} exceed the model's {self.max_model_len}")
        # Everything that can refuse the request runs before the scheduler takes it.
        generator = sample_generator(params, 0, self.runner.device)
        seq_id = next(self._next_seq_id)
        try:
            self.scheduler.add_request(seq_id, token_ids, params.max_tokens, num_samples=params.n,
                                       priority=params.priority, retention=params.retention_config)
        except _core.RequestRefusedError as error:  # named by its sequence: name the request
            raise ValueError(f"request {request_id!r} {error.reason}") from None
        if self.tiers is not None:  # what the lower tiers hold is loaded at admission
            self.tiers.offer(self.scheduler, seq_id, token_ids)
        first = _Sample(seq_id, 0, generator)
        request = _Request(request_id, token_ids, params, [first], forked=params.n == 1)
        self._requests[request_id] = request
        self._by_seq[seq_id] = (request, first)

    def abort_request(self, request_id: str) -> None:
        """Cancels a request; its blocks are freed. The next ``step()`` reports it, ended with
        ``"abort"``. Unknown (or finished) ids are ignored, as a client may abort late."""
        request = self._requests.get(request_id)
        if request is not None:
            self._end(request, "abort")

    def fail_request(self, request_id: str, error: str) -> None:
        """Ends a request with ``error``: its samples finish with ``"error"`` and the next
        ``step()`` reports it with ``RequestOutput.error``. Unknown ids are ignored."""
        request = self._requests.get(request_id)
        if request is not None:
            request.error = error
            self._end(request, "error")

    def _fail_sequences(self, seq_ids: Iterable[int], error: str) -> None:
        """Fails the requests of ``seq_ids``; ids of no unfinished request are ignored."""
        for seq_id in seq_ids:
            if seq_id in self._by_seq:  # a request's later samples leave it as it fails
                self.fail_request(self._by_seq[seq_id][0].request_id, error)

    def _end(self, request: _Request, reason: FinishReason) -> None:
        """Ends every unfinished sample of ``request`` (their blocks are freed)."""
        self._requests.pop(request.request_id, None)
        for one in request.samples:
            if one.finish_reason is None:
                if one.seq_id in self.scheduler:
                    self.scheduler.abort(one.seq_id)
                one.finish_reason = reason
            self._by_seq.pop(one.seq_id, None)
        self._ended.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    # ---- stepping --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduler step and one forward; returns the requests that progressed, each with
        this step's new tokens (and text) per sample, in order of arrival.

        A failure confined to some requests ends them with ``"error"`` and the others go on:
        a row that cannot be sampled or whose output cannot be processed fails its request;
        a forward that raises fails the requests of its batch; a block move that destroys
        requests' bytes fails them and the step is planned again (``step_failures``)."""
        began = time.perf_counter()
        if self.tiers is not None:  # loads that arrived run from this step (waits if idle)
            self.tiers.poll(self.scheduler, 0.01 if not self.last_step_tokens else 0.0)
        plan = planned_step(self.scheduler, self._fail_sequences)
        if self.tiers is not None:
            self.tiers.forget(plan.finished_seq_ids)
            self.tiers.start_loads(plan)
        if self.plan_broadcast is not None and (plan.num_batched_tokens or len(plan.moves)):
            self.plan_broadcast.send(plan)  # the workers run the same step on their shards
        progressed: dict[str, _Request] = {}
        model_seconds = 0.0
        if plan.num_batched_tokens:
            forward = time.perf_counter()
            logits = run_forward(self.runner, plan, self._fail_sequences)
            if logits is not None:
                model_seconds = time.perf_counter() - forward
                if self.tiers is not None:  # computed blocks, written through below
                    self.tiers.save(plan)
                self._sample_and_record(plan.sample_seq_ids, logits, progressed)
        outputs = [self._delta(request) for request in self._ended]
        self._ended.clear()
        outputs += [self._delta(request) for request in progressed.values()
                    if request.error is None]
        if self.kv_events is not None:
            self.kv_events.publish(self.kv_cache.take_events())
        self.last_step_seconds = (model_seconds, time.perf_counter() - began)
        self.last_step_tokens = plan.num_batched_tokens
        return outputs

    def _sample_and_record(self, sample_seq_ids: np.ndarray, logits: torch.Tensor,
                           progressed: dict[str, _Request]) -> None:
        rows, samples = self._rows_to_sample(sample_seq_ids)
        tokens, failures = sample(logits[rows], [request.params for request, _ in samples],
                                  [one.generator for _, one in samples])
        for row, error in failures.items():
            self.fail_request(samples[row][0].request_id, f"sampling failed: {error}")
        # A failed request's samples left the scheduler: the others' tokens are reported.
        keep = [row for row, (request, _) in enumerate(samples) if request.error is None]
        seq_ids = np.fromiter((samples[row][1].seq_id for row in keep), np.uint64, len(keep))
        finished = set(self.scheduler.on_tokens(seq_ids, tokens[keep]).tolist())
        for row in keep:
            request, one = samples[row]
            if request.error is not None:
                continue  # failed at an earlier sample of the same request
            try:
                self._record(request, one, int(tokens[row]), one.seq_id in finished)
            except Exception as error:  # a tokenizer that cannot decode, say
                self.fail_request(request.request_id, f"processing the output failed: {error}")
            progressed[request.request_id] = request

    def _rows_to_sample(self, seq_ids: np.ndarray) -> tuple[list[int],
                                                           list[tuple[_Request, _Sample]]]:
        """Logits rows and samples to draw; a request's first token forks its ``n`` samples,
        which then all draw from the prompt's logits."""
        rows: list[int] = []
        samples: list[tuple[_Request, _Sample]] = []
        for row, seq_id in enumerate(seq_ids.tolist()):
            request, first = self._by_seq[seq_id]
            rows.append(row)
            samples.append((request, first))
            if not request.forked:
                request.forked = True
                try:
                    for index in range(1, request.params.n):
                        child = _Sample(next(self._next_seq_id), index,
                                        sample_generator(request.params, index, self.runner.device))
                        self.scheduler.fork(seq_id, child.seq_id)
                        request.samples.append(child)
                        self._by_seq[child.seq_id] = (request, child)
                        rows.append(row)
                        samples.append((request, child))
                except Exception as error:
                    self.fail_request(request.request_id, f"forking the samples failed: "
                                                          f"{error}")
        return rows, samples

    def _record(self, request: _Request, one: _Sample, token: int, at_length: bool) -> None:
        one.token_ids.append(token)
        stop = token in (request.params.stop_token_ids or ()) or (
            not request.params.ignore_eos and token in self.eos_token_ids)
        if stop and not at_length:
            self.scheduler.finish(one.seq_id)
        if stop or at_length:
            one.finish_reason = "stop" if stop else "length"
            del self._by_seq[one.seq_id]
        if self.tokenizer is not None:
            one.text = self.tokenizer.decode(one.token_ids, skip_special_tokens=True)
        if all(s.finish_reason is not None for s in request.samples) and \
                len(request.samples) == request.params.n:
            self._requests.pop(request.request_id, None)

    def _delta(self, request: _Request) -> RequestOutput:
        outputs = []
        for one in request.samples:
            new = one.token_ids[one.reported:]
            if not new and one.reported and one.finish_reason not in ("abort", "error"):
                continue
            text = ""
            if request.error is None:  # a failed request's text may be what failed
                text_before = (self.tokenizer.decode(one.token_ids[:one.reported],
                                                     skip_special_tokens=True)
                               if self.tokenizer is not None and one.reported else "")
                text = one.text[len(text_before):]
            outputs.append(CompletionOutput(one.index, new, text, one.finish_reason))
            one.reported = len(one.token_ids)
        finished = request.request_id not in self._requests
        return RequestOutput(request.request_id, request.prompt_token_ids, outputs, finished,
                             request.error)

    # ---- the whole thing -------------------------------------------------------------------

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Runs the prompts to completion; one output per prompt, in order, with every token.
        The engine must be idle (requests of ``add_request`` are served by ``step``)."""
        if self._requests:
            raise RuntimeError("generate() needs an idle engine; step() serves the requests "
                               "already added")
        prompts = prompt_list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        ids = [f"generate-{index}" for index in range(len(prompts))]
        try:
            for request_id, prompt, one in zip(ids, prompts, params, strict=True):
                self.add_request(request_id, prompt, one)
            results = {request_id: self._requests[request_id] for request_id in ids}
            while self._requests:
                self.step()
        except BaseException:  # a refused prompt, a step that raised: the engine stays idle
            for request_id in ids:
                self.abort_request(request_id)
            self._ended.clear()
            raise
        return [RequestOutput(request.request_id, request.prompt_token_ids,
                              [CompletionOutput(one.index, list(one.token_ids), one.text,
                                                one.finish_reason) for one in request.samples],
                              finished=True, error=request.error)
                for request in results.values()]

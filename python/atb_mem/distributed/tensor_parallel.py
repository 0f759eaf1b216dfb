"""Tensor parallelism over torch.distributed: one scheduler, N ranks of model and KV bytes.

Rank 0 (the driver) owns the engine's scheduler and KV bookkeeping. Every step it broadcasts
the plan — a header and one flat int32 array holding the plan's rows, tokens, block tables,
slot mapping and block moves — and every rank runs the same forward over its own shard: the
attention heads (and their KV-cache heads) and the MLP's intermediate features split N ways,
column-parallel in and row-parallel out with one ``all_reduce`` each (Megatron's split, what
vLLM and MindIE do). Workers execute the plan's block moves (copy-on-write, swaps) on their
own pool first, so every rank's blocks hold the same tokens' K/V for its heads.

torch.distributed's collectives carry it all: gloo on CPU, NCCL on CUDA, HCCL on Ascend. The
process group's timeout bounds every collective, so a rank that dies ends the others with an
error instead of a hang.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from atb_mem.integrations.forward_plan import ForwardPlan

if TYPE_CHECKING:
    from collections.abc import Callable

    from atb_mem.kv.cache_pool import KVCachePool

__all__ = ["PlanBroadcast", "RowParallelLinear", "TensorParallelError", "TensorParallelGroup",
           "WirePlan", "launch_workers", "run_worker", "shard_model"]


class TensorParallelError(RuntimeError):
    """A rank left, timed out, or disagreed: the engine cannot go on."""


@dataclass
class TensorParallelGroup:
    """This process's place among the ranks."""

    rank: int
    size: int
    timeout_s: float

    @classmethod
    def join(cls, size: int, timeout_s: float = 60.0, backend: str | None = None
             ) -> TensorParallelGroup:
        """Joins (or, launched by torchrun, creates) the default process group of ``size``
        ranks; ``backend`` defaults to NCCL with CUDA, gloo otherwise."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {size!r}")
        if not dist.is_available():
            raise TensorParallelError("this torch build has no torch.distributed")
        if not dist.is_initialized():
            backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        if dist.get_world_size() != size:
            raise ValueError(f"tensor_parallel_size={size}, but the process group has "
                             f"{dist.get_world_size()} ranks (launch with torchrun "
                             f"--nproc-per-node {size})")
        return cls(dist.get_rank(), size, timeout_s)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    @staticmethod
    def leave() -> None:
        """Destroys the process group while this process still runs. Left to interpreter
        exit, gloo's threads can be torn down in an order that aborts the process
        (``terminate called without an active exception``), above all after a peer died."""
        if dist.is_available() and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except RuntimeError:  # already broken: nothing more to release
                pass


def _collective(what: str, call: Any, *args: Any) -> Any:
    if not dist.is_initialized():
        raise TensorParallelError(f"tensor parallelism: {what} is impossible: the process "
                                  f"group was left (after a failure or a shutdown)")
    try:
        return call(*args)
    except RuntimeError as error:  # gloo/NCCL: a peer closed, or the timeout passed
        TensorParallelGroup.leave()  # the group is lost; every later collective fails too
        raise TensorParallelError(f"tensor parallelism: {what} failed (a rank died or timed "
                                  f"out): {error}") from error


# ---- the model's split ---------------------------------------------------------------------

def _shard_rows(linear: torch.nn.Linear, rank: int, size: int) -> None:
    """Column parallel: this rank's output features of ``linear``."""
    out = linear.weight.shape[0] // size
    linear.weight = torch.nn.Parameter(linear.weight.data[rank * out:(rank + 1) * out].clone(),
                                       requires_grad=False)
    if linear.bias is not None:
        linear.bias = torch.nn.Parameter(linear.bias.data[rank * out:(rank + 1) * out].clone(),
                                         requires_grad=False)
    linear.out_features = out


class RowParallelLinear(torch.nn.Module):
    """Row parallel: this rank's input features of a linear layer; the partial products are
    summed over the ranks, then the (unsplit) bias is added once."""

    def __init__(self, linear: torch.nn.Linear, rank: int, size: int) -> None:
        super().__init__()
        width = linear.weight.shape[1] // size
        self.weight = torch.nn.Parameter(
            linear.weight.data[:, rank * width:(rank + 1) * width].clone(), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = torch.nn.functional.linear(x, self.weight)
        _collective("all_reduce", dist.all_reduce, partial)
        return partial if self.bias is None else partial + self.bias


def shard_model(model: Any, rank: int, size: int) -> None:
    """Keeps this rank's shard of every decoder layer of a Llama-shaped model (q/k/v/o
    projections, gate/up/down MLP; per-head sinks), in place."""
    config = model.config.get_text_config()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % size or kv_heads % size:
        raise ValueError(f"tensor_parallel_size={size} must divide the attention heads "
                         f"({heads}) and the KV heads ({kv_heads})")
    layers = model.model.layers
    for layer in layers:  # every layer is checked before any is split: a refusal changes nothing
        attention, mlp = layer.self_attn, layer.mlp
        if not all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj")) or \
                not all(hasattr(attention, name) for name in ("q_proj", "k_proj", "v_proj",
                                                              "o_proj")):
            raise NotImplementedError(f"{type(model).__name__}: tensor parallelism splits "
                                      "Llama-shaped layers (q/k/v/o projections, a gated MLP); "
                                      "mixtures of experts are not split yet")
        if mlp.gate_proj.weight.shape[0] % size:
            raise ValueError(f"tensor_parallel_size={size} must divide the MLP's "
                             f"{mlp.gate_proj.weight.shape[0]} intermediate features")
    for layer in layers:
        attention, mlp = layer.self_attn, layer.mlp
        for projection in (attention.q_proj, attention.k_proj, attention.v_proj,
                           mlp.gate_proj, mlp.up_proj):
            _shard_rows(projection, rank, size)
        attention.o_proj = RowParallelLinear(attention.o_proj, rank, size)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, rank, size)
        sinks = getattr(attention, "sinks", None)
        if sinks is not None:
            share = sinks.shape[0] // size
            attention.sinks = torch.nn.Parameter(sinks.data[rank * share:(rank + 1) * share]
                                                 .clone(), requires_grad=False)


# ---- the plan's broadcast ------------------------------------------------------------------

_FIELDS = ("query_lens", "seq_lens", "query_start_loc", "input_ids", "positions",
           "slot_mapping", "logits_indices")


@dataclass(frozen=True)
class WirePlan(ForwardPlan):
    """A ``ForwardPlan`` as a worker receives it, with the step's block moves and the blocks
    rank 0 poisoned (tests)."""

    moves: np.ndarray
    poison: np.ndarray


class PlanBroadcast:
    """Rank 0 sends each step's plan; the others receive it. With ``verify``, every step the
    ranks also compare a checksum of the block tables and slot mapping they hold.

    ``poison_next`` (tests): blocks rank 0 filled with NaN before the step it is about to
    send; every worker fills its own copies of them too before running the step, so a stale
    read on any rank shows in the output.
    """

    STOP = -1
    _HEADER = len(_FIELDS) + 5

    def __init__(self, group: TensorParallelGroup, verify: bool = False) -> None:
        self.group = group
        self.verify = verify
        self.poison_next: np.ndarray | None = None

    @classmethod
    def for_model(cls, model: Any, size: int, verify: bool = False) -> PlanBroadcast:
        """Joins the ``size`` ranks and keeps this rank's shard of ``model``."""
        group = TensorParallelGroup.join(size)
        shard_model(model, group.rank, group.size)
        return cls(group, verify)

    def send(self, plan: Any) -> None:
        # Every field fits int32: slots by the core's 2**31 cap, ids, positions and blocks.
        arrays = [np.asarray(getattr(plan, name)).astype(np.int32).ravel() for name in _FIELDS]
        # One table per KV-cache group: [rows, width], or [groups, rows, width].
        tables = np.asarray(plan.block_tables)
        groups = tables.shape[0] if tables.ndim == 3 else 1
        rows, width = tables.shape[-2:]
        moves = np.asarray(plan.moves).astype(np.int32)
        poison = np.asarray(self.poison_next if self.poison_next is not None else [], np.int32)
        self.poison_next = None
        lengths = [len(array) for array in arrays]
        header = np.array([*lengths, groups, rows, width, len(moves), len(poison)], np.int64)
        self._header(header)
        self._body(np.concatenate([*arrays, tables.astype(np.int32).ravel(), moves.ravel(),
                                   poison]))
        self._check(tables, np.asarray(plan.slot_mapping))

    def agree_on_minimum(self, value: int) -> int:
        """The smallest of every rank's ``value``."""
        tensor = torch.tensor([value], dtype=torch.int64)
        if dist.get_backend() == "nccl":
            tensor = tensor.cuda()
        _collective("agreeing on the KV-cache size", dist.all_reduce, tensor,
                    dist.ReduceOp.MIN)
        return int(tensor.item())

    def stop(self) -> None:
        """Tells the workers to return, then leaves the process group."""
        if dist.is_initialized():
            self._header(np.full(self._HEADER, self.STOP, np.int64))
        self.group.leave()

    def receive(self) -> WirePlan | None:
        """The next plan, or None once rank 0 stopped."""
        header = self._header(np.zeros(self._HEADER, np.int64))
        if header[0] == self.STOP:
            return None
        lengths = header[:len(_FIELDS)].tolist()
        groups, rows, width, moves, poisoned = header[len(_FIELDS):].tolist()
        cells = groups * rows * width
        body = self._body(np.zeros(sum(lengths) + cells + moves * 3 + poisoned, np.int32))
        fields, start = {}, 0
        for name, length in zip(_FIELDS, lengths, strict=True):
            fields[name] = body[start:start + length]
            start += length
        tables = body[start:start + cells].reshape(*([groups] if groups > 1 else []), rows, width)
        start += cells
        plan = WirePlan(**fields, block_tables=tables,
                        moves=body[start:start + moves * 3].reshape(moves, 3),
                        poison=body[start + moves * 3:])
        self._check(tables, plan.slot_mapping)
        return plan

    def _header(self, header: np.ndarray) -> np.ndarray:
        return self._broadcast("the plan's header", header)

    def _body(self, body: np.ndarray) -> np.ndarray:
        return self._broadcast("the plan", body) if len(body) else body

    def _broadcast(self, what: str, array: np.ndarray) -> np.ndarray:
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        if dist.get_backend() == "nccl":
            tensor = tensor.cuda()
        _collective(f"broadcasting {what}", dist.broadcast, tensor, 0)
        return tensor.cpu().numpy()

    def _check(self, tables: np.ndarray, slots: np.ndarray) -> None:
        """Every rank must hold the same tables and slots for the step."""
        if not self.verify:
            return
        checksum = zlib.crc32(np.ascontiguousarray(tables, np.int64).tobytes())
        checksum = zlib.crc32(np.ascontiguousarray(slots, np.int64).tobytes(), checksum)
        gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(self.group.size)]
        _collective("comparing block tables", dist.all_gather, gathered,
                    torch.tensor([checksum], dtype=torch.int64))
        if len({int(value) for value in gathered}) != 1:
            raise TensorParallelError(f"the ranks' block tables differ at this step: "
                                      f"{[int(value) for value in gathered]}")


def run_worker(broadcast: PlanBroadcast, kv_cache: KVCachePool,
               forward: Callable[[Any], Any]) -> int:
    """A worker rank's loop: for each plan rank 0 sends, execute its block moves on this
    rank's ``kv_cache`` bytes, then ``forward(plan)`` (a WirePlan reads as a StepPlan).
    Returns the number of steps run once rank 0 stops. It takes these three, not the
    engine, so it does not reach into the engine's parts."""
    steps = 0
    while (plan := broadcast.receive()) is not None:
        if len(plan.poison):
            kv = kv_cache.kv_cache
            kv[:, :, torch.from_numpy(plan.poison.astype(np.int64)).to(kv.device)] = float("nan")
        if len(plan.moves):
            kv_cache.executor(plan.moves)
        if plan.num_batched_tokens:
            forward(plan)
        steps += 1
    broadcast.group.leave()
    return steps


# ---- launching the ranks itself ------------------------------------------------------------

def launch_workers(size: int, worker: list[str]) -> list[subprocess.Popen[bytes]]:
    """For a process not started by torchrun: makes it rank 0 of ``size`` and starts ranks
    1..size-1 as child processes running ``python *worker`` (the caller's entry point, which
    serves rank 0's steps and exits when it shuts down)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    common = {"WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    os.environ.update(common, RANK="0", LOCAL_RANK="0")
    workers = []
    for rank in range(1, size):
        env = {**os.environ, **common, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        workers.append(subprocess.Popen(
            [sys.executable, *worker], env=env,
            start_new_session=True))  # Ctrl-C goes to rank 0, which releases them
    return workers

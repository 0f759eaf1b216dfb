"""``atb-mem serve MODEL_DIR``: the OpenAI-compatible server over an ``Engine``."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import click

from atb_mem._core import EVICTION_POLICIES
from atb_mem.tools.options import OFFLOAD, engine_options, offload_tiers


@click.command()
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--served-model-name", default=None,
              help="The name clients send as `model` (default: MODEL_DIR's name).")
@engine_options
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--max-num-batched-tokens", type=click.IntRange(min=1), default=2048,
              show_default=True)
@click.option("--preemption", type=click.Choice(["recompute", "swap"]), default="recompute",
              show_default=True)
@click.option("--num-host-blocks", type=click.IntRange(min=1), default=None,
              help="Host-tier blocks for swap preemption.")
@click.option("--kv-offload", type=OFFLOAD, multiple=True,
              help="A tier below the device: host=8GiB (the prefix blocks it evicts), "
                   "disk=PATH:100GiB (written through, loaded while others run); "
                   "repeatable, one per tier.")
@click.option("--kv-store", default=None, metavar="URL",
              help="A KV store shared across engines: mooncake://HOST:PORT[?metadata=URL].")
@click.option("--kv-identity", default=None, metavar="NAME",
              help="Names the weights in the disk tier's and the store's keys (e.g. "
                   "org/model@revision) instead of a digest of every weight byte.")
@click.option("--eviction-policy", type=click.Choice(EVICTION_POLICIES),
              default="priority", show_default=True,
              help="Which cached block the prefix cache gives up first. 'priority' (LRU "
                   "unless a request asks for retention) honours requests' retention; the "
                   "others refuse it.")
@click.option("--hash-block-size", type=click.IntRange(min=1), default=None,
              help="Prefix hits every N tokens (N divides --block-size), not only at whole "
                   "blocks: the shared part of a block is copied, not recomputed.")
@click.option("--state-checkpoint-interval", type=click.IntRange(min=1), default=None,
              help="Models with recurrent layers (Mamba, gated delta-net): keep their states "
                   "for prefix hits every N blocks while decoding [default: as many blocks "
                   "as one takes].")
@click.option("--no-prefix-caching", is_flag=True)
@click.option("--gpu-memory-utilization", type=click.FloatRange(0, 1, min_open=True),
              default=0.9, show_default=True)
@click.option("--max-batch-size", type=click.IntRange(min=1), default=None,
              help="Batch requests on admission: up to N reach the engine together "
                   "(default: each as it comes).")
@click.option("--timeout-ms", type=click.FloatRange(min=0), default=None,
              help="With --max-batch-size: the longest a request waits for its batch to fill "
                   "[default: 10].")
@click.option("--kv-events-endpoint", default=None, metavar="ZMQ_ENDPOINT",
              help="Publish KV-cache events (vLLM's format) on this ZMQ PUB endpoint, e.g. "
                   "tcp://*:5557, for a KV-aware router.")
@click.option("--kv-events-replay-endpoint", default=None, metavar="ZMQ_ENDPOINT",
              help="With --kv-events-endpoint: replays missed batches to late subscribers.")
@click.option("--kv-events-topic", default="", help="The topic frame of every event batch.")
@click.option("--tensor-parallel-size", type=click.IntRange(min=1), default=1,
              show_default=True,
              help="Split the model over N ranks (torch.distributed; gloo on CPU, NCCL on "
                   "CUDA). Without torchrun, serve starts the other ranks itself.")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), default=None,
              help="A JSON file of scheduling settings (max_num_seqs, max_batch_size, ...), "
                   "applied over the flags at start; `atb-mem ctl --persist` writes kept "
                   "changes to it.")
@click.option("--admin-token", default=None, envvar="ATB_MEM_ADMIN_TOKEN",
              help="Lets non-loopback clients use /admin/config with this bearer token.")
@click.option("--admin-allow-loopback/--no-admin-allow-loopback", default=None,
              help="Serve /admin/config to loopback clients without the token [default: on "
                   "when --host is a loopback address].")
@click.option("--health-stall-s", type=click.FloatRange(min=0, min_open=True), default=60.0,
              show_default=True,
              help="/health answers 503 after this long without progress with work pending.")
def serve(model_dir: str, host: str, port: int, served_model_name: str | None,
          device: str | None, dtype: str, block_size: int, num_blocks: int | None,
          max_num_seqs: int, max_num_batched_tokens: int, preemption: str,
          num_host_blocks: int | None, kv_offload: tuple[tuple[str, Any], ...],
          kv_store: str | None, kv_identity: str | None, eviction_policy: str,
          hash_block_size: int | None, state_checkpoint_interval: int | None,
          no_prefix_caching: bool, gpu_memory_utilization: float, attention_backend: str,
          kv_cache_dtype: str, max_batch_size: int | None,
          timeout_ms: float | None, kv_events_endpoint: str | None,
          kv_events_replay_endpoint: str | None, kv_events_topic: str,
          tensor_parallel_size: int, config_path: str | None, admin_token: str | None,
          admin_allow_loopback: bool | None, health_stall_s: float) -> None:
    """Serves the checkpoint in MODEL_DIR: /v1/completions, /v1/chat/completions,
    /v1/models, /health, /metrics and /admin/config (see `atb-mem ctl`). Ctrl-C stops it."""
    from atb_mem.scheduling.request_batching import DynamicBatchScheduler
    from atb_mem.serving import Engine
    from atb_mem.serving.admin import load_config_file
    from atb_mem.serving.api_server import ApiServer
    from atb_mem.serving.live_settings import ADMISSION_SETTINGS, LiveSettings

    settings = load_config_file(config_path) if config_path and Path(config_path).exists() \
        else {}
    if timeout_ms is not None and max_batch_size is None:
        raise click.UsageError("--timeout-ms batches requests on admission: give "
                               "--max-batch-size too")
    admission = None
    if max_batch_size is not None or any(key in settings for key in ADMISSION_SETTINGS):
        admission = DynamicBatchScheduler(max_batch_size or 8,
                                          10.0 if timeout_ms is None else timeout_ms)

    if admin_token is not None and not admin_token.strip():
        raise click.UsageError("--admin-token is empty: give a secret, or none")
    if kv_events_replay_endpoint is not None and kv_events_endpoint is None:
        raise click.UsageError("--kv-events-replay-endpoint needs --kv-events-endpoint")
    engine_kwargs = {
        "device": device, "dtype": None if dtype == "auto" else dtype,
        "block_size": block_size, "num_blocks": num_blocks, "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens, "preemption": preemption,
        "num_host_blocks": num_host_blocks, "enable_prefix_caching": not no_prefix_caching,
        "kv_offload": offload_tiers(kv_offload), "kv_store": kv_store,
        "kv_identity": kv_identity,
        "eviction_policy": eviction_policy, "hash_block_size": hash_block_size,
        "state_checkpoint_interval": state_checkpoint_interval,
        "gpu_memory_utilization": gpu_memory_utilization,
        "attention_backend": attention_backend, "kv_cache_dtype": kv_cache_dtype}
    workers: list[subprocess.Popen[bytes]] = []
    if tensor_parallel_size > 1 and "RANK" not in os.environ:
        from atb_mem.distributed.tensor_parallel import launch_workers

        worker_kwargs = {**engine_kwargs, "tensor_parallel_size": tensor_parallel_size}
        workers = launch_workers(tensor_parallel_size, [
            "-m", "atb_mem.tools.tp_worker", model_dir, json.dumps(worker_kwargs)])
    if int(os.environ.get("RANK", "0")) != 0:  # a torchrun-started worker rank
        Engine.from_pretrained(model_dir, tensor_parallel_size=tensor_parallel_size,
                               **engine_kwargs).run_worker()
        return
    publisher = None
    if kv_events_endpoint is not None:
        from atb_mem.events.zmq_publisher import ZmqEventPublisher

        publisher = ZmqEventPublisher(kv_events_endpoint, kv_events_replay_endpoint,
                                      kv_events_topic)
    engine = Engine.from_pretrained(model_dir, kv_events=publisher,
                                    tensor_parallel_size=tensor_parallel_size, **engine_kwargs)
    LiveSettings(engine.scheduler, admission).apply(**settings)  # a bad file stops here
    name = served_model_name or Path(model_dir).resolve().name
    host_tier = (f", {engine.kv_cache.num_host_blocks} on the host"
                 if engine.kv_cache.host_prefix_cache else "")
    click.echo(f"atb-mem: serving {name!r} on http://{host}:{port} "
               f"({engine.kv_cache.num_blocks} KV blocks of {block_size} tokens{host_tier})")
    try:
        ApiServer(engine, name, host, port, admin_token=admin_token,
                  config_path=config_path, admission=admission,
                  admin_allow_loopback=admin_allow_loopback,
                  health_stall_s=health_stall_s).run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down gracefully
        pass
    finally:
        engine.shutdown()  # releases the tensor-parallel ranks
        for worker in workers:
            worker.wait(60)
        if publisher is not None:
            publisher.close()
    click.echo("atb-mem: stopped")


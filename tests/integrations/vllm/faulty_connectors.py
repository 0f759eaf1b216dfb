"""Connectors that break on purpose, for the end-to-end tests' controls (loaded by vLLM from
``kv_connector_module_path``, in its own process)."""

from __future__ import annotations

import time
from typing import Any

from atb_mem.integrations.vllm import AtbMemConnector
from atb_mem.integrations.vllm.moves import TierMoves, group_ids


class ZeroLoadsConnector(AtbMemConnector):  # type: ignore[misc, valid-type]
    """Loads zeros instead of the host blocks' bytes: the negative control, which must
    change the tokens."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)
        moves: TierMoves = self._moves()
        if moves.host_loads:  # each group's block (vLLM's null block, 0, left alone)
            blocks = [block for _, loaded in moves.host_loads for block in group_ids(loaded)
                      if block]
            for view in self._worker._views:
                view[blocks] = 0


class SlowStoresConnector(AtbMemConnector):  # type: ignore[misc, valid-type]
    """Every disk or store read takes a second: a load stays in flight for several steps."""

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        for store in self._worker.stores:
            read = store.get

            def slow_get(key: str, read: Any = read) -> bytes | None:
                time.sleep(1.0)
                return read(key)  # type: ignore[no-any-return]

            store.get = slow_get

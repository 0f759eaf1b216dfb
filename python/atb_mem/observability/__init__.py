"""Watching the library at work.

- ``metrics``: ``AtbMemCollector``, a Prometheus collector (needs ``prometheus_client``:
  ``pip install 'atb-mem[metrics]'``).

Nothing here is imported by ``import atb_mem``; ``atb_mem.metrics`` imports it on first use.
"""

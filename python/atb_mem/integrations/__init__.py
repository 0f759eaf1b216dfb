"""Adapters that let existing model code run over atb-mem's paged KV cache.

- ``atb_mem.integrations.transformers``: Hugging Face transformers (≥ 5) models, through an
  attention function registered with ``AttentionInterface``.
"""

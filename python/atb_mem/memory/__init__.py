"""Byte memory: one region reserved up front and malloc/free of any size inside it.

- ``mem_pool``: ``MemPool``, the pool (the allocator itself is the Rust core's);
- ``acl``: the same pool under the names of CANN's ``aclrtMemPool*`` API, for ported code;
- ``backends``: where bytes live (host memory through numpy, or one torch tensor on ``cpu``,
  ``cuda`` or ``npu``) and the batched copies the KV cache needs on each.
"""

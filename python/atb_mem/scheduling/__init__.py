"""The two schedulers; their policies are the Rust core's.

- ``continuous``: ``ContinuousBatchScheduler``, continuous batching of sequences over a
  ``KVCachePool``, step by step (Orca, vLLM);
- ``request_batching``: ``DynamicBatchScheduler``, batching of whole requests for servers
  that run one batch at a time (Triton's dynamic batcher, Ray Serve's ``@serve.batch``).
"""

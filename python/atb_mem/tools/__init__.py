"""The ``atb-mem`` command and what it runs; not part of the library's API.

- ``cli``: the command (``atb-mem ...`` or ``python -m atb_mem ...``);
- ``simulate``: replaying request traces through continuous batching, per memory strategy;
- ``workloads``: the operation workloads that ``bench ops`` and ``benches/`` time.

``import atb_mem`` never imports this package.
"""

"""The ``atb-mem`` command and what it runs; not part of the library's API.

- ``cli``: the command (``atb-mem ...`` or ``python -m atb_mem ...``) and ``atb-mem plan``;
- ``bench``: ``atb-mem bench ops`` and ``atb-mem bench fragmentation``;
- ``tuning``: ``atb-mem tune``, an Optuna search over the serving settings;
- ``options``: the command line's value types and what every subcommand shares;
- ``simulate``: replaying request traces through continuous batching, per memory strategy;
- ``workloads``: the operation workloads that ``bench ops`` and ``benches/`` time.

``import atb_mem`` never imports this package.
"""

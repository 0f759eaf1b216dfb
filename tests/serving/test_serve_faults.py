"""Fault injection against a running ``atb-mem serve``: every poisonous request of issue 28
sent among healthy concurrent ones. The healthy ones complete with HF ``generate``'s greedy
output, the bad ones get 4xx JSON (or, valid after all, a correct answer), the live settings
stay as they were, and ``/health`` stays 200 throughout and after."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.models import hf_greedy
from tests.support.processes import free_port, wait_until_healthy

HEALTHY = [[5, 6, 7, 8 + index, 9] for index in range(6)]
MAX_TOKENS = 5

# (what, method, path, body: JSON, or raw bytes for what JSON cannot say, headers, status)
POISONOUS: list[tuple[str, str, str, Any, dict[str, str], int]] = [
    ("a tiny temperature (greedy)", "POST", "/v1/completions",
     {"prompt": [5, 6, 7, 8], "max_tokens": MAX_TOKENS, "temperature": 1e-39}, {}, 200),
    ("a tinier one in a chat", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3,
      "temperature": 1e-300}, {}, 200),
    ("a seed that overflows at the fork", "POST", "/v1/completions",
     {"prompt": [5, 6, 7, 8], "max_tokens": 3, "seed": 2**64 - 1, "n": 2}, {}, 400),
    ("a seed past 2**64", "POST", "/v1/completions",
     {"prompt": [5, 6, 7, 8], "max_tokens": 3, "seed": 2**64}, {}, 400),
    ("a temperature of NaN", "POST", "/v1/completions",
     b'{"model": "tiny", "prompt": [5, 6], "temperature": NaN}', {}, 400),
    ("a temperature of inf", "POST", "/v1/completions",
     b'{"model": "tiny", "prompt": [5, 6], "temperature": 1e999}', {}, 400),
    ("max_tokens as a string", "POST", "/v1/completions",
     {"prompt": [5, 6, 7, 8], "max_tokens": "5"}, {}, 400),
    ("stream as a string", "POST", "/v1/completions",
     {"prompt": [5, 6, 7, 8], "stream": "yes"}, {}, 400),
    ("more samples than max_num_seqs", "POST", "/v1/completions",
     {"prompt": [5, 6, 7, 8], "max_tokens": 3, "n": 9}, {}, 400),
    ("a prompt the cache cannot hold", "POST", "/v1/completions",
     {"prompt": [5] * 400, "max_tokens": 3}, {}, 400),
    ("live as a string", "POST", "/admin/config",
     {"set": {"max_num_seqs": 4}, "live": "false", "watch_s": 1}, {}, 400),
    ("a watch of NaN seconds", "POST", "/admin/config",
     b'{"set": {"max_num_seqs": 4}, "live": true, "watch_s": NaN}', {}, 400),
    ("a watch of 1e308 seconds", "POST", "/admin/config",
     {"set": {"max_num_seqs": 4}, "live": True, "watch_s": 1e308}, {}, 400),
    ("chunked prefill as a string", "POST", "/admin/config",
     {"set": {"enable_chunked_prefill": "yes"}}, {}, 400),
    ("a billion sequences", "POST", "/admin/config", {"set": {"max_num_seqs": 10**9}}, {}, 400),
    ("a watermark that leaves no room", "POST", "/admin/config",
     {"set": {"watermark": 0.999999}, "live": True, "watch_s": 1}, {}, 400),
    ("persisting into a missing directory", "POST", "/admin/config",
     {"set": {"max_num_seqs": 4}, "live": True, "watch_s": 0.5, "persist": True}, {}, 400),
    ("a forged loopback address", "GET", "/admin/config", None,
     {"X-Forwarded-For": "127.0.0.1"}, 403),
    ("a route that does not exist", "GET", "/v1/nothing", None, {}, 404),
]


@pytest.fixture(scope="module")
def served(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    config = tmp_path_factory.mktemp("serve") / "missing" / "serve.json"
    port = free_port()
    # Every proxy trusted by the environment, as in many container images.
    env = {**os.environ, "FORWARDED_ALLOW_IPS": "*"}
    process = subprocess.Popen(
        [sys.executable, "-m", "atb_mem", "serve", str(checkpoint), "--port", str(port),
         "--device", "cpu", "--num-blocks", "64", "--block-size", "4", "--max-num-seqs", "8",
         "--max-num-batched-tokens", "64", "--served-model-name", "tiny",
         "--config", str(config), "--admin-token", "secret"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        wait_until_healthy(process, port, 120)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.send_signal(signal.SIGINT)
        try:
            _, err = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    assert process.returncode == 0, err[-3000:]


def test_poisonous_requests_among_healthy_ones_over_a_real_server(served: str,
                                                                   checkpoint: Path) -> None:
    import httpx
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)

    def expected_text(prompt: list[int]) -> str:
        text: str = tokenizer.decode(hf_greedy(reference, prompt, MAX_TOKENS),
                                     skip_special_tokens=True)
        return text

    def send(method: str, path: str, body: Any, headers: dict[str, str]) -> httpx.Response:
        if isinstance(body, bytes):
            return httpx.request(method, served + path, content=body, timeout=120,
                                 headers={"content-type": "application/json", **headers})
        if body is not None and path.startswith("/v1/"):
            body = {"model": "tiny", **body}
        return httpx.request(method, served + path, json=body, headers=headers, timeout=120)

    before = httpx.get(f"{served}/admin/config").json()["config"]
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        healthy = [pool.submit(send, "POST", "/v1/completions", {
            "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}, {})
            for prompt in HEALTHY]
        poisoned = [(what, status, pool.submit(send, method, path, body, headers))
                    for what, method, path, body, headers, status in POISONOUS]
        health = [pool.submit(httpx.get, f"{served}/health") for _ in range(4)]
        for what, status, future in poisoned:
            response = future.result()
            assert response.status_code == status, (what, response.text)
            if status >= 400:
                assert response.json()["error"]["message"], what  # OpenAI-shaped JSON
        for prompt, future in zip(HEALTHY, healthy, strict=True):
            response = future.result()
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["text"] == expected_text(prompt)
        assert [future.result().status_code for future in health] == [200] * 4
    greedy = poisoned[0][2].result().json()["choices"][0]["text"]
    assert greedy == expected_text([5, 6, 7, 8])  # the tiny temperature: greedy, not NaN
    # The forged header was refused, the token still opens the door.
    assert httpx.get(f"{served}/admin/config",
                     headers={"X-Forwarded-For": "127.0.0.1",
                              "Authorization": "Bearer secret"}).status_code == 200
    after = httpx.get(f"{served}/admin/config").json()
    assert after["config"] == before and after["watching"] is False
    assert httpx.get(f"{served}/health").json() == {"status": "ok"}


def test_the_healthy_answers_can_fail_the_comparison(served: str, checkpoint: Path) -> None:
    """Negative control: another prompt's greedy text differs, so equality above means
    something."""
    import httpx
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    texts = {json.dumps(prompt): tokenizer.decode(hf_greedy(reference, prompt, MAX_TOKENS),
                                                  skip_special_tokens=True)
             for prompt in HEALTHY[:2]}
    response = httpx.post(f"{served}/v1/completions", json={
        "model": "tiny", "prompt": HEALTHY[0], "max_tokens": MAX_TOKENS, "temperature": 0},
        timeout=120)
    text = response.json()["choices"][0]["text"]
    assert text == texts[json.dumps(HEALTHY[0])] != texts[json.dumps(HEALTHY[1])]

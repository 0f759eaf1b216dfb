"""``atb-mem serve``'s app, driven by the official ``openai`` client over 127.0.0.1: a tiny
model and tokenizer saved by the test, outputs equal to ``Engine.generate``'s, concurrency,
bad requests, metrics, and clients that disconnect."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

MODEL = "tiny"
GREEDY = {"max_tokens": 8, "temperature": 0}


def new_engine(checkpoint: Path) -> Any:
    from atb_mem.serving import Engine

    return Engine.from_pretrained(str(checkpoint), device="cpu", num_blocks=64, block_size=4,
                                  max_num_seqs=8, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[Any]:
    from atb_mem.serving.api_server import ApiServer

    running = ApiServer(new_engine(checkpoint), MODEL, port=0).start()
    yield running
    running.shutdown()
    assert not running.engine_loop.alive


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> Any:
    return new_engine(checkpoint)


@pytest.fixture(scope="module")
def client(server: Any) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def expected(reference: Any, prompt: Any, max_tokens: int = 8) -> Any:
    from atb_mem.serving import SamplingParams

    [output] = reference.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
    return output.outputs[0]


def chat_ids(reference: Any, content: str) -> list[int]:
    ids = reference.tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                  add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)
    return list(ids)


def test_models_and_health(server: Any, client: Any) -> None:
    import httpx

    assert [model.id for model in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_completions_plain_and_streamed(client: Any, reference: Any) -> None:
    want = expected(reference, "the block table")
    plain = client.completions.create(model=MODEL, prompt="the block table", **GREEDY)
    assert plain.choices[0].text == want.text
    assert plain.choices[0].finish_reason == want.finish_reason
    assert plain.usage.completion_tokens == len(want.token_ids)
    chunks = list(client.completions.create(model=MODEL, prompt="the block table", stream=True,
                                            **GREEDY))
    assert "".join(chunk.choices[0].text for chunk in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason
    ids = reference.tokenizer("hello world")["input_ids"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, **GREEDY)
    assert by_ids.choices[0].text == expected(reference, ids).text


def test_chat_completions_plain_and_streamed(client: Any, reference: Any) -> None:
    messages = [{"role": "user", "content": "prefix caching shares"}]
    want = expected(reference, chat_ids(reference, "prefix caching shares"))
    plain = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    assert plain.choices[0].message.role == "assistant"
    assert plain.choices[0].message.content == want.text
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                 **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason


def test_32_concurrent_requests_all_complete(client: Any, reference: Any) -> None:
    words = ["the", "cache", "block", "table", "prefix", "paged", "hello", "keys"]
    prompts = [" ".join(words[(i + j) % 8] for j in range(1 + i % 5)) for i in range(32)]
    results: dict[int, str] = {}

    def ask(index: int) -> None:
        response = client.completions.create(model=MODEL, prompt=prompts[index], **GREEDY)
        results[index] = response.choices[0].text

    threads = [threading.Thread(target=ask, args=(index,)) for index in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert sorted(results) == list(range(32))
    for index, prompt in enumerate(prompts):
        assert results[index] == expected(reference, prompt).text, prompt


@pytest.mark.parametrize(("body", "match"), [
    ({"model": "gpt-4", "prompt": "hello"}, "does not exist"),
    ({"model": MODEL, "prompt": "hello", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": "hello", "max_tokens": 600}, "exceed the model's 512"),
    ({"model": MODEL, "prompt": [5] * 300, "max_tokens": 4}, "the cache fits"),
    ({"model": MODEL, "prompt": [5, 100_000]}, "not an id"),
    ({"model": MODEL, "prompt": "hello", "temperature": "hot"}, "temperature"),
    ({"model": MODEL, "prompt": "hello", "stop": ["\n"]}, "stop strings"),
    ({"model": MODEL}, "prompt"),
])
def test_bad_requests_get_a_400_and_the_server_keeps_serving(server: Any, body: dict[str, Any],
                                                              match: str) -> None:
    import httpx

    response = httpx.post(f"{server.url}/v1/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert re.search(match, error["message"]) and error["type"] == "invalid_request_error"
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_malformed_json_gets_a_400(server: Any) -> None:
    import httpx

    response = httpx.post(f"{server.url}/v1/chat/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert "error" in response.json()


def metric(server: Any, name: str, labels: str = "", default: float | None = None) -> float:
    import httpx

    text = httpx.get(f"{server.url}/metrics").text
    found = re.search(rf"^{name}\{{[^}}]*{labels}[^}}]*\}} (\S+)$", text, flags=re.M)
    if found is None and default is not None:
        return default  # a labelled counter appears with its first increment
    assert found, f"{name} {labels} not in /metrics"
    return float(found.group(1))


def wait_for(condition: Any, timeout: float = 30.0) -> None:
    """Polls a condition the server reaches by itself (an abort is applied between steps)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.05)


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(server: Any) -> None:
    import httpx

    aborted = metric(server, "atb_mem_requests_total", 'finish_reason="abort"', default=0)
    body = {"model": MODEL, "prompt": "paged attention reads", "max_tokens": 200,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert metric(server, "atb_mem_kv_cache_blocks", 'state="used"') > 0
    wait_for(lambda: metric(server, "atb_mem_kv_cache_blocks", 'state="used"') == 0)
    assert metric(server, "atb_mem_requests_total", 'finish_reason="abort"') == aborted + 1


def test_metrics_after_the_requests(server: Any, client: Any) -> None:
    client.completions.create(model=MODEL, prompt="hello", **GREEDY)
    assert metric(server, "atb_mem_kv_cache_blocks", 'state="used"') == 0
    assert metric(server, "atb_mem_time_to_first_token_seconds_count") > 0
    assert metric(server, "atb_mem_inter_token_latency_seconds_count") > 0
    assert metric(server, "atb_mem_requests_total", 'finish_reason="length"') > 0


def test_a_client_that_disconnects_before_the_answer_frees_its_blocks(server: Any) -> None:
    """Driven through ASGI directly, so the disconnect comes exactly after the body."""
    import asyncio
    import json

    aborted = metric(server, "atb_mem_requests_total", 'finish_reason="abort"', default=0)
    body = json.dumps({"model": MODEL, "prompt": "the cache holds", "max_tokens": 200,
                       "ignore_eos": True}).encode()
    sent: list[dict[str, Any]] = []

    async def call() -> None:
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/completions",
                 "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
        await server.app(scope, receive, send)

    asyncio.run(call())
    assert sent[0]["status"] == 499
    wait_for(lambda: metric(server, "atb_mem_requests_total", 'finish_reason="abort"',
                            default=0) == aborted + 1)
    wait_for(lambda: metric(server, "atb_mem_kv_cache_blocks", 'state="used"') == 0)

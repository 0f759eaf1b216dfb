"""The prefill/decode proxy's routing on its own, with two recording HTTP servers for
backends (the end-to-end test runs it in front of two ``vllm serve``): the prefill server
gets one token and no stream, the decode server the request as it came, streamed back; a
prefill server that is down is counted and costs nothing else; bad requests are 4xx."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from atb_mem.integrations.vllm.disagg_proxy import DisaggProxy, prefill_request
from tests.support.processes import free_port


class _Backend(ThreadingHTTPServer):
    def __init__(self, answer: bytes, status: int = 200) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.answer, self.status = answer, status
        super().__init__(("127.0.0.1", 0), _Recorder)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Recorder(BaseHTTPRequestHandler):
    server: _Backend

    def do_POST(self) -> None:
        self.server.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(self.server.status)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for line in self.server.answer.split(b"\n"):
            self.wfile.write(line + b"\n")
            self.wfile.flush()

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def running(server: ThreadingHTTPServer) -> Iterator[ThreadingHTTPServer]:
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def post(port: int, path: str, body: bytes) -> tuple[int, bytes]:
    import httpx

    answer = httpx.post(f"http://127.0.0.1:{port}{path}", content=body, timeout=30,
                        headers={"Content-Type": "application/json"})
    return answer.status_code, answer.content


def test_the_prefill_request_is_one_token_unstreamed() -> None:
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True}, "max_completion_tokens": 50}
    assert prefill_request(body) == {"model": "m", "prompt": [1, 2], "max_tokens": 1,
                                     "stream": False}
    assert body["max_tokens"] == 50, "the client's request is left as it was"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_prefill_then_decode_whose_answer_streams_back(path: str) -> None:
    stream = b'data: {"n": 1}\n\ndata: {"n": 2}\n\ndata: [DONE]\n'
    with running(_Backend(b"{}")) as prefill, running(_Backend(stream)) as decode:
        port = free_port()
        assert isinstance(prefill, _Backend) and isinstance(decode, _Backend)
        with running(DisaggProxy(("127.0.0.1", port), prefill.url, decode.url)) as proxy:
            body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 9, "stream": True}
            status, content = post(port, path, json.dumps(body).encode())
            assert status == 200 and content.rstrip(b"\n") == stream.rstrip(b"\n")
            assert prefill.bodies == [prefill_request(body)]
            assert decode.bodies == [body]
            assert isinstance(proxy, DisaggProxy) and proxy.prefill_failures == 0


def test_a_prefill_server_that_is_down_costs_only_the_sharing() -> None:
    with running(_Backend(b'{"ok": true}')) as decode:
        assert isinstance(decode, _Backend)
        port, dead = free_port(), f"http://127.0.0.1:{free_port()}"
        with running(DisaggProxy(("127.0.0.1", port), dead, decode.url, 5)) as proxy:
            for _ in range(2):
                assert post(port, "/v1/completions", b'{"prompt": [1]}') == \
                    (200, b'{"ok": true}\n')
            assert isinstance(proxy, DisaggProxy) and proxy.prefill_failures == 2


def test_bad_requests_are_client_errors_and_reach_no_server() -> None:
    with running(_Backend(b"{}")) as prefill, running(_Backend(b"{}", 400)) as decode:
        assert isinstance(prefill, _Backend) and isinstance(decode, _Backend)
        port = free_port()
        with running(DisaggProxy(("127.0.0.1", port), prefill.url, decode.url)):
            assert post(port, "/v1/completions", b"not json")[0] == 400
            assert post(port, "/v1/completions", b"[1, 2]")[0] == 400
            assert post(port, "/v1/embeddings", b"{}")[0] == 404
            assert prefill.bodies == [] and decode.bodies == []
            # The decode server's own refusal comes back as it said it.
            assert post(port, "/v1/completions", b'{"max_tokens": -1}')[0] == 400

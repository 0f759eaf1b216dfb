"""A prefill/decode proxy for two vLLM servers that share KV blocks through a store: the
prefill server runs ``AtbMemConnector`` with ``"kv_role": "kv_producer"`` (saves, never
loads), the decode server with ``"kv_consumer"`` (loads, never saves), both with one
``store`` URL (a Mooncake Store) and the same model.

Each ``/v1/completions`` or ``/v1/chat/completions`` request goes first to the prefill
server with ``max_tokens`` 1, not streamed: its prompt's whole blocks are in the store
before that answer comes (a producer's puts land within its step). Then the request goes
as it came to the decode server, which loads those blocks and computes only the rest; its
answer, streamed or not, is the client's. A prefill server that fails or cannot be reached
costs only the sharing: the decode server computes the whole prompt. vLLM's own examples
(``disagg_proxy``, ``toy_proxy_server``) do the same for its peer-to-peer connectors.

    python -m atb_mem.integrations.vllm.disagg_proxy --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000

Only the standard library: an example to read and adapt, not a production load balancer.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["DisaggProxy", "main"]

log = logging.getLogger("atb_mem.disagg_proxy")

_ROUTES = ("/v1/completions", "/v1/chat/completions")
_CHUNK = 1 << 14


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """What the prefill server is asked: the prompt, one token, no stream."""
    request = {key: value for key, value in body.items()
               if key not in ("stream", "stream_options", "max_completion_tokens")}
    request.update(max_tokens=1, stream=False)
    return request


class DisaggProxy(ThreadingHTTPServer):
    """The proxy on ``(host, port)`` in front of ``prefill`` and ``decode`` (base URLs);
    ``prefill_failures`` counts the requests whose prefill went wrong."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], prefill: str, decode: str,
                 timeout_s: float = 600.0) -> None:
        super().__init__(address, _Handler)
        self.prefill, self.decode = prefill.rstrip("/"), decode.rstrip("/")
        self.timeout_s = timeout_s
        self.prefill_failures = 0
        self._lock = threading.Lock()

    def run_prefill(self, path: str, body: dict[str, Any]) -> None:
        data = json.dumps(prefill_request(body)).encode()
        request = urllib.request.Request(self.prefill + path, data=data,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                answer.read()
        except (OSError, ValueError) as error:  # URLError, HTTPError, timeouts
            with self._lock:
                self.prefill_failures += 1
            log.warning("atb-mem proxy: the prefill server failed (%s): the decode server "
                        "computes the whole prompt", error)


class _Handler(BaseHTTPRequestHandler):
    server: DisaggProxy

    def do_GET(self) -> None:
        if self.path == "/health":
            self._reply(200, b"ok", "text/plain")
        else:
            self._forward("GET", None)

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        if self.path not in _ROUTES:
            self._reply(404, b'{"error": "the proxy serves /v1/completions and '
                             b'/v1/chat/completions"}')
            return
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("not a JSON object")
        except ValueError as error:
            self._reply(400, json.dumps({"error": f"the body is not a JSON object: "
                                                  f"{error}"}).encode())
            return
        self.server.run_prefill(self.path, body)
        self._forward("POST", raw)

    def _forward(self, method: str, raw: bytes | None) -> None:
        """The decode server's answer to this request, streamed through as it comes."""
        request = urllib.request.Request(self.server.decode + self.path, data=raw,
                                         method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            answer = urllib.request.urlopen(request, timeout=self.server.timeout_s)
        except urllib.error.HTTPError as error:
            answer = error
        except OSError as error:
            self._reply(502, json.dumps({"error": f"the decode server: {error}"}).encode())
            return
        with answer:
            self.send_response(answer.status)
            self.send_header("Content-Type", answer.headers.get("Content-Type",
                                                                "application/json"))
            self.end_headers()
            while chunk := answer.read1(_CHUNK):
                self.wfile.write(chunk)
                self.wfile.flush()

    def _reply(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug(format, *args)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", required=True, help="the prefill server's base URL")
    parser.add_argument("--decode", required=True, help="the decode server's base URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    with DisaggProxy((args.host, args.port), args.prefill, args.decode,
                     args.timeout_s) as proxy:
        log.info("atb-mem proxy on http://%s:%d: prefill %s, decode %s", args.host,
                 args.port, args.prefill, args.decode)
        proxy.serve_forever()


if __name__ == "__main__":
    main()

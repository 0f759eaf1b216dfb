"""The OpenAI-compatible HTTP server behind ``atb-mem serve`` (FastAPI).

``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream: true`` as server-sent
events in OpenAI's chunk format), ``GET /v1/models``, ``GET /health``, ``GET /metrics``, and
``/admin/config`` for guarded live changes (``atb_mem.serving.admin``).
Handlers only queue requests with the ``EngineLoop`` and read their outputs; a client that
disconnects has its request aborted (its blocks are freed). Every error is OpenAI-shaped
JSON: 400 for a bad request, 404/405 for a wrong route, 500 for a request the engine failed
(the others run on). ``/health`` answers 503 when the engine loop stopped, or made no
progress for ``health_stall_s`` seconds with work pending.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from atb_mem.scheduling.request_batching import DynamicBatchScheduler
from atb_mem.serving import protocol
from atb_mem.serving.admin import AdminState, add_admin_routes
from atb_mem.serving.config_guard import ConfigGuard
from atb_mem.serving.engine_loop import EngineLoop, RequestFailed, RequestStream
from atb_mem.serving.live_settings import LiveSettings
from atb_mem.serving.params import CompletionOutput, RequestOutput, SamplingParams
from atb_mem.serving.protocol import ChatCompletionRequest, CompletionRequest
from atb_mem.serving.server_metrics import ServerMetrics

__all__ = ["ApiServer", "build_app"]


class BadRequest(Exception):
    """Answered with 400 and OpenAI's error body."""


def _error(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(protocol.error_body(message, kind), status_code=status)


async def _until_disconnected(request: Request) -> None:
    """Returns when the client goes away (the body was read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, error: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(part) for part in item['loc'])}: {item['msg']}"
                             for item in error.errors())
        return _error(400, problems or "malformed request")

    @app.exception_handler(BadRequest)
    async def bad_request(_: Request, error: BadRequest) -> JSONResponse:
        return _error(400, str(error))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return _error(error.status_code, str(error.detail), kind)

    @app.exception_handler(RequestFailed)
    async def failed(_: Request, error: RequestFailed) -> JSONResponse:
        return _error(500, str(error), "server_error")

    @app.exception_handler(Exception)
    async def unexpected(_: Request, error: Exception) -> JSONResponse:
        return _error(500, f"internal error: {error}", "server_error")


def _add_info_routes(app: FastAPI, engine_loop: EngineLoop, model_name: str,
                     metrics: ServerMetrics, health_stall_s: float) -> None:
    """``/health``, ``/v1/models`` and ``/metrics``."""
    engine = engine_loop.engine
    created = int(time.time())

    @app.get("/health")
    async def health() -> Response:
        if not engine_loop.alive:
            return _error(503, f"the engine stopped: {engine_loop.error}", "server_error")
        stalled = engine_loop.stalled_for()
        if stalled > health_stall_s:
            return _error(503, f"the engine made no progress for {stalled:.0f} s with work "
                               "pending", "server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "created": created, "owned_by": "atb-mem",
                                            "max_model_len": engine.max_model_len}]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")


def _check_model(body: protocol._Sampling, model_name: str) -> None:
    """``BadRequest`` for another model's name or what this server does not support."""
    if body.model != model_name:
        raise BadRequest(f"the model {body.model!r} does not exist; this server serves "
                         f"{model_name!r}")
    problem = body.unsupported()
    if problem:
        raise BadRequest(problem)


def _sampling(body: protocol._Sampling, max_tokens: int) -> SamplingParams:
    """The request's sampling parameters, or ``BadRequest`` saying what is wrong."""
    try:
        return body.sampling_params(max_tokens)
    except (ValueError, TypeError) as error:
        raise BadRequest(str(error)) from error


def build_app(engine_loop: EngineLoop, model_name: str, metrics: ServerMetrics,
              health_stall_s: float = 60.0) -> FastAPI:
    """The app; the caller starts ``engine_loop`` (with ``metrics.observe``) and stops it."""
    app = FastAPI(title="atb-mem", docs_url=None, redoc_url=None)
    engine = engine_loop.engine
    _add_error_handlers(app)
    _add_info_routes(app, engine_loop, model_name, metrics, health_stall_s)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_model(body, model_name)
        if isinstance(body.prompt, str) and engine.tokenizer is None:
            raise BadRequest("this model has no tokenizer: send the prompt as token ids")
        params = _sampling(body, body.max_tokens or 16)
        stream = await _submit(engine_loop, body.prompt, params, "cmpl")
        if body.stream:
            header = protocol.header("cmpl", stream.request_id, model_name)
            return _sse(engine_loop, stream, lambda one: [protocol.completion_chunk(header, one)])
        final = await _collect(engine_loop, stream, request)
        if final is None:
            return Response(status_code=499)
        return JSONResponse(protocol.completion_response(
            stream.request_id, model_name, len(final.prompt_token_ids), final.outputs))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        _check_model(body, model_name)
        if engine.tokenizer is None or not getattr(engine.tokenizer, "chat_template", None):
            raise BadRequest("this model's tokenizer has no chat template")
        prompt = _chat_prompt(engine.tokenizer, body)
        room = engine.max_model_len - len(prompt)
        params = _sampling(body, body.max_completion_tokens or body.max_tokens or max(room, 1))
        stream = await _submit(engine_loop, prompt, params, "chatcmpl")
        if body.stream:
            header = protocol.header("chatcmpl", stream.request_id, model_name)
            started: set[int] = set()

            def chunks(one: CompletionOutput) -> list[dict[str, Any]]:
                out = []
                if one.index not in started:
                    started.add(one.index)
                    out.append(protocol.chat_chunk(header, one.index,
                                                   {"role": "assistant", "content": ""}, None))
                out.append(protocol.chat_chunk(header, one.index, {"content": one.text},
                                               one.finish_reason))
                return out

            return _sse(engine_loop, stream, chunks)
        final = await _collect(engine_loop, stream, request)
        if final is None:
            return Response(status_code=499)
        return JSONResponse(protocol.chat_response(
            stream.request_id, model_name, len(final.prompt_token_ids), final.outputs))

    return app


def _chat_prompt(tokenizer: Any, body: ChatCompletionRequest) -> list[int]:
    messages = [message.model_dump() for message in body.messages]
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
    except Exception as error:  # a template that raises on these messages
        raise BadRequest(f"the chat template refused the messages: {error}") from error
    return [int(token) for token in ids]


async def _submit(engine_loop: EngineLoop, prompt: Any, params: SamplingParams,
                  prefix: str) -> RequestStream:
    stream = engine_loop.submit(prompt, params, prefix)
    first = await stream.get()
    if isinstance(first, (ValueError, TypeError)):
        raise BadRequest(str(first))
    if isinstance(first, BaseException):
        raise first
    return stream


async def _collect(engine_loop: EngineLoop, stream: RequestStream,
                   request: Request) -> RequestOutput | None:
    """Every delta merged into one output; None if the client went away first (aborted)."""
    merged: dict[int, CompletionOutput] = {}
    final: RequestOutput | None = None
    disconnected = asyncio.ensure_future(_until_disconnected(request))
    try:
        while final is None:
            item = asyncio.ensure_future(stream.get())
            done, _ = await asyncio.wait({item, disconnected},
                                         return_when=asyncio.FIRST_COMPLETED)
            if item not in done:
                item.cancel()
                engine_loop.abort(stream.request_id)
                return None
            output = item.result()
            if isinstance(output, BaseException):
                raise output
            for one in output.outputs:
                seen = merged.setdefault(one.index, CompletionOutput(one.index, []))
                seen.token_ids += one.token_ids
                seen.text += one.text
                seen.finish_reason = one.finish_reason
            if output.finished:
                final = RequestOutput(output.request_id, output.prompt_token_ids,
                                      [merged[index] for index in sorted(merged)], True)
    finally:
        disconnected.cancel()
    return final


def _sse(engine_loop: EngineLoop, stream: RequestStream,
         chunks: Callable[[CompletionOutput], list[dict[str, Any]]]) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        try:
            while not stream.finished:
                output = await stream.get()
                if isinstance(output, BaseException):
                    error = protocol.error_body(str(output), "server_error")
                    yield f"data: {json.dumps(error)}\n\n"
                    return
                for one in output.outputs:
                    for chunk in chunks(one):
                        yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if not stream.finished:  # the client went away mid-stream
                engine_loop.abort(stream.request_id)

    return StreamingResponse(events(), media_type="text/event-stream")


class ApiServer:
    """The engine loop, the app and uvicorn together: ``run()`` serves until Ctrl-C (then
    stops the engine cleanly); ``start()``/``shutdown()`` do it in a background thread."""

    def __init__(self, engine: Any, model_name: str, host: str = "127.0.0.1",
                 port: int = 8000, *, guard: ConfigGuard | None = None,
                 admin_token: str | None = None, config_path: str | None = None,
                 admission: DynamicBatchScheduler | None = None,
                 admin_allow_loopback: bool | None = None,
                 health_stall_s: float = 60.0) -> None:
        """``admin_allow_loopback`` (default: whether ``host`` is a loopback address) lets
        loopback clients use ``/admin/config`` without the token."""
        import uvicorn

        from atb_mem.serving.admin import is_loopback

        if not health_stall_s > 0:
            raise ValueError(f"health_stall_s must be > 0, got {health_stall_s}")
        if admin_allow_loopback is None:
            admin_allow_loopback = is_loopback(host) or host == "localhost"
        self.metrics = ServerMetrics(engine, model_name)
        self.guard = guard or ConfigGuard(LiveSettings(engine.scheduler, admission).check())
        self.admin = AdminState(admin_token=admin_token, config_path=config_path,
                                rollbacks=self.metrics.rollbacks,
                                allow_loopback=admin_allow_loopback)
        self.engine_loop = EngineLoop(engine, self.metrics.observe, self.guard,
                                      self.admin.on_decision, admission)
        self.metrics.model_time_ratio.set_function(
            lambda: figures.model_time_ratio if (figures := self.guard.recent()) else 1.0)
        self.app = build_app(self.engine_loop, model_name, self.metrics, health_stall_s)
        add_admin_routes(self.app, self.engine_loop, self.admin)
        # proxy_headers off: the client address the admin check reads is the socket's peer,
        # never an X-Forwarded-For a remote client wrote (whatever FORWARDED_ALLOW_IPS says).
        self.server = uvicorn.Server(uvicorn.Config(self.app, host=host, port=port,
                                                    log_level="warning", access_log=False,
                                                    proxy_headers=False))
        self._thread: threading.Thread | None = None

    def run(self) -> None:
        self.engine_loop.start()
        try:
            self.server.run()
        finally:
            self.engine_loop.stop()

    def start(self, timeout: float = 30.0) -> ApiServer:
        self._thread = threading.Thread(target=self.run, name="atb-mem-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    @property
    def url(self) -> str:
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    def shutdown(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(30)

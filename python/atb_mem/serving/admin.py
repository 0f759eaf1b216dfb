"""``/admin/config``: the running server's scheduling configuration, changed live and guarded.

``GET`` answers the configuration in force, the last stable one, whether a change is being
watched, and the history of decisions. ``POST {"set": {...}, "live": true, "watch_s": 300,
"persist": false}`` validates the settings (400 and nothing changed when one is bad); with
``live`` the engine loop applies them at its next step boundary and the guard watches them
(409 while another change is watched). A change that survives its watch period becomes the
stable configuration and, with ``persist``, is written to the server's ``--config`` file; one
that costs throughput or health is rolled back by the loop itself, logged and counted.

Only loopback clients are served, unless the server has an admin token and the client sends
it (``Authorization: Bearer TOKEN``).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from atb_mem.serving import protocol
from atb_mem.serving.config_guard import Decision
from atb_mem.serving.engine_loop import ChangeInProgress, EngineLoop

__all__ = ["AdminState", "add_admin_routes", "load_config_file"]

log = logging.getLogger("atb_mem.admin")

_LOOPBACK = {"127.0.0.1", "::1", "localhost"}


def load_config_file(path: str | Path) -> dict[str, Any]:
    """The scheduler settings a ``--config`` file holds (a JSON object)."""
    try:
        settings = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read the config file {str(path)!r}: {error}") from error
    if not isinstance(settings, dict):
        raise ValueError(f"the config file {str(path)!r} must hold a JSON object")
    return settings


class AdminState:
    """What the admin routes and the engine loop's decisions share: the token, the config
    file, whether the watched change asked to be persisted, and the rollback counter."""

    def __init__(self, *, admin_token: str | None = None, config_path: str | Path | None = None,
                 rollbacks: Any = None) -> None:
        self.admin_token = admin_token
        self.config_path = Path(config_path) if config_path is not None else None
        self.rollbacks = rollbacks
        self.persist_next = False
        # One change at a time, from the check until the loop has applied (or refused) it.
        self.post_lock = asyncio.Lock()

    def allowed(self, request: Request) -> bool:
        host = request.client.host if request.client else ""
        if host in _LOOPBACK:
            return True
        sent = request.headers.get("authorization", "")
        return self.admin_token is not None and hmac.compare_digest(
            sent.encode(), f"Bearer {self.admin_token}".encode())

    def on_decision(self, decision: Decision) -> None:
        """In the engine loop: log, count, persist."""
        persist, self.persist_next = self.persist_next, False
        if decision.outcome == "rollback":
            log.warning("atb-mem: configuration rolled back (%s): %s", decision.reason,
                        decision.config)
            if self.rollbacks is not None:
                self.rollbacks.labels(decision.reason).inc()
            return
        log.info("atb-mem: configuration kept (%s): %s", decision.reason, decision.config)
        if persist and self.config_path is not None:
            self.config_path.write_text(json.dumps(decision.config, indent=2) + "\n")


def add_admin_routes(app: FastAPI, engine_loop: EngineLoop, admin: AdminState) -> None:
    guard = engine_loop.guard
    settings = engine_loop.settings
    if guard is None:
        raise ValueError("the admin routes need an engine loop with a guard")

    def refused() -> JSONResponse:
        return JSONResponse(protocol.error_body(
            "the admin API serves loopback clients, or others with the admin token",
            "permission_error"), status_code=403)

    def bad(status: int, message: str) -> JSONResponse:
        return JSONResponse(protocol.error_body(message), status_code=status)

    @app.get("/admin/config")
    async def get_config(request: Request) -> JSONResponse:
        if not admin.allowed(request):
            return refused()
        # The configuration the next step runs with (a live change waits for a step boundary).
        return JSONResponse({"config": settings.check(),
                             "stable": dict(guard.stable),
                             "watching": guard.watching, "history": list(guard.history)})

    @app.post("/admin/config")
    async def post_config(request: Request) -> JSONResponse:
        if not admin.allowed(request):
            return refused()
        try:
            body = json.loads(await request.body())
        except json.JSONDecodeError as error:
            return bad(400, f"malformed JSON: {error}")
        if not isinstance(body, dict) or not isinstance(body.get("set"), dict) \
                or not body["set"]:
            return bad(400, 'expected {"set": {"setting": value, ...}, "live": true, ...}')
        changes, live = body["set"], bool(body.get("live", False))
        watch_s, persist = body.get("watch_s", 300.0), bool(body.get("persist", False))
        if isinstance(watch_s, bool) or not isinstance(watch_s, (int, float)) or watch_s <= 0:
            return bad(400, f"watch_s must be a number of seconds > 0, got {watch_s!r}")
        if persist and admin.config_path is None:
            return bad(400, "the server was started without --config: nothing to persist to")
        try:
            proposed = settings.check(**changes)
        except (ValueError, TypeError) as error:
            return bad(400, str(error))
        if not live:
            return JSONResponse({"applied": False, "would_be": proposed})
        async with admin.post_lock:
            if guard.watching:
                return bad(409, "a configuration change is being watched; wait for its "
                                "decision")
            admin.persist_next = persist
            try:
                previous = await asyncio.wrap_future(engine_loop.reconfigure(changes,
                                                                             float(watch_s)))
            except (ValueError, TypeError, ChangeInProgress) as error:
                admin.persist_next = False
                return bad(409 if isinstance(error, ChangeInProgress) else 400, str(error))
        return JSONResponse({"applied": True, "previous": previous, "config": proposed,
                             "watch_s": watch_s})

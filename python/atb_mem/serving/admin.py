"""``/admin/config``: the running server's scheduling configuration, changed live and guarded.

``GET`` answers the configuration in force, the last stable one, whether a change is being
watched, and the history of decisions. ``POST {"set": {...}, "live": true, "watch_s": 300,
"persist": false}`` validates the settings (400 and nothing changed when one is bad); with
``live`` the engine loop applies them at its next step boundary and the guard watches them
(409 while another change is watched). A change that survives its watch period becomes the
stable configuration and, with ``persist``, is written to the server's ``--config`` file; one
that costs throughput or health is rolled back by the loop itself, logged and counted.

A client with the admin token (``Authorization: Bearer TOKEN``) is served; without it, only
when loopback trust is on (``--admin-allow-loopback``, the default for a loopback ``--host``),
the socket's real peer is a loopback address and the request carries no forwarding header
(behind a proxy or sidecar every client looks local). ``DELETE /admin/config/watch`` ends a
watched change now and rolls it back.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from atb_mem.serving import protocol
from atb_mem.serving.config_guard import Decision
from atb_mem.serving.engine_loop import ChangeInProgress, EngineLoop

__all__ = ["AdminState", "add_admin_routes", "load_config_file"]

log = logging.getLogger("atb_mem.admin")

_FORWARDING_HEADERS = ("forwarded", "x-forwarded-for", "x-real-ip")

MAX_WATCH_S = 86_400.0
"""The longest watch a change may ask for: a day."""


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` is a loopback address (127.0.0.0/8, ::1, IPv4-mapped too)."""
    try:
        address = ipaddress.ip_address(host or "")
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


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
                 rollbacks: Any = None, allow_loopback: bool = True) -> None:
        if admin_token is not None and not admin_token.strip():
            raise ValueError("the admin token is empty: give a secret, or none")
        self.admin_token = admin_token
        self.allow_loopback = allow_loopback
        self.persist_errors = 0
        """Kept changes that could not be written to the config file (logged)."""
        self.config_path = Path(config_path) if config_path is not None else None
        self.rollbacks = rollbacks
        self.persist_next = False
        # One change at a time, from the check until the loop has applied (or refused) it.
        self.post_lock = asyncio.Lock()

    def allowed(self, request: Request) -> bool:
        if self.admin_token is not None:
            sent = request.headers.get("authorization", "")
            if hmac.compare_digest(sent.encode(), f"Bearer {self.admin_token}".encode()):
                return True
        # The ASGI client is the socket's peer: the server does not rewrite it from
        # forwarding headers (ApiServer starts uvicorn with proxy_headers off).
        peer = request.scope.get("client")
        return self.allow_loopback and peer is not None and is_loopback(peer[0]) and \
            not any(header in request.headers for header in _FORWARDING_HEADERS)

    def persist_problem(self) -> str | None:
        """Why a kept change could not be written to the config file now (None: it could)."""
        if self.config_path is None:
            return "the server was started without --config: nothing to persist to"
        directory = self.config_path.parent
        try:
            with tempfile.NamedTemporaryFile(dir=directory, prefix=".atb-mem-"):
                pass
        except OSError as error:
            return f"cannot write the config file {str(self.config_path)!r}: {error}"
        return None

    def _persist(self, config: dict[str, Any]) -> None:
        assert self.config_path is not None
        # A whole file or none: written beside it, then renamed over it.
        handle, temporary = tempfile.mkstemp(dir=self.config_path.parent, prefix=".atb-mem-")
        try:
            with os.fdopen(handle, "w") as file:
                file.write(json.dumps(config, indent=2) + "\n")
            os.replace(temporary, self.config_path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise

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
            try:
                self._persist(decision.config)
            except OSError:  # the file went away since the change was asked for, say
                self.persist_errors += 1
                log.exception("atb-mem: the kept configuration was not persisted")


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
        changes, live = body["set"], body.get("live", False)
        watch_s, persist = body.get("watch_s", 300.0), body.get("persist", False)
        for name, flag in (("live", live), ("persist", persist)):
            if not isinstance(flag, bool):
                return bad(400, f"{name} must be true or false, got {flag!r}")
        if isinstance(watch_s, bool) or not isinstance(watch_s, (int, float)) or \
                not math.isfinite(watch_s) or not 0 < watch_s <= MAX_WATCH_S:
            return bad(400, f"watch_s must be a number of seconds in (0, {MAX_WATCH_S:.0f}], "
                            f"got {watch_s!r}")
        if persist and (problem := admin.persist_problem()) is not None:
            return bad(400, problem)
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

    @app.delete("/admin/config/watch")
    async def cancel_watch(request: Request) -> JSONResponse:
        if not admin.allowed(request):
            return refused()
        async with admin.post_lock:
            try:
                restored = await asyncio.wrap_future(engine_loop.cancel_watch())
            except ValueError as error:
                return bad(409, str(error))
        return JSONResponse({"cancelled": True, "config": restored})

"""The controller's HTTP API (LMCache's: /lookup, /move, /clear, /health, ...) and its web page.

A FastAPI app, so /openapi.json and /docs describe every endpoint. Errors keep the API's one shape,
`{"error": "<what to fix>"}`: a body that fails its model is a 400 naming the field (not FastAPI's
422 list), an unknown route or method keeps its status with that shape too.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.exceptions import HTTPException

from kvferry.controller import models as api
from kvferry.controller import page
from kvferry.controller.registry import RegistryError
from kvferry.controller.request_guard import Guard

if TYPE_CHECKING:
    from kvferry.controller.cluster import Controller

TOKENS = "tokens must be a list of token ids (POST /tokenize on the vLLM server gives them)"
NOT_JSON = "the body is not JSON"
# The message for a field that failed its model, from the value the client sent.
FIELD_ERRORS: dict[str, Callable[[Any], str]] = {
    "tokens": lambda _: TOKENS,
    "copy": lambda v: f"copy must be true or false, got {v!r}",
    "old_position": lambda v: f"old_position must be [instance_id, location], got {v!r}",
    "new_position": lambda v: f"new_position must be [instance_id, location], got {v!r}",
    "instance_id": lambda v: f"instance_id must be a string (the instance's lmcache_instance_id), got {v!r}",
    "location": lambda v: f"location {v!r} is not supported: use \"LocalCPUBackend\"",
}
ERRORS: dict[int | str, dict[str, Any]] = {400: {"model": api.ErrorBody, "description": "bad input; the message names "
                                                                                        "the fix"},
          401: {"model": api.ErrorBody, "description": "the admin key is missing or wrong"}}


class JSON(JSONResponse):
    """json.dumps as it is (a worker's NaN in the history must not make /api/state fail)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content).encode()


def error(status: int, message: str) -> JSON:
    return JSON({"error": message}, status_code=status)


def validation_message(exc: RequestValidationError) -> str:
    """Today's message for the first field that failed (fields are checked in the model's order)."""
    first = exc.errors()[0]
    loc = first.get("loc", ())
    if first.get("type") == "json_invalid" or (tuple(loc) == ("body",) and first.get("type") == "missing"):
        return NOT_JSON
    body = exc.body if isinstance(exc.body, dict) else None
    if body is None or len(loc) < 2 or loc[1] not in FIELD_ERRORS:
        return "the body must be a JSON object"
    return FIELD_ERRORS[loc[1]](body.get(loc[1]))


def build_app(c: Controller) -> Guard:
    app = FastAPI(title="kvferry-controller", version="0.1.0", description=(
        "The P2P cluster's registry, lookup service and mover (LMCache's controller API). With an admin key, "
        "every endpoint but /health needs it: `Authorization: Bearer <key>`, or Basic auth with the key as the "
        "password."))

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSON:
        return error(400, validation_message(exc))

    @app.exception_handler(RegistryError)
    async def _refused(_: Request, exc: RegistryError) -> JSON:
        return error(400, str(exc))

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> JSON:
        # FastAPI's own 400 for a body it could not read at all (e.g. not UTF-8).
        msg = NOT_JSON if exc.status_code == 400 and exc.__cause__ is not None else str(exc.detail)
        return JSON({"error": msg}, status_code=exc.status_code, headers=exc.headers)

    @app.get("/", response_class=HTMLResponse, summary="The web page: instances, transfers, events")
    async def index() -> HTMLResponse:
        return HTMLResponse(page.render(c.registry.state()))

    @app.get("/api/state", responses={200: {"model": api.StateResponse}, **ERRORS},
             summary="What the page shows, as JSON")
    async def state() -> JSON:
        return JSON(c.registry.state())

    @app.get("/health", responses={200: {"model": api.HealthResponse}, 503: {"model": api.HealthResponse}},
             summary="ok, or 503 degraded while a loop keeps failing; never needs the admin key")
    async def health() -> JSON:
        ok, body = c.health()
        return JSON(body, status_code=200 if ok else 503)

    @app.post("/lookup", responses={200: {"model": api.LookupAnswer}, **ERRORS},
              summary="Tokens of the prompt's prefix each instance holds")
    async def lookup(body: api.LookupBody) -> JSON:
        return JSON(c.lookup(body.tokens))

    @app.post("/move", responses={200: {"model": api.MoveResponse}, **ERRORS},
              summary="Move (or copy) the prompt's prefix from one instance's CPU tier to another's")
    async def move(body: api.MoveRequest) -> JSON:
        return JSON(c.move(body.old_position or [], body.new_position or [], body.tokens, body.copy_))

    def event(event_id: str) -> JSON:
        ev = c.move_event(event_id)
        if ev is None:
            return error(404, f"no move with event_id {event_id!r} (the controller keeps the last 1000)")
        return JSON(ev.model_dump(by_alias=True, exclude_none=True))

    not_found: dict[int | str, dict[str, Any]] = {404: {"model": api.ErrorBody, "description": "no such move (the "
                                                                                               "controller keeps the "
                                                                                               "last 1000)"}}

    @app.get("/move/{event_id}", responses={200: {"model": api.MoveEvent}, **ERRORS, **not_found},
             summary="A move's status")
    async def move_status(event_id: str) -> JSON:
        return event(event_id)

    @app.post("/check_finish", responses={200: {"model": api.MoveEvent}, **ERRORS, **not_found},
              summary="A move's status (LMCache's form)")
    async def check_finish(body: api.CheckFinishRequest) -> JSON:
        return event(body.event_id)

    @app.post("/clear", responses={200: {"model": api.ClearResponse}, **ERRORS,
                                   502: {"model": api.ClearResponse, "description": "a worker failed to clear"}},
              summary="Clear one instance's CPU tier, or every instance's")
    async def clear(body: api.ClearRequest) -> JSON:
        res = await c.clear(body.instance_id, body.location)
        return JSON(res, status_code=502 if res["status"] == "failed" else 200)

    return Guard(app, c.admin_key, c.counters, c.hosts)

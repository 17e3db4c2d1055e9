"""What the route modules share (server/app.py, server/responses.py): the server's state, auth, the JSON body
reader with its limits, admission control, the OpenAI error response and disconnect handling."""

from __future__ import annotations

import asyncio
import hmac
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse

from jinfer.client import EngineClient
from server.errors import InvalidRequest
from server.metrics import Metrics
from server.validation import ServingContext

RETRY_AFTER_S = 1
MAX_BODY_BYTES = 32 << 20
MAX_JSON_DEPTH = 64  # nesting of arrays/objects in a request body


@dataclass
class ServerState:
    client: EngineClient
    tokenizer: Any
    ctx: ServingContext
    api_key: str | None
    max_in_flight: int  # sequences: running + queued
    metrics: Metrics = field(default_factory=Metrics)
    in_flight: int = 0
    started: int = field(default_factory=lambda: int(time.time()))


def _error(e: InvalidRequest) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _state(request: Request) -> ServerState:
    return request.app.state.jinfer


def _check_auth(request: Request, state: ServerState) -> None:
    if state.api_key is None:
        return
    # constant time: how long a refusal takes says nothing about how much of the key was right
    sent = request.headers.get("authorization", "").encode("utf-8", "surrogatepass")
    if not hmac.compare_digest(sent, f"Bearer {state.api_key}".encode("utf-8", "surrogatepass")):
        raise InvalidRequest("Incorrect or missing API key: send 'Authorization: Bearer <key>'", None,
                             "invalid_api_key", 401)


async def _json_body(request: Request) -> Any:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise InvalidRequest(f"the request body exceeds {MAX_BODY_BYTES} bytes", None, "request_too_large", 413)
        chunks.append(chunk)
    raw = b"".join(chunks)
    if json_depth(raw) > MAX_JSON_DEPTH:
        raise InvalidRequest(f"the request body nests arrays/objects deeper than {MAX_JSON_DEPTH} levels", None,
                             "invalid_json")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, int digit limit
        raise InvalidRequest(f"the request body is not valid JSON: {str(e)[:200]}", None, "invalid_json") from None


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_DEPTH_STEP = np.zeros(256, np.int8)
_DEPTH_STEP[[ord("["), ord("{")]] = 1
_DEPTH_STEP[[ord("]"), ord("}")]] = -1


def json_depth(raw: bytes) -> int:
    """Maximum nesting depth of the brackets of a JSON text, outside its strings, without parsing it (a
    parser recurses per level: 100,000 nested '[' overflowed the stack). """
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return 0  # cannot be deeper (the usual case: no scan)
    steps = _DEPTH_STEP[np.frombuffer(_JSON_STRING.sub(b"", raw), np.uint8)]
    return int(np.cumsum(steps, dtype=np.int64).max(initial=0))


def _admit(state: ServerState, num_seqs: int) -> Callable[[], None]:
    if not state.client.is_alive:
        raise InvalidRequest("the engine is unavailable", None, "engine_unavailable", 503, "server_error")
    if num_seqs > state.max_in_flight:
        raise InvalidRequest(f"this request needs {num_seqs} sequences (prompts x n) but the server takes at most "
                             f"{state.max_in_flight} at a time", "n")
    if state.in_flight + num_seqs > state.max_in_flight:
        raise InvalidRequest(f"the server is overloaded ({state.in_flight} sequences in flight); retry later",
                             None, "overloaded", 503, "server_error", {"Retry-After": str(RETRY_AFTER_S)})
    state.in_flight += num_seqs
    state.metrics.in_flight.set(state.in_flight)

    def release() -> None:
        state.in_flight -= num_seqs
        state.metrics.in_flight.set(state.in_flight)

    return release


class ClientDisconnected(Exception):
    pass


async def _until_disconnect(request: Request, coro: Any) -> Any:
    """Run `coro`; if the HTTP client goes away first, cancel it (which aborts the engine request)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(coro), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise ClientDisconnected
    return task.result()


_STATUS_BY_CODE = {"invalid_api_key": "unauthorized", "overloaded": "overloaded", "engine_unavailable": "error"}

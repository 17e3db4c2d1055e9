"""The OpenAI-compatible HTTP server (Starlette): routes, auth, admission control, error bodies.

    POST /v1/completions, POST /v1/chat/completions   (JSON or SSE with `stream: true`)
    POST /v1/responses, GET|DELETE /v1/responses/{id}   (server/responses.py)
    POST /v1/embeddings   (an embedding model's: server/embeddings.py)
    GET  /v1/models, /health, /metrics, /version;  GET|POST /ping;  POST /tokenize, /detokenize;  GET /tokenizer_info

The engine is reached through `jinfer.client.EngineClient` (ZeroMQ); this process tokenizes, applies
the chat template, validates, and formats. Admission is bounded: at most max_num_seqs running plus
`max_queued_requests` waiting sequences, past that 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import jinfer
from jinfer.client import EngineClient
from server import schemas
from server.access_log import AccessLog
from server.embeddings import parse_embedding, require_task, run_embeddings
from server.errors import InvalidRequest
from server.generation import Generation
from server.http_common import (
    _STATUS_BY_CODE,
    ClientDisconnected,
    ServerState,
    _admit,
    _check_auth,
    _error,
    _json_body,
    _state,
    _until_disconnect,
)
from server.metrics import Metrics
from server.request_fields import warn_ignored_fields
from server.responses import routes as responses_routes
from server.tokenization import detokenize, tokenize, tokenizer_info
from server.validation import ServingContext, parse_chat, parse_completion


async def _generate(request: Request, chat: bool) -> Response:
    state = _state(request)
    endpoint = "chat" if chat else "completions"
    try:
        _check_auth(request, state)
        body = await _json_body(request)
        warn_ignored_fields(body, chat)
        require_task(state.ctx, embedding=False)
        req = parse_chat(body, state.ctx) if chat else parse_completion(body, state.ctx)
        release = _admit(state, len(req.prompts) * req.params.n)
    except InvalidRequest as e:
        state.metrics.requests.labels(endpoint, _STATUS_BY_CODE.get(e.code, "invalid")).inc()
        return _error(e)
    gen = Generation(state, req, release)
    request.state.generation = gen  # its summary goes into the access line (server/access_log.py)
    try:  # counted and logged by gen.close() from here on
        await _until_disconnect(request, gen.start())
    except InvalidRequest as e:
        return _error(e)
    except ClientDisconnected:
        return Response(status_code=499)
    if req.stream:
        return StreamingResponse(gen.sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        return JSONResponse(await _until_disconnect(request, gen.collect()))
    except InvalidRequest as e:
        return _error(e)
    except ClientDisconnected:
        return Response(status_code=499)  # nobody reads it: the client is gone


async def completions(request: Request) -> Response:
    return await _generate(request, chat=False)


async def chat_completions(request: Request) -> Response:
    return await _generate(request, chat=True)


async def embeddings(request: Request) -> Response:
    state = _state(request)
    status = "invalid"
    try:
        _check_auth(request, state)
        req = parse_embedding(await _json_body(request), state.ctx)
        release = _admit(state, len(req.prompts))
    except InvalidRequest as e:
        state.metrics.requests.labels("embeddings", _STATUS_BY_CODE.get(e.code, "invalid")).inc()
        return _error(e)
    try:
        body = await _until_disconnect(request, run_embeddings(state.client, req))
        status = "success"
        return JSONResponse(body)
    except InvalidRequest as e:
        status = "error" if e.status >= 500 else "invalid"
        return _error(e)
    except ClientDisconnected:
        status = "aborted"
        return Response(status_code=499)
    finally:
        release()
        state.metrics.requests.labels("embeddings", status).inc()
        if status == "success":
            state.metrics.prompt_tokens.inc(sum(len(p) for p in req.prompts))


async def models(request: Request) -> Response:
    state = _state(request)
    try:
        _check_auth(request, state)
    except InvalidRequest as e:
        return _error(e)
    cards = [schemas.model_card(n, state.started, state.ctx.max_model_len) for n in state.ctx.model_names]
    return JSONResponse({"object": "list", "data": cards})


async def health(request: Request) -> Response:
    client = _state(request).client
    replicas = client.replicas
    if client.is_alive:
        body: dict[str, Any] = {"status": "ok"}
        if len(replicas) > 1:  # data parallel: serving while any replica is
            body["replicas_alive"] = [i for i, c in enumerate(replicas) if c.is_alive]
        return JSONResponse(body)
    return JSONResponse({"status": "unhealthy", "reason": client.dead_reason or "engine client closed"},
                        status_code=503)


async def _replica_stats(replica: EngineClient) -> dict[str, float]:
    if replica.is_alive:
        try:
            return await replica.stats_async(timeout=1.0)
        except Exception:  # a busy or dying engine: serve the last pushed numbers
            pass
    return replica.latest_stats


async def metrics(request: Request) -> Response:
    state = _state(request)
    replicas = state.client.replicas
    stats = await asyncio.gather(*(_replica_stats(r) for r in replicas))
    for i, (replica, s) in enumerate(zip(replicas, stats, strict=True)):
        state.metrics.set_engine_stats(s, replica.is_alive, i)
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


async def ping(request: Request) -> Response:
    """vLLM's /ping (GET or POST): the same answer as /health."""
    return await health(request)


def _json_endpoint(handler: Callable[[Any, ServingContext], dict[str, Any]]) -> Callable[[Request], Any]:
    """A POST endpoint that answers one JSON body with one JSON body (/tokenize, /detokenize)."""

    async def endpoint(request: Request) -> Response:
        state = _state(request)
        try:
            _check_auth(request, state)
            return JSONResponse(handler(await _json_body(request), state.ctx))
        except InvalidRequest as e:
            return _error(e)

    return endpoint


async def get_tokenizer_info(request: Request) -> Response:
    state = _state(request)
    try:
        _check_auth(request, state)
        return JSONResponse(tokenizer_info(state.ctx))
    except InvalidRequest as e:
        return _error(e)


async def version(request: Request) -> Response:
    return JSONResponse({"version": jinfer.__version__})


async def _http_error(request: Request, exc: HTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return JSONResponse(schemas.error_body(str(exc.detail), param=None, code=code), status_code=exc.status_code)


def build_app(client: EngineClient, *, tokenizer: Any = None, served_model_names: list[str] | None = None,
              api_key: str | None = None, max_queued_requests: int | None = None,
              tool_parser: str | None = None, reasoning_parser: str | None = None,
              log_requests: bool = True) -> Starlette:
    """The ASGI app around a connected client. `max_queued_requests` (default 4 x max_num_seqs) bounds the
    sequences waiting beyond the engine's max_num_seqs. `tool_parser`: read tool calls of tool_choice "auto"
    with this parser (server/tools.py; None: "auto" is refused). `reasoning_parser`: split chat outputs into
    reasoning_content and content (server/reasoning.py). `log_requests`: one access line per request."""
    info = client.info
    tokenizer = tokenizer if tokenizer is not None else client.tokenizer
    names = tuple(served_model_names or [info.model_name])
    queued = 4 * info.max_num_seqs if max_queued_requests is None else max_queued_requests
    ctx = ServingContext(names, info.max_model_len, info.vocab_size, tokenizer,
                         dict(getattr(info, "generation_defaults", {}) or {}), tool_parser,
                         reasoning_parser=reasoning_parser, embedding_size=int(getattr(info, "embedding_size", 0) or 0))
    state = ServerState(client, tokenizer, ctx,
                        api_key, info.max_num_seqs + queued, Metrics(names[0]))

    app = Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/ping", ping, methods=["GET", "POST"]),
        Route("/tokenize", _json_endpoint(tokenize), methods=["POST"]),
        Route("/detokenize", _json_endpoint(detokenize), methods=["POST"]),
        Route("/tokenizer_info", get_tokenizer_info, methods=["GET"]),
        *responses_routes(),
    ], exception_handlers={HTTPException: _http_error}, middleware=[Middleware(AccessLog)] if log_requests else [])
    app.state.jinfer = state
    return app

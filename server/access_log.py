"""One access line per HTTP request, rejected ones included, once its response is complete (a stream's last
event sent, or the client gone):

    127.0.0.1:50312 "POST /v1/chat/completions" 200 812.4ms id=chatcmpl-1f.. prompt_tokens=12 output_tokens=30
        ttft_ms=41.2 tpot_ms=8.1 finish=stop      (on one line)
    127.0.0.1:50314 "POST /v1/completions" 400 1.9ms error="'max_tokens' must be an integer, got str '10'"

A generation request adds what server/generation.py measured (its `summary`, left in the request's scope
state under "generation"); an error response adds its OpenAI error message. Logged by "jinfer.access" at
INFO; `build_app(log_requests=False)` leaves this middleware out (the launcher's --disable-log-requests).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

log = logging.getLogger("jinfer.access")

_ERROR_BODY_BYTES = 4096  # enough for an OpenAI error body; a larger one is not read for the log


class AccessLog:
    """ASGI middleware."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.monotonic()
        state = scope.setdefault("state", {})  # the same dict as the handler's request.state
        status: int | None = None
        error_body = bytearray()

        async def send_and_watch(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and status is not None and status >= 400:
                error_body.extend(message.get("body", b"")[:_ERROR_BODY_BYTES - len(error_body)])
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        finally:
            if log.isEnabledFor(logging.INFO):
                client = scope.get("client")
                where = f"{client[0]}:{client[1]}" if client else "-"
                log.info('%s "%s %s" %d %.1fms%s', where, scope["method"], scope["path"], status or 500,
                         (time.monotonic() - t0) * 1e3, _details(state.get("generation"), bytes(error_body)))


def _details(generation: Any, error_body: bytes) -> str:
    out = ""
    summary = getattr(generation, "summary", None)
    if summary:
        out += "".join(f" {k}={v}" for k, v in summary.items() if v is not None)
    if error_body:
        try:
            message = json.loads(error_body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = None
        if isinstance(message, str):
            out += f" error={json.dumps(message[:300], ensure_ascii=False)}"
    return out

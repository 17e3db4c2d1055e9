"""HTTP errors with OpenAI's error body, and the mapping of the engine's `InvalidParam` onto them (light: the
launcher imports this before the engine starts; the other engine errors map in server/generation.py).

An `InvalidParam` (jinfer/errors.py) keeps its "param" on the way: the server's checks raise it, and so does the
engine, whose refusal comes back through the wire protocol's `Rejected`; either becomes a 400 whose "param" is
the request's own name for the field (chat's `max_completion_tokens` for the engine's `max_tokens`...).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jinfer.errors import InvalidParam


class InvalidRequest(Exception):
    """Becomes an HTTP error with an OpenAI error body."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def from_invalid_param(e: InvalidParam, param_names: Mapping[str, str] | None = None) -> InvalidRequest:
    """A 400 for an InvalidParam; `param_names` maps the engine's field names onto the request's."""
    names = param_names or {}
    return InvalidRequest(e.message, names.get(e.param, e.param), e.code)

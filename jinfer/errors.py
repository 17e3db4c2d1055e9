"""Typed errors a request can meet, carried unchanged from where they are raised to the HTTP error body.

`InvalidParam` names the request field at fault: SamplingParams' checks and the engine's input processor raise
it; the engine process answers it as `Rejected(request_id, message, param)` (jinfer/engine/protocol.py), the
client raises it again, and the server turns it into an OpenAI-style 400 with that "param". Being a ValueError,
code that only wants "a bad request" catches it as one.
"""

from __future__ import annotations


class InvalidParam(ValueError):
    """A request that can never run as given; `param` names the field at fault (None: the request as a whole)."""

    code: str | None = None  # OpenAI's error code, where one says more than the 400

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param
        self.message = message

    def __reduce__(self):  # pickles (multiprocessing, pytest-xdist) with both fields
        return type(self), (self.param, self.message)


class ContextLengthExceeded(InvalidParam):
    """The prompt, or the prompt with max_tokens, does not fit the model's context."""

    code = "context_length_exceeded"


def invalid_param(param: str | None, message: str, code: str | None = None) -> InvalidParam:
    """The error a `Rejected(message, param, code)` answer stands for, rebuilt on the client's side."""
    return ContextLengthExceeded(param, message) if code == ContextLengthExceeded.code else InvalidParam(param, message)

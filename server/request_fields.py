"""The request fields /v1/completions and /v1/chat/completions read. Any other field is ignored, and said so in
one warning per request, as vLLM does ("The following fields were present in the request but ignored: ..."),
with the known field a typo was probably meant for ("maxtokens (did you mean max_tokens?)"). The request still
succeeds: clients send fields of newer API versions, and an error would break them.

Keep these sets in step with the parsers (server/validation.py, structured.py, tools.py):
tests/unit/test_request_fields.py checks that every field they read is listed here.
"""

from __future__ import annotations

import difflib
import logging
from typing import Any

from server.structured import GUIDED
from server.validation import _SAMPLING_FIELDS, _UNSUPPORTED

log = logging.getLogger("jinfer.server")

_COMMON = frozenset({
    "model", "stream", "stream_options", "best_of", "stop", "stop_token_ids", "logprobs", "max_tokens",
    "prompt_logprobs", "tools", "tool_choice",  # (completions reads the tools ones to refuse them)
    "response_format", "structured_outputs", "guided_whitespace_pattern", *GUIDED, *_SAMPLING_FIELDS, *_UNSUPPORTED,
})
COMPLETION_FIELDS = _COMMON | {"prompt", "echo"}
CHAT_FIELDS = _COMMON | {"messages", "top_logprobs", "max_completion_tokens", "parallel_tool_calls",
                         "chat_template_kwargs"}
# OpenAI fields about the caller, not the output: accepted without a word, as vLLM does
_METADATA = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"})
_MAX_LISTED = 20  # a body with thousands of stray keys gets one bounded line


def _describe(name: str, known: frozenset[str]) -> str:
    shown = name if name.isidentifier() and len(name) <= 64 else repr(name[:64])  # no newlines into the log
    match = difflib.get_close_matches(name, known, n=1, cutoff=0.75) if len(name) <= 64 else []
    return f"{shown} (did you mean {match[0]}?)" if match else shown


def ignored_fields(body: Any, chat: bool) -> list[str]:
    """The body's top-level fields that this endpoint does not read, each with a likely intended name."""
    if not isinstance(body, dict):
        return []
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    unknown = [k for k in body if k not in known and k not in _METADATA]
    described = [_describe(k, known) for k in unknown[:_MAX_LISTED]]
    if len(unknown) > _MAX_LISTED:
        described.append(f"and {len(unknown) - _MAX_LISTED} more")
    return described


def warn_ignored_fields(body: Any, chat: bool) -> None:
    ignored = ignored_fields(body, chat)
    if ignored:
        log.warning("The following fields were present in the request but ignored: %s", ", ".join(ignored))

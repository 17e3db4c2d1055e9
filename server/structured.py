"""Structured-output fields of a request -> one `StructuredOutputsParams`, or a 400 naming the field.

OpenAI's `response_format` (`text`, `json_object`, `json_schema`), vLLM's `structured_outputs` object and
its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` extras, on chat and
completions alike. At most one of them per request. The grammar is compiled here (without the tokenizer,
cached) so that a bad schema, regex or grammar is a 400 naming the field that carried it; the engine
compiles it once more against the tokenizer.
"""

from __future__ import annotations

from typing import Any

from jinfer.structured_outputs import StructuredOutputsParams, check_grammar
from server.errors import InvalidRequest

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# vLLM extras that only tune how the constraint is enforced; accepted with the constraint they go with
_GUIDED_OPTIONS = {"guided_whitespace_pattern": "whitespace_pattern"}


def _response_format(fmt: Any) -> tuple[dict[str, Any] | None, str]:
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidRequest("'response_format' must be an object with 'type' one of text, json_object, json_schema",
                             "response_format")
    if fmt["type"] == "text":
        return None, "response_format"
    if fmt["type"] == "json_object":
        return {"json_object": True}, "response_format"
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequest("'response_format.json_schema' must be an object with a 'schema'",
                             "response_format.json_schema")
    schema = spec.get("schema", {"type": "object"})  # OpenAI: name and schema; an absent schema is any object
    if not isinstance(schema, dict | bool):
        raise InvalidRequest("'response_format.json_schema.schema' must be a JSON schema (an object)",
                             "response_format.json_schema.schema")
    return {"json": schema}, "response_format.json_schema.schema"


def parse_structured_outputs(body: dict[str, Any]) -> StructuredOutputsParams | None:
    """The request's output constraint (None: free text); InvalidRequest naming the field otherwise."""
    found: list[tuple[dict[str, Any], str]] = []
    if body.get("response_format") is not None:
        spec, name = _response_format(body["response_format"])
        if spec is not None:
            found.append((spec, name))
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise InvalidRequest("'structured_outputs' must be an object", "structured_outputs")
        found.append((dict(so), "structured_outputs"))
    for field, kind in GUIDED.items():
        if body.get(field) is not None:
            found.append(({kind: body[field]}, field))
    if not found:
        return None
    if len(found) > 1:
        raise InvalidRequest(f"only one of response_format, structured_outputs and guided_* may constrain the "
                             f"output; got {', '.join(name for _, name in found)}", found[1][1])
    spec, name = found[0]
    for field, option in _GUIDED_OPTIONS.items():
        if body.get(field) is not None:
            spec[option] = body[field]
    try:
        params = StructuredOutputsParams.of(spec)
        check_grammar(params)
    except ValueError as e:
        raise InvalidRequest(f"'{name}': {e}"[:2000], name) from None
    return params

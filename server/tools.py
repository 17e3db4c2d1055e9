"""Tool calling on /v1/chat/completions: `tools`, `tool_choice`, `parallel_tool_calls`, tool messages.

The tools go to the chat template (its `tools` variable, as transformers passes them). What the model
writes back becomes `message.tool_calls` (and `delta.tool_calls` pieces when streaming) by `tool_choice`:

- "none": plain text (the template still sees the tools, as in vLLM).
- "auto": the model decides; a parser reads its calls out of the text. It needs the server's
  `--enable-auto-tool-choice --tool-call-parser NAME` (vLLM's flags): `hermes` (alias `qwen`: Qwen 2.5 /
  Qwen 3, Hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks after optional
  text) or `llama3_json` (Llama 3.x: `{"name": ..., "parameters": {...}}` objects, `;`-separated).
- "required": the grammar engine forces a JSON array of `{"name": <one of the tools>, "parameters":
  <its schema>}` objects (one only with `parallel_tool_calls: false`), so the output always parses.
- a named function: the grammar forces that function's parameters schema; the output is the arguments.

Parsing is one incremental scanner for all of them (`parse`): it reads as much of the text as is there
and reports each call's name once its string is complete and its arguments as the raw JSON text so far.
A call's arguments only ever grow, so streaming sends the header (`id`, `type`, `name`) of a call once
and then appends argument pieces, the way the official openai client assembles `delta.tool_calls` by
`index`; the streamed pieces concatenate to exactly the non-streaming `arguments`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from jinfer.structured_outputs import StructuredOutputsParams, check_grammar
from server.errors import InvalidRequest

TOOL_PARSERS = {"hermes": "hermes", "qwen": "hermes", "llama3_json": "llama3_json"}
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_WS = " \t\r\n"
_TAG = "<tool_call>"
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class Call:
    name: str | None  # None until the name's string is complete
    arguments: str | None  # raw JSON text of the arguments so far (None: not started)
    complete: bool = False


@dataclass(frozen=True)
class ToolPlan:
    """How to read one request's output: `mode` auto / required / named (tool_choice none: no plan)."""

    mode: str
    parser: str | None = None  # auto: "hermes" or "llama3_json"
    function: str | None = None  # named: the forced function
    parallel: bool = True

    def parse(self, text: str, final: bool) -> tuple[str | None, list[Call]]:
        """(content, calls) read from `text` so far; `final`: the text is complete."""
        if self.mode == "named":
            j = _skip_ws(text, 0)
            end = _scan_value(text, j, final) if j < len(text) else None
            calls = [Call(self.function, text[j:end] if end is not None else text[j:], end is not None)]
            return None, calls
        if self.mode == "required":
            content, calls = None, _parse_array(text, final)
        elif self.parser == "hermes":
            content, calls = _parse_hermes(text, final)
        else:
            content, calls = _parse_llama3(text, final)
        return content, calls if self.parallel else calls[:1]

    def message(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """Non-streaming: the message's content and its `tool_calls`."""
        content, calls = self.parse(text, True)
        tool_calls = [function_call(new_call_id(), c.name, c.arguments or "") for c in calls if c.name is not None]
        if not tool_calls:
            return text if self.mode == "auto" else content, []
        return (content if content and content.strip() else None), tool_calls


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def function_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


class ToolStream:
    """Streaming: turns the growing text of one choice into content deltas and `delta.tool_calls` pieces."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.content_sent = 0
        self.args_sent: list[int] = []  # per call: argument characters sent
        self.ids: list[str] = []

    @property
    def num_calls(self) -> int:
        return len(self.ids)

    def update(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        content, calls = self.plan.parse(text, final)
        if final and not calls and self.plan.mode == "auto":
            content = text  # no call after all: everything held back is text
        content = content or ""
        delta = content[self.content_sent:]
        self.content_sent = max(self.content_sent, len(content))
        pieces = []
        for i, call in enumerate(calls):
            args = call.arguments or ""
            if i == len(self.ids):
                if call.name is None:
                    break
                self.ids.append(new_call_id())
                self.args_sent.append(len(args))
                pieces.append({"index": i, **function_call(self.ids[i], call.name, args)})
            elif len(args) > self.args_sent[i]:
                pieces.append({"index": i, "function": {"arguments": args[self.args_sent[i]:]}})
                self.args_sent[i] = len(args)
        return delta, pieces


# ---- the request side --------------------------------------------------------------------------------


def _check_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list) or not tools:
        raise InvalidRequest("'tools' must be a non-empty list of {'type': 'function', 'function': {...}}", "tools")
    out = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(f, dict):
            raise InvalidRequest(f"'tools[{i}]' must be {{'type': 'function', 'function': {{...}}}}",
                                 f"tools[{i}].function")
        if not isinstance(f.get("name"), str) or not _NAME.match(f["name"]):
            raise InvalidRequest(f"'tools[{i}].function.name' must be 1-64 letters, digits, '_', '-', '.' or ':'",
                                 f"tools[{i}].function.name")
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise InvalidRequest(f"'tools[{i}].function.description' must be a string",
                                 f"tools[{i}].function.description")
        if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
            raise InvalidRequest(f"'tools[{i}].function.parameters' must be a JSON schema object",
                                 f"tools[{i}].function.parameters")
        out.append({"type": "function", "function": f})
    return out


def _required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """vLLM's shape for tool_choice "required": an array of {"name", "parameters"} objects."""
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                               "parameters": _parameters(t)},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def parse_tools(body: dict[str, Any], auto_parser: str | None
                ) -> tuple[list[dict[str, Any]] | None, ToolPlan | None, StructuredOutputsParams | None]:
    """(tools for the chat template, how to read the output, the grammar forcing it), from the request.
    `auto_parser`: the server's tool-call parser when --enable-auto-tool-choice is on, else None."""
    tools = _check_tools(body["tools"]) if body.get("tools") not in (None, []) else None
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise InvalidRequest("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if choice is None:
        choice = "auto" if tools else "none"
    named = None
    if isinstance(choice, dict):
        f = choice.get("function")
        if choice.get("type") != "function" or not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise InvalidRequest("'tool_choice' must be none, auto, required or "
                                 "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
        named = f["name"]
    elif choice not in ("none", "auto", "required"):
        raise InvalidRequest("'tool_choice' must be none, auto, required or "
                             "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
    if choice == "none":
        return tools, None, None
    if tools is None:
        raise InvalidRequest("'tool_choice' needs 'tools'", "tool_choice")
    if choice == "auto":
        if auto_parser is None:
            raise InvalidRequest('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to '
                                 "be set", "tool_choice")
        return tools, ToolPlan("auto", parser=TOOL_PARSERS[auto_parser], parallel=parallel), None
    if named is not None:
        tool = next((t for t in tools if t["function"]["name"] == named), None)
        if tool is None:
            raise InvalidRequest(f"'tool_choice' names function {named!r}, which is not in 'tools'", "tool_choice")
        spec, plan = {"json": _parameters(tool)}, ToolPlan("named", function=named)
    else:
        spec, plan = {"json": _required_schema(tools, parallel)}, ToolPlan("required", parallel=parallel)
    try:
        forced = StructuredOutputsParams.of(spec)
        check_grammar(forced)
    except ValueError as e:
        raise InvalidRequest(f"the tools' parameters schemas do not compile: {e}"[:2000], "tools") from None
    return tools, plan, forced


def history_fields(i: int, m: dict[str, Any]) -> dict[str, Any]:
    """What a tool conversation adds to a message for the template: an assistant's `tool_calls` (arguments
    parsed to objects, as vLLM does for templates that `tojson` them) and a tool result's `tool_call_id`."""
    out: dict[str, Any] = {}
    if m.get("role") == "assistant" and m.get("tool_calls") is not None:
        calls = m["tool_calls"]
        if not isinstance(calls, list):
            raise InvalidRequest(f"'messages[{i}].tool_calls' must be a list", f"messages[{i}].tool_calls")
        out["tool_calls"] = []
        for j, c in enumerate(calls):
            where = f"messages[{i}].tool_calls[{j}]"
            f = c.get("function") if isinstance(c, dict) else None
            if not isinstance(f, dict) or not isinstance(f.get("name"), str):
                raise InvalidRequest(f"'{where}' must be {{'id', 'type': 'function', 'function': {{'name', "
                                     "'arguments'}}}}", where)
            args = f.get("arguments", "{}")
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError:
                    raise InvalidRequest(f"'{where}.function.arguments' is not valid JSON",
                                         f"{where}.function.arguments") from None
            out["tool_calls"].append({"id": c.get("id"), "type": "function",
                                      "function": {"name": f["name"], "arguments": args}})
    if m.get("role") == "tool":
        for name in ("tool_call_id", "name"):
            if m.get(name) is not None:
                if not isinstance(m[name], str):
                    raise InvalidRequest(f"'messages[{i}].{name}' must be a string", f"messages[{i}].{name}")
                out[name] = m[name]
    return out


# ---- incremental JSON scanning -------------------------------------------------------------------------


class _Malformed(ValueError):
    pass


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _scan_string(text: str, i: int) -> int | None:
    """End (exclusive) of the string starting at text[i] == '"', or None if it is not closed yet."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def _scan_value(text: str, i: int, final: bool) -> int | None:
    """End (exclusive) of the JSON value starting at text[i], or None if it is not complete yet."""
    c = text[i]
    if c == '"':
        return _scan_string(text, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(text):
            c = text[j]
            if c == '"':
                end = _scan_string(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i  # number, true, false, null: ends where the next token starts
    while j < len(text) and text[j] not in ",}]" + _WS:
        j += 1
    return j if j < len(text) or final else None


def _scan_object(text: str, i: int, final: bool) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """Fields (key -> value span; end None: still open) of the object at text[i] == '{', and its end."""
    fields: dict[str, tuple[int, int | None]] = {}
    j = _skip_ws(text, i + 1)
    if j < len(text) and text[j] == "}":
        return fields, j + 1
    while j < len(text):
        if text[j] != '"':
            raise _Malformed(text[j])
        end = _scan_string(text, j)
        if end is None:
            return fields, None
        try:
            key = json.loads(text[j:end])
        except json.JSONDecodeError as e:
            raise _Malformed(str(e)) from None
        j = _skip_ws(text, end)
        if j >= len(text):
            return fields, None
        if text[j] != ":":
            raise _Malformed(text[j])
        j = _skip_ws(text, j + 1)
        if j >= len(text):
            return fields, None
        end = _scan_value(text, j, final)
        fields[key] = (j, end)
        if end is None:
            return fields, None
        j = _skip_ws(text, end)
        if j >= len(text):
            return fields, None
        if text[j] == "}":
            return fields, j + 1
        if text[j] != ",":
            raise _Malformed(text[j])
        j = _skip_ws(text, j + 1)
    return fields, None


def _call(text: str, fields: dict[str, tuple[int, int | None]]) -> Call:
    name = None
    if "name" in fields and fields["name"][1] is not None:
        start, end = fields["name"]
        value = json.loads(text[start:end]) if text[start] == '"' else None
        name = value if isinstance(value, str) else None
    for key in ("arguments", "parameters"):
        if key in fields:
            start, end = fields[key]
            return Call(name, text[start:end] if end is not None else text[start:], end is not None)
    return Call(name, None)


def _objects(text: str, j: int, final: bool, sep: str | None) -> tuple[list[Call], int | None]:
    """Calls from consecutive objects starting at text[j], separated by `sep` (None: one object); stops at
    anything else. Also the end of the last complete object (None if none is)."""
    calls, last_end = [], None
    while j < len(text) and text[j] == "{":
        try:
            fields, end = _scan_object(text, j, final)
        except _Malformed:
            break
        calls.append(_call(text, fields))
        if end is None:
            break
        last_end = end
        j = _skip_ws(text, end)
        if sep is not None and j < len(text) and text[j] == sep:
            j = _skip_ws(text, j + 1)
        else:
            break
    return calls, last_end


def _parse_array(text: str, final: bool) -> list[Call]:
    j = _skip_ws(text, 0)
    if j >= len(text) or text[j] != "[":
        return []
    return _objects(text, _skip_ws(text, j + 1), final, ",")[0]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (held back while streaming)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _parse_hermes(text: str, final: bool) -> tuple[str, list[Call]]:
    start = text.find(_TAG)
    if start < 0:
        return text[:len(text) - (0 if final else _partial_suffix(text, _TAG))], []
    calls, pos = [], start
    while pos >= 0:
        found, end = _objects(text, _skip_ws(text, pos + len(_TAG)), final, None)  # one object per block
        calls += found
        if end is None:
            break
        pos = text.find(_TAG, end)
    return text[:start], calls


def _parse_llama3(text: str, final: bool) -> tuple[str, list[Call]]:
    j = _skip_ws(text, 0)
    if text.startswith(_PYTHON_TAG, j):
        j = _skip_ws(text, j + len(_PYTHON_TAG))
    if j >= len(text) or (not final and _PYTHON_TAG.startswith(text[j:])):
        return (text if final else ""), []  # nothing but whitespace (or part of the tag) yet: it may become a call
    if text[j] != "{":
        return text, []
    calls = _objects(text, j, final, ";")[0]
    if not calls or (calls[0].name is None and (final or calls[0].complete)):
        return (text if final or (calls and calls[0].complete) else ""), []  # a JSON object, not a call
    return "", calls

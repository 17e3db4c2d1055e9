"""Tool calling on /v1/chat/completions: `tools`, `tool_choice`, `parallel_tool_calls`, tool messages.

The tools go to the chat template (its `tools` variable, as transformers passes them). What the model
writes back becomes `message.tool_calls` (and `delta.tool_calls` pieces when streaming) by `tool_choice`:

- "none": plain text (the template still sees the tools, as in vLLM).
- "auto": the model decides; a parser reads its calls out of the text. It needs the server's
  `--enable-auto-tool-choice --tool-call-parser NAME` (vLLM's flags): hermes (alias qwen), llama3_json,
  mistral, pythonic, kimi_k2, deepseek_v3 or deepseek_v31 (server/tool_parsers.py: the formats).
- "required": the grammar engine forces a JSON array of `{"name": <one of the tools>, "parameters":
  <its schema>}` objects (one only with `parallel_tool_calls: false`), so the output always parses.
- a named function: the grammar forces that function's parameters schema; the output is the arguments.

Parsing is incremental for all of them (`parse`, server/tool_parsers.py): it reads as much of the text as is
there and reports each call's name once its string is complete and its arguments as the raw JSON text so far.
A call's arguments only ever grow, so streaming sends the header (`id`, `type`, `name`) of a call once
and then appends argument pieces, the way the official openai client assembles `delta.tool_calls` by
`index`; the streamed pieces concatenate to exactly the non-streaming `arguments`.
"""

from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from dataclasses import dataclass
from typing import Any

from jinfer.structured_outputs import StructuredOutputsParams, check_grammar
from server.errors import InvalidRequest
from server.tool_parsers import PARSERS, Call, parse_array, scan_value, skip_ws

TOOL_PARSERS = {"hermes": "hermes", "qwen": "hermes", "llama3_json": "llama3_json", "mistral": "mistral",
                "pythonic": "pythonic", "kimi_k2": "kimi_k2", "deepseek_v3": "deepseek_v3",
                "deepseek_v31": "deepseek_v31"}
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_ALNUM = string.ascii_letters + string.digits


@dataclass(frozen=True)
class ToolPlan:
    """How to read one request's output: `mode` auto / required / named (tool_choice none: no plan)."""

    mode: str
    parser: str | None = None  # auto: a key of tool_parsers.PARSERS
    function: str | None = None  # named: the forced function
    parallel: bool = True

    def parse(self, text: str, final: bool) -> tuple[str | None, list[Call]]:
        """(content, calls) read from `text` so far; `final`: the text is complete."""
        if self.mode == "named":
            j = skip_ws(text, 0)
            end = scan_value(text, j, final) if j < len(text) else None
            calls = [Call(self.function, text[j:end] if end is not None else text[j:], end is not None)]
            return None, calls
        if self.mode == "required":
            content, calls = None, parse_array(text, final)
        else:
            content, calls = PARSERS[self.parser](text, final)
        return content, calls if self.parallel else calls[:1]

    def new_call_id(self) -> str:
        return new_call_id(self.parser)

    def message(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """Non-streaming: the message's content and its `tool_calls`."""
        content, calls = self.parse(text, True)
        tool_calls = [function_call(c.id or self.new_call_id(), c.name, c.arguments or "") for c in calls
                      if c.name is not None]
        if not tool_calls:
            return text if self.mode == "auto" else content, []
        return (content if content and content.strip() else None), tool_calls


def new_call_id(parser: str | None = None) -> str:
    if parser == "mistral":  # Mistral's chat templates refuse a call id in the history that is not 9 letters/digits
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
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
                self.ids.append(call.id or self.plan.new_call_id())
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

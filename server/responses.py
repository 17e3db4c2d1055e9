"""`POST /v1/responses` (OpenAI's Responses API, as vLLM serves it), `GET|DELETE /v1/responses/{id}`.

A translation onto the chat-completion machinery: the request becomes a chat body (input items -> messages,
`instructions` -> a system message, `max_output_tokens`, Responses-shaped function tools, `text.format`) that
`parse_chat` checks and the chat template renders; `Generation` runs it; its chat answer (or, streaming, its
deltas through `ToolStream`) becomes `output` items: a `message` with `output_text`, `function_call`s.

`store` (default true, as OpenAI) keeps the response and its conversation in a bounded in-process store, so
that `previous_response_id` continues it (the earlier input and output, not its `instructions`) and
`GET /v1/responses/{id}` returns it. A restart forgets them; an unknown id is a 404.
"""

from __future__ import annotations

import json
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from server import http_common as http
from server.errors import InvalidRequest
from server.generation import Generation
from server.responses_stream import call_item, message_item, new_id, response_events, status_of
from server.validation import GenerationRequest, ServingContext, parse_chat

STORE_SIZE = 1024  # responses kept for previous_response_id / GET (oldest dropped first)
_TEXT_PARTS = ("input_text", "output_text", "text")
# Fields passed to the chat body as they are (sampling: vLLM's extras beside OpenAI's two).
_PASSED = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "stop", "stop_token_ids", "min_tokens", "ignore_eos", "skip_special_tokens",
           "include_stop_str_in_output", "logit_bias", "parallel_tool_calls", "stream")
# Fields whose feature is not served here: a 400 when set, rather than a silently different answer.
_UNSUPPORTED = {"background": (None, False), "conversation": (None,), "prompt": (None,),
                "max_tool_calls": (None,), "top_logprobs": (None, 0)}


@dataclass
class StoredResponse:
    body: dict[str, Any]  # the response object
    messages: list[dict[str, Any]]  # its conversation in chat form, input and output, without its instructions


class ResponseStore:
    """The last STORE_SIZE stored responses of this process."""

    def __init__(self, size: int = STORE_SIZE):
        self.size, self._items = size, OrderedDict()

    def get(self, response_id: str) -> StoredResponse | None:
        return self._items.get(response_id)

    def put(self, response_id: str, item: StoredResponse) -> None:
        self._items[response_id] = item
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None


@dataclass
class ResponsePlan:
    """One /v1/responses request: the chat request it became, and what its response object echoes."""

    id: str
    req: GenerationRequest
    echo: dict[str, Any]  # request fields the response object repeats
    messages: list[dict[str, Any]]  # the conversation so far (stored with the output), without instructions
    store: bool = True
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": error, "incomplete_details": incomplete, **self.echo, "output": output,
                "usage": None if usage is None else _usage(usage), "store": self.store}

    def finish(self, store: ResponseStore, body: dict[str, Any]) -> None:
        """Keep a finished response (when asked to) with its conversation, for previous_response_id."""
        if self.store and body["status"] in ("completed", "incomplete"):
            store.put(self.id, StoredResponse(body, self.messages + _assistant_messages(body["output"])))


def _usage(u: dict[str, Any]) -> dict[str, Any]:
    """Chat usage -> Responses usage."""
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
            "total_tokens": u["total_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


# ---- request -> chat body ----------------------------------------------------------------------------


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (images and files are not served here)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"'{where}' must be a string or a list of input_text parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal":  # an earlier assistant turn's refusal: no text for the template
            continue
        else:
            raise InvalidRequest(f"'{where}[{j}]' must be an input_text part (jinfer serves text models; got "
                                 f"{kind!r})", f"{where}[{j}]")
    return "".join(texts)


def _string(item: dict[str, Any], name: str, where: str) -> str:
    if not isinstance(item.get(name), str):
        raise InvalidRequest(f"'{where}.{name}' must be a string", f"{where}.{name}", None if name in item
                             else "missing_required_parameter")
    return item[name]


def input_messages(value: Any) -> list[dict[str, Any]]:
    """`input` -> chat messages: a string is one user message; items are messages (role + content),
    function_call (joined to the assistant turn before it) and function_call_output (a tool message)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise InvalidRequest("'input' must be a string or a list of input items", "input")
    msgs: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"'{where}' must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequest(f"'{where}.role' must be one of user, assistant, system, developer; got "
                                     f"{role!r}"[:300], f"{where}.role")
            msgs.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            args = _string(item, "arguments", where)
            try:
                json.loads(args or "{}")
            except json.JSONDecodeError:
                raise InvalidRequest(f"'{where}.arguments' is not valid JSON", f"{where}.arguments") from None
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": args}}
            if msgs and msgs[-1]["role"] == "assistant":  # the calls of one turn: one assistant message
                msgs[-1].setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            msgs.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                         "content": _text(output, f"{where}.output")})
        elif kind == "reasoning":  # an earlier turn's reasoning: not sent back to the model (as vLLM)
            continue
        else:
            raise InvalidRequest(f"'{where}.type' {kind!r} is not supported: send message, function_call or "
                                 "function_call_output items"[:300], f"{where}.type", "unsupported_parameter")
    return msgs


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    """Responses-shaped function tools (name, description, parameters at the top) -> chat's."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise InvalidRequest("'tools' must be a list of function tools", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise InvalidRequest(f"'tools[{i}]': only function tools are supported here, got type {kind!r}"[:300],
                                 f"tools[{i}]", "unsupported_parameter")
        f = t["function"] if isinstance(t.get("function"), dict) else {  # (chat's shape accepted too)
            k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        out.append({"type": "function", "function": f})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice  # none / auto / required (and anything else: parse_tools' 400)


def _response_format(text: Any) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """`text.format` -> chat's response_format (None: free text), and the `text` the response echoes."""
    if text is None:
        return None, {"format": {"type": "text"}}
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(text, dict) or fmt is not None and not isinstance(fmt, dict):
        raise InvalidRequest("'text' must be an object {'format': {'type': ...}}", "text")
    if fmt is None or fmt.get("type") == "text":
        return None, {"format": {"type": "text"}}
    if fmt.get("type") == "json_schema":
        spec = {"name": fmt.get("name"), "schema": fmt.get("schema", {"type": "object"}), "strict": fmt.get("strict")}
        return {"type": "json_schema", "json_schema": spec}, {"format": fmt}
    return fmt, {"format": fmt}  # json_object (anything else: the structured-outputs check's 400)


def _param(name: str | None) -> str | None:
    """A chat-body field name in an error -> the Responses request's own."""
    if name is None:
        return None
    if name.startswith("messages"):
        return "input"
    if name in ("max_completion_tokens", "max_tokens"):
        return "max_output_tokens"
    if name.startswith("response_format"):
        return "text.format" + (".schema" if name.endswith(".schema") else "")
    return name.replace(".function", "") if name.startswith("tools[") else name


def _echoed(body: dict[str, Any]) -> None:
    """Check the fields the response object repeats (JSON has no NaN / Infinity: an echoed one would fail)."""
    metadata, user, truncation = body.get("metadata"), body.get("user"), body.get("truncation")
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise InvalidRequest("'metadata' must be an object of strings", "metadata")
    if user is not None and not isinstance(user, str):
        raise InvalidRequest("'user' must be a string", "user")
    if truncation not in (None, "auto", "disabled"):  # (auto: nothing is cut; a long input is a 400)
        raise InvalidRequest("'truncation' must be auto or disabled", "truncation")
    for name in ("tools", "tool_choice", "text"):
        if not _finite(body.get(name)):
            raise InvalidRequest(f"'{name}' holds a number that is not finite", name)


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    return all(_finite(v) for v in value) if isinstance(value, list) else True


def parse_responses(body: Any, ctx: ServingContext, store: ResponseStore) -> ResponsePlan:
    """A /v1/responses body -> the chat request it runs as, or InvalidRequest naming the Responses field
    (404 for an unknown previous_response_id)."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object", None)
    for name, allowed in _UNSUPPORTED.items():
        if body.get(name) not in allowed:
            raise InvalidRequest(f"'{name}' is not supported by this server", name, "unsupported_parameter")
    _echoed(body)
    if "input" not in body or body["input"] is None:
        raise InvalidRequest("'input' is required", "input", "missing_required_parameter")
    history: list[dict[str, Any]] = []
    prev_id = body.get("previous_response_id")
    if prev_id is not None:
        prev = store.get(prev_id) if isinstance(prev_id, str) else None
        if prev is None:
            raise InvalidRequest(f"Previous response with id {str(prev_id)[:100]!r} not found.",
                                 "previous_response_id", "previous_response_not_found", 404)
        history = prev.messages
    messages = history + input_messages(body["input"])
    if not messages:
        raise InvalidRequest("'input' must not be empty", "input")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequest("'instructions' must be a string", "instructions")
    store_it = body.get("store", True)
    if not isinstance(store_it, bool | None):
        raise InvalidRequest("'store' must be a boolean", "store")
    response_format, text = _response_format(body.get("text"))
    chat: dict[str, Any] = {name: body[name] for name in _PASSED if body.get(name) is not None}
    chat["messages"] = ([{"role": "system", "content": instructions}] if instructions else []) + messages
    renamed = {"model": body.get("model"), "max_completion_tokens": body.get("max_output_tokens"),
               "tools": _tools(body.get("tools")), "tool_choice": _tool_choice(body.get("tool_choice")),
               "response_format": response_format}
    chat |= {k: v for k, v in renamed.items() if v is not None}
    try:
        req = parse_chat(chat, ctx)
    except InvalidRequest as e:
        raise InvalidRequest(e.message, _param(e.param), e.code, e.status, e.type, e.headers) from None
    req.param_names = {"prompt": "input", "max_tokens": "max_output_tokens"}  # engine refusals, in our names
    tools = body.get("tools") or []
    echo = {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"), "model": req.model,
            "metadata": body.get("metadata"), "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
            "previous_response_id": prev_id, "reasoning": None, "temperature": req.params.temperature,
            "text": text, "tool_choice": body.get("tool_choice") or ("auto" if tools else "none"), "tools": tools,
            "top_p": req.params.top_p, "truncation": body.get("truncation") or "disabled", "user": body.get("user")}
    return ResponsePlan(new_id("resp"), req, echo, messages, store_it is not False)


# ---- chat answer -> output items ------------------------------------------------------------------------


def output_items(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat choice (non-streaming) -> the response's output: its text as a message (unless it is only tool
    calls), then one function_call item per call."""
    msg, status = choice["message"], "incomplete" if choice["finish_reason"] == "length" else "completed"
    calls = msg.get("tool_calls") or []
    items = [message_item(new_id("msg"), msg.get("content") or "", status)] if msg.get("content") or not calls else []
    return items + [call_item(new_id("fc"), new_id("call"), c["function"]["name"], c["function"]["arguments"], status)
                    for c in calls]


def _assistant_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The output items as the assistant turn of a stored conversation."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                       "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]


# ---- HTTP ---------------------------------------------------------------------------------------------------


def _store(request: Request) -> ResponseStore:
    state = request.app.state
    if not hasattr(state, "responses"):
        state.responses = ResponseStore()
    return state.responses


async def create(request: Request) -> Response:
    state, store = http._state(request), _store(request)
    try:
        http._check_auth(request, state)
        plan = parse_responses(await http._json_body(request), state.ctx, store)
        release = http._admit(state, 1)
    except InvalidRequest as e:
        state.metrics.requests.labels("responses", http._STATUS_BY_CODE.get(e.code, "invalid")).inc()
        return http._error(e)
    gen = Generation(state, plan.req, release)
    gen.endpoint, gen.id = "responses", plan.id  # (the engine request keeps the id it was sent with)
    try:  # counted and logged by gen.close() from here on
        await http._until_disconnect(request, gen.start())
    except InvalidRequest as e:
        return http._error(e)
    except http.ClientDisconnected:
        return Response(status_code=499)
    if plan.req.stream:
        return StreamingResponse(response_events(gen, plan, store), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        chat = await http._until_disconnect(request, gen.collect())
    except InvalidRequest as e:
        return http._error(e)
    except http.ClientDisconnected:
        return Response(status_code=499)
    choice = chat["choices"][0]
    body = plan.response(status_of(choice["finish_reason"]), output_items(choice), chat["usage"])
    plan.finish(store, body)
    return JSONResponse(body)


async def stored(request: Request) -> Response:
    """GET /v1/responses/{id}: a stored response; DELETE forgets it."""
    state, store = http._state(request), _store(request)
    response_id = request.path_params["response_id"]
    try:
        http._check_auth(request, state)
        item = store.get(response_id)
        if item is None:
            raise InvalidRequest(f"Response with id {response_id[:100]!r} not found.", "response_id", "not_found", 404)
    except InvalidRequest as e:
        return http._error(e)
    if request.method == "DELETE":
        store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})
    return JSONResponse(item.body)


def routes() -> list[Route]:
    return [Route("/v1/responses", create, methods=["POST"]),
            Route("/v1/responses/{response_id}", stored, methods=["GET", "DELETE"])]

"""The SSE event stream of a streamed /v1/responses request, in the order the official openai client's
stream state machine accepts (it checks that each item's `added` and `done` carry the same identity):

    response.created, response.in_progress,
    per message:  output_item.added, content_part.added, output_text.delta..., output_text.done,
                  content_part.done, output_item.done
    per call:     output_item.added, function_call_arguments.delta..., function_call_arguments.done,
                  output_item.done
    response.completed   (status "incomplete" when max_output_tokens cut it: as vLLM, so that the
                          client's `get_final_response()` still has its final event)

Each is `event: <type>` + `data: {...}` with a rising `sequence_number`. A failure after the stream began is
an `error` event and `response.failed`. The text is read with the chat path's `ToolStream`, so the streamed
items are the non-streaming ones, piece by piece.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from server.generation import Generation, to_http_error
from server.tools import ToolStream

# ---- output items (the non-streaming response builds the same) ------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    """An assistant message; while it is in progress its content part comes in events of its own."""
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [output_text(text)] if status != "in_progress" else []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


# ---- events ----------------------------------------------------------------------------------------------


class _Events:
    """Builds the events and keeps the output items as they open and close."""

    def __init__(self) -> None:
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.text: str | None = None  # the open message's text (None: no message open)
        self.call: int | None = None  # output index of the open function call

    def event(self, type: str, **fields: Any) -> str:
        data = {"type": type, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {type}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def _add(self, item: dict[str, Any]) -> list[str]:
        self.output.append(item)
        return [self.event("response.output_item.added", output_index=len(self.output) - 1, item=item)]

    def text_delta(self, text: str) -> list[str]:
        out = []
        if self.text is None:
            out += self.close_call()
            out += self._add(message_item(new_id("msg"), "", "in_progress"))
            out.append(self._part("response.content_part.added", ""))
            self.text = ""
        if text:
            self.text += text
            out.append(self._text_event("response.output_text.delta", delta=text))
        return out

    def _part(self, type: str, text: str) -> str:
        return self.event(type, item_id=self.output[-1]["id"], output_index=len(self.output) - 1, content_index=0,
                          part=output_text(text))

    def _text_event(self, type: str, **fields: Any) -> str:
        return self.event(type, item_id=self.output[-1]["id"], output_index=len(self.output) - 1, content_index=0,
                          logprobs=[], **fields)

    def close_text(self, status: str) -> list[str]:
        if self.text is None:
            return []
        text, self.text = self.text, None
        item = self.output[-1] = message_item(self.output[-1]["id"], text, status)
        return [self._text_event("response.output_text.done", text=text),
                self._part("response.content_part.done", text),
                self.event("response.output_item.done", output_index=len(self.output) - 1, item=item)]

    def call_piece(self, piece: dict[str, Any]) -> list[str]:
        """One `delta.tool_calls` piece of ToolStream: a new call (its name, some arguments) or more arguments."""
        out = []
        if "id" in piece:  # a new call: what was open before it is complete
            out += self.close_text("completed") + self.close_call()
            out += self._add(call_item(new_id("fc"), new_id("call"), piece["function"]["name"], "", "in_progress"))
            self.call = len(self.output) - 1
        args = piece["function"].get("arguments") or ""
        if args and self.call is not None:
            self.output[self.call]["arguments"] += args
            out.append(self.event("response.function_call_arguments.delta", item_id=self.output[self.call]["id"],
                                  output_index=self.call, delta=args))
        return out

    def close_call(self, status: str = "completed") -> list[str]:
        if self.call is None:
            return []
        index, self.call = self.call, None
        item = self.output[index] = {**self.output[index], "status": status}
        return [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                           name=item["name"], arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=index, item=item)]


async def response_events(gen: Generation, plan: Any, store: Any) -> AsyncIterator[str]:
    """(plan: server.responses.ResponsePlan, store: its ResponseStore; not imported: that module imports this one)"""
    ev, status, finish = _Events(), "error", None
    tools = ToolStream(plan.req.tools) if plan.req.tools is not None else None
    try:
        start = plan.response("in_progress", [])
        yield ev.event("response.created", response=start)
        yield ev.event("response.in_progress", response=start)
        async for chunk in gen.chunks():
            lines = []
            for c, d in chunk:
                text, pieces = tools.update(c.text, d.finished) if tools is not None else (d.new_text, [])
                lines += (ev.text_delta(text) if text else []) + [e for p in pieces for e in ev.call_piece(p)]
                if d.finished:
                    finish = d.finish_reason
            if lines:
                yield "".join(lines)
        final = status_of(finish)
        if not ev.output:  # nothing generated at all: still one (empty) message, as without streaming
            for line in ev.text_delta(""):
                yield line
        for line in ev.close_text(final) + ev.close_call(final):
            yield line
        body = plan.response(final, ev.output, gen.usage())
        plan.finish(store, body)
        yield ev.event("response.completed", response=body)
        status = "success"
    except (asyncio.CancelledError, GeneratorExit):
        status = "aborted"  # the client went away: close() aborts the engine request
        raise
    except Exception as e:
        err = to_http_error(e, plan.req.param_names)
        yield ev.event("error", code=err.code, message=err.message, param=err.param)
        yield ev.event("response.failed", response=plan.response(
            "failed", ev.output, gen.usage(), {"code": "server_error", "message": err.message}))
    finally:
        await gen.close(status)

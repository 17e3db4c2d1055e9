"""One OpenAI generation request on its way through the engine: start (the engine accepted it),
the deltas (kept per choice, timed for the metrics), then a JSON body or an SSE stream, and a summary for
the request's access line (server/access_log.py) when it ends.

Deltas come a list at a time: all that arrived since the request's task last ran. A stream sends each list's
events in one write, so a server that falls behind the engine catches up with fewer, larger writes."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from jinfer.client import EngineDeadError, RequestError
from jinfer.errors import InvalidParam
from jinfer.outputs import EngineOutput
from server import schemas
from server.errors import InvalidRequest, from_invalid_param
from server.reasoning import ReasoningStream, split
from server.tools import ToolStream
from server.validation import GenerationRequest

log = logging.getLogger("jinfer.server")

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode  # json.dumps(x, ...) without its set-up
_SLOT = "\0"  # a placeholder in the event templates below (JSON text has it only as the string "\u0000")


def to_http_error(e: BaseException, param_names: Mapping[str, str] | None = None) -> InvalidRequest:
    """The HTTP error for what a generation raised; `param_names`: the request's names of the engine's fields."""
    if isinstance(e, InvalidRequest):
        return e
    if isinstance(e, InvalidParam):  # refused by the engine, naming the field
        return from_invalid_param(e, param_names)
    if isinstance(e, EngineDeadError):
        return InvalidRequest(f"the engine is unavailable: {e}", None, "engine_unavailable", 503, "server_error")
    if isinstance(e, RequestError):
        return InvalidRequest(f"generation failed: {e}", None, "internal_error", 500, "server_error")
    if isinstance(e, ValueError):  # refused without a field named
        return InvalidRequest(str(e), None)
    log.exception("unexpected error", exc_info=e)
    return InvalidRequest(f"internal error: {type(e).__name__}: {e}", None, "internal_error", 500, "server_error")


@dataclass
class _Choice:
    index: int
    prompt_index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    last_time: float | None = None
    streamed: bool = False
    prompt_logprobs: list[dict[int, float] | None] | None = None  # echo + logprobs, or prompt_logprobs
    prompt_logprob_ranks: list[int | None] | None = None


class Generation:
    def __init__(self, state: Any, req: GenerationRequest, release: Callable[[], None]):
        self.state, self.req, self._release = state, req, release
        self.endpoint = "chat" if req.chat else "completions"
        self.id = f"{'chatcmpl' if req.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.t0 = time.monotonic()
        self.t_first: float | None = None
        n = req.params.n
        self.choices = [_Choice(p * n + i, p) for p in range(len(req.prompts)) for i in range(n)]
        self.num_cached = 0
        self._agen = state.client.stream_batch(req.prompts, req.params, self.id)
        self._buffer: list[tuple[_Choice, EngineOutput]] = []  # recorded by start(), not yet sent
        # a streamed chunk without usage: this envelope around its choices
        envelope = _dumps(schemas.chunk(req.chat, self.id, self.created, req.model, [_SLOT], None, req.include_usage))
        self._head, _, self._tail = envelope.partition(_dumps([_SLOT]))
        self._text_templates: dict[int, tuple[str, str]] = {}  # choice index -> a text event's ends (_text_event)
        self._closed = False
        self.summary: dict[str, Any] = {"id": self.id}  # filled in by close()

    async def start(self) -> None:
        """Wait until the engine took every prompt (its first delta), so that a refusal is still a 400."""
        waiting = set(range(len(self.req.prompts)))
        try:
            while waiting:
                chunk = await anext(self._agen)
                self._buffer += self._record(chunk)
                waiting.difference_update(prompt_index for prompt_index, _ in chunk)
        except StopAsyncIteration:
            pass
        except BaseException as e:
            await self.close("invalid" if isinstance(e, ValueError) else "error" if isinstance(e, Exception)
                             else "aborted")
            raise to_http_error(e, self.req.param_names) if isinstance(e, Exception) else e from None

    async def chunks(self) -> AsyncIterator[list[tuple[_Choice, EngineOutput]]]:
        """The deltas with their choices, a list at a time (see the module doc)."""
        if self._buffer:
            chunk, self._buffer = self._buffer, []
            yield chunk
        async for chunk in self._agen:
            yield self._record(chunk)

    def _record(self, chunk: list[tuple[int, EngineOutput]]) -> list[tuple[_Choice, EngineOutput]]:
        now, metrics, n = time.monotonic(), self.state.metrics, self.req.params.n
        out, num_tokens = [], 0
        for prompt_index, d in chunk:
            c = self.choices[prompt_index * n + d.index]
            if d.new_token_ids:
                if self.t_first is None:
                    self.t_first = now
                    metrics.ttft.observe(now - self.t0)
                if c.last_time is not None:
                    metrics.itl.observe((now - c.last_time) / len(d.new_token_ids))
                c.last_time = now
                num_tokens += len(d.new_token_ids)
            if d.prompt_logprobs is not None:
                c.prompt_logprobs, c.prompt_logprob_ranks = d.prompt_logprobs, d.prompt_logprob_ranks
            if self.req.echo_only:  # the one token generated for an echo of max_tokens 0 is not part of the answer
                d.new_text, d.new_token_ids, d.new_logprobs = "", [], None
                if d.finished:
                    d.finish_reason, d.stop_reason = "length", None
            c.text += d.new_text
            c.token_ids += d.new_token_ids
            if d.new_logprobs:
                c.logprobs += d.new_logprobs
            if d.finished:
                c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
            self.num_cached = max(self.num_cached, d.num_cached_tokens)
            out.append((c, d))
        if num_tokens:
            metrics.generation_tokens.inc(num_tokens)
        return out

    # ---- end -----------------------------------------------------------------------------------

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.req.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    def usage(self) -> dict[str, Any]:
        return schemas.usage(self.prompt_tokens, self.completion_tokens, self.num_cached)

    async def close(self, status: str) -> None:
        """Abort what still runs, free the admission slot, count the request and sum it up. Idempotent."""
        if self._closed:
            return
        self._closed = True
        await self._agen.aclose()
        self._release()
        m, now = self.state.metrics, time.monotonic()
        m.requests.labels(self.endpoint, status).inc()
        m.count_finished(status, self.choices[0].finish_reason)
        m.prompt_tokens.inc(self.prompt_tokens)
        if status == "success":
            m.e2e.observe(now - self.t0)
        out_len = max((len(c.token_ids) for c in self.choices), default=0)
        ttft = None if self.t_first is None else self.t_first - self.t0
        tpot = (now - self.t_first) / (out_len - 1) if self.t_first is not None and out_len > 1 else None
        finish = [c.finish_reason for c in self.choices]
        self.summary = {  # for the request's access line (server/access_log.py)
            "id": self.id, "status": None if status == "success" else status,
            "prompt_tokens": self.prompt_tokens, "output_tokens": self.completion_tokens,
            "cached_tokens": self.num_cached or None,
            "ttft_ms": None if ttft is None else round(ttft * 1e3, 1),
            "tpot_ms": None if tpot is None else round(tpot * 1e3, 2),
            "finish": ",".join(map(str, finish)) if any(finish) else None,
        }

    # ---- non-streaming -------------------------------------------------------------------------

    async def collect(self) -> dict[str, Any]:
        try:
            async for _ in self.chunks():
                pass
        except BaseException as e:
            await self.close("aborted" if isinstance(e, asyncio.CancelledError) else "error")
            raise to_http_error(e, self.req.param_names) if isinstance(e, Exception) else e from None
        await self.close("success")
        r, tok = self.req, self.state.tokenizer
        choices = []
        for c in self.choices:
            if r.chat:
                lp = None if r.top_logprobs is None else schemas.chat_logprobs(tok, c.token_ids, c.logprobs,
                                                                                r.top_logprobs)
                content, calls, finish = c.text, [], c.finish_reason
                if r.reasoning is not None:  # <think>...</think> apart (server/reasoning.py)
                    reasoning, content = split(r.reasoning, c.text)
                if r.tools is not None and content is not None:  # tool calls: read from the content (server/tools.py)
                    content, calls = r.tools.message(content)
                    finish = "tool_calls" if calls and finish == "stop" else finish
                choices.append(schemas.chat_choice(c.index, content, lp, finish, c.stop_reason, calls))
                if r.reasoning is not None:
                    choices[-1]["message"]["reasoning_content"] = reasoning
            else:
                prefix = r.prompt_texts[c.prompt_index] if r.echo else ""
                lp = self._completion_logprobs(c, c.token_ids, c.logprobs, echo=r.echo, offset=0)
                choices.append(schemas.completion_choice(c.index, prefix + c.text, lp, c.finish_reason,
                                                         c.stop_reason))
        body = schemas.response(r.chat, self.id, self.created, r.model, choices, self.usage())
        if r.prompt_logprobs is not None:  # vLLM's places: on each completion choice, once on a chat response
            plp = [schemas.prompt_logprobs(tok, r.prompts[c.prompt_index], c.prompt_logprobs, c.prompt_logprob_ranks)
                   for c in self.choices]
            if r.chat:
                body["prompt_logprobs"] = plp[0]
            else:
                for choice, entry in zip(choices, plp, strict=True):
                    choice["prompt_logprobs"] = entry
        return body

    def _completion_logprobs(self, c: _Choice, ids: list[int], lps: list, *, echo: bool, offset: int):
        if self.req.top_logprobs is None:
            return None
        lps = list(lps)
        if echo:  # the prompt tokens' logprobs come from the engine's prompt_logprobs (the first one is None)
            prompt = self.req.prompts[c.prompt_index]
            ids, lps = prompt + ids, (c.prompt_logprobs or [None] * len(prompt)) + lps
        return schemas.completion_logprobs(self.state.tokenizer, ids, lps, offset)

    # ---- streaming -----------------------------------------------------------------------------

    def _event(self, choices: list[dict], usage: dict | None = None) -> str:
        if usage is None:
            return f"data: {self._head}{_dumps(choices)}{self._tail}\n\n"
        r = self.req
        body = schemas.chunk(r.chat, self.id, self.created, r.model, choices, usage, r.include_usage)
        return f"data: {_dumps(body)}\n\n"

    def _text_event(self, index: int, text: str) -> str:
        """`_event` of choice `index`'s text piece without logprobs: its template around the text's JSON."""
        ends = self._text_templates.get(index)
        if ends is None:
            choice = (schemas.chat_delta(index, {"content": _SLOT}) if self.req.chat
                      else schemas.completion_choice(index, _SLOT, None, None))
            head, _, tail = self._event([choice]).partition(_dumps(_SLOT))
            ends = self._text_templates[index] = head, tail
        return f"{ends[0]}{_dumps(text)}{ends[1]}"

    def _delta_events(self, c: _Choice, d: EngineOutput, tool_streams: dict[int, ToolStream],
                      reasoning_streams: dict[int, ReasoningStream]) -> list[str]:
        """The SSE events of one delta."""
        r, tok, out = self.req, self.state.tokenizer, []
        text, echo = d.new_text, r.echo and not c.streamed
        offset = len(c.text) - len(d.new_text) + (len(r.prompt_texts[c.prompt_index]) if r.echo else 0)
        if echo:
            text, offset = r.prompt_texts[c.prompt_index] + text, 0
        c.streamed = True
        if r.chat:
            lp = None if r.top_logprobs is None or not d.new_logprobs else schemas.chat_logprobs(
                tok, d.new_token_ids, d.new_logprobs, r.top_logprobs)
            delta, finish, think, content = {"content": text}, d.finish_reason, "", c.text
            if r.reasoning is not None:  # reasoning_content pieces, then content (server/reasoning.py)
                reasoner = reasoning_streams.setdefault(c.index, ReasoningStream(r.reasoning))
                think, text, content = reasoner.update(c.text, d.finished)
                delta = {"reasoning_content": think} if think else {"content": text}
                if think and text:
                    delta["content"] = text
            if r.tools is not None:  # tool calling: content and delta.tool_calls pieces (server/tools.py)
                stream = tool_streams.setdefault(c.index, ToolStream(r.tools))
                text, pieces = stream.update(content, d.finished)
                delta = {**({"reasoning_content": think} if think else {}),
                         **({"content": text} if text else {}), **({"tool_calls": pieces} if pieces else {})}
                finish = "tool_calls" if stream.num_calls and finish == "stop" else finish
            if text or think or lp or "tool_calls" in delta:
                plain = lp is None and r.reasoning is None and r.tools is None  # delta is {"content": text}
                out.append(self._text_event(c.index, text) if plain
                           else self._event([schemas.chat_delta(c.index, delta, lp)]))
            if d.finished:
                out.append(self._event([schemas.chat_delta(c.index, {}, None, finish, d.stop_reason)]))
        else:
            lp = self._completion_logprobs(c, d.new_token_ids, d.new_logprobs or [], echo=echo,
                                           offset=offset) if d.new_logprobs or echo else None
            if lp is not None and not lp["tokens"]:  # nothing to report in this chunk
                lp = None
            # (a model without a tokenizer streams one empty-text chunk per step, so progress shows)
            if text or lp or (tok is None and d.new_token_ids):
                out.append(self._text_event(c.index, text) if lp is None
                           else self._event([schemas.completion_choice(c.index, text, lp, None)]))
            if d.finished:
                out.append(self._event([schemas.completion_choice(c.index, "", None, d.finish_reason,
                                                                  d.stop_reason)]))
        return out

    async def sse(self) -> AsyncIterator[str]:
        """The stream's events, those of each list of deltas in one piece."""
        r = self.req
        status = "error"
        tool_streams: dict[int, ToolStream] = {}
        reasoning_streams: dict[int, ReasoningStream] = {}
        events: list[str] = []  # of the list of deltas at hand
        try:
            if r.chat:  # role first
                yield "".join(self._event([schemas.chat_delta(c.index, {"role": "assistant", "content": ""})])
                              for c in self.choices)
            async for chunk in self.chunks():
                for c, d in chunk:
                    events += self._delta_events(c, d, tool_streams, reasoning_streams)
                if events:
                    piece, events = "".join(events), []
                    yield piece
            if r.include_usage:
                yield self._event([], self.usage())
            status = "success"
        except (asyncio.CancelledError, GeneratorExit):
            status = "aborted"  # the client went away: close() aborts the engine request
            raise
        except Exception as e:
            err = to_http_error(e, r.param_names)
            yield "".join(events) + f"data: {json.dumps(err.body())}\n\n"  # (the events before the failure first)
        finally:
            await self.close(status)
        yield "data: [DONE]\n\n"

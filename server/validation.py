"""OpenAI request bodies -> a checked `GenerationRequest`, or `InvalidRequest` naming the bad field.

What the body itself can get wrong is caught here: JSON types, the prompt forms, the chat messages, the model
name. Value ranges are SamplingParams' (built once per request, here: its `InvalidParam` names the field), and
what depends on the model (token ids in the vocabulary, prompt + max_tokens within the context) is the engine's
input processor's: its refusal comes back as an `InvalidParam` too, which `GenerationRequest.param_names` maps
onto this endpoint's field names (server/generation.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from jinfer.errors import InvalidParam
from jinfer.sampling_params import INT32_MAX, SamplingParams
from server.errors import InvalidRequest, from_invalid_param
from server.reasoning import reasoning_parser
from server.structured import parse_structured_outputs
from server.tools import history_fields, parse_tools


@dataclass(frozen=True)
class ServingContext:
    model_names: tuple[str, ...]
    max_model_len: int
    vocab_size: int
    tokenizer: Any  # jinfer.tokenizer.Tokenizer
    generation_defaults: dict[str, float] = field(default_factory=dict)  # --generation-config
    tool_parser: str | None = None  # --tool-call-parser with --enable-auto-tool-choice (tool_choice "auto")
    reasoning_parser: str | None = None  # --reasoning-parser (server/reasoning.py)
    embedding_size: int = 0  # an embedding model: its vectors' length (it serves only /v1/embeddings); 0: generative


@dataclass
class GenerationRequest:
    chat: bool
    model: str
    prompts: list[list[int]]  # token ids of each prompt
    prompt_texts: list[str]  # their text (echo, logprob offsets)
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    top_logprobs: int | None = None  # None: no logprobs in the response
    extra: dict[str, Any] = field(default_factory=dict)
    echo_only: bool = False  # completions echo + max_tokens 0: the prompt (and its logprobs), nothing generated
    tools: Any = None  # server.tools.ToolPlan: how to read tool calls out of the output (None: plain text)
    reasoning: str | None = None  # the reasoning parser that splits the output (server/reasoning.py)
    # the engine's field names -> this endpoint's (an engine refusal's "param": chat's "messages" for "prompt")
    param_names: dict[str, str] = field(default_factory=dict)
    prompt_logprobs: int | None = None  # vLLM's request field: the prompt tokens' logprobs in the response


def _prompt_logprobs(body: dict[str, Any], kw: dict[str, Any], names: dict[str, str]) -> int | None:
    """vLLM's `prompt_logprobs` field (N top logprobs per prompt token, -1: the whole vocabulary is refused): into
    the sampling parameters (the larger of it and an echo's `logprobs`), the field an engine refusal names."""
    n = _typed(body, "prompt_logprobs", _INT)
    if n is not None:
        kw["prompt_logprobs"] = max(n, kw.get("prompt_logprobs") or 0)
        names.pop("prompt_logprobs", None)
    return n


# name -> (JSON types accepted, description for the error message)
_INT, _NUM, _BOOL = ((int,), "an integer"), ((int, float), "a number"), ((bool,), "a boolean")
_MAP, _LIST = ((dict,), "an object"), ((list,), "a list")
_SAMPLING_FIELDS = {
    "n": _INT, "temperature": _NUM, "top_p": _NUM, "top_k": _INT, "min_p": _NUM, "seed": _INT,
    "presence_penalty": _NUM, "frequency_penalty": _NUM, "repetition_penalty": _NUM, "min_tokens": _INT,
    "ignore_eos": _BOOL, "skip_special_tokens": _BOOL, "include_stop_str_in_output": _BOOL,
    "logit_bias": _MAP,  # {"token id": bias}: checked (count, ids, range) by SamplingParams
    "allowed_token_ids": _LIST, "bad_words": _LIST,  # vLLM's extra parameters; their items checked the same way
}
# Accepted for compatibility but unsupported when set to something that would change the output.
_UNSUPPORTED = ("suffix", "functions", "function_call", "prediction", "audio", "modalities")


def _typed(body: dict[str, Any], name: str, spec: tuple[tuple[type, ...], str], default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    types, what = spec
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        raise InvalidRequest(f"'{name}' must be {what}, got {type(value).__name__} {value!r}"[:300], name)
    return value


def _check_common(body: Any, ctx: ServingContext) -> str:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object", None)
    model = body.get("model", ctx.model_names[0])
    if not isinstance(model, str):
        raise InvalidRequest(f"'model' must be a string, got {type(model).__name__}", "model")
    if model not in ctx.model_names:
        raise InvalidRequest(f"The model '{model}' does not exist; this server serves {list(ctx.model_names)}",
                             "model", "model_not_found")
    for name in _UNSUPPORTED:
        if body.get(name) not in (None, {}, []):
            raise InvalidRequest(f"'{name}' is not supported by this server", name, "unsupported_parameter")
    return model


def _sampling_kwargs(body: dict[str, Any], max_tokens: int | None, logprobs: int | None,
                     structured_outputs: Any = None) -> dict[str, Any]:
    """SamplingParams' keyword arguments from the body, their JSON types checked (their values are its)."""
    kw: dict[str, Any] = {name: body[name] for name in _SAMPLING_FIELDS if body.get(name) is not None}
    for name, spec in _SAMPLING_FIELDS.items():
        _typed(body, name, spec)
    best_of = _typed(body, "best_of", _INT)
    if best_of is not None and best_of != kw.get("n", 1):
        raise InvalidRequest("'best_of' different from 'n' is not supported", "best_of", "unsupported_parameter")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise InvalidRequest("'stop' must be a string or a list of strings", "stop")
    if isinstance(stop, list) and not stop:
        stop = None
    ids = body.get("stop_token_ids")
    if ids is not None and not (isinstance(ids, list) and all(_is_int(t) for t in ids)):
        raise InvalidRequest("'stop_token_ids' must be a list of integers", "stop_token_ids")
    return kw | dict(stop=stop, stop_token_ids=ids, max_tokens=max_tokens, logprobs=logprobs,
                     structured_outputs=structured_outputs)


def _with_generation_defaults(body: dict[str, Any], kw: dict[str, Any], ctx: ServingContext,
                              prompts: list[list[int]]) -> dict[str, Any]:
    """The model's generation_config defaults for the fields the request left out; its max_new_tokens caps
    max_tokens (within the context left by the longest prompt), as in vLLM."""
    d = ctx.generation_defaults
    if not d:
        return kw
    kw = {k: v for k, v in d.items() if k != "max_tokens" and body.get(k) is None} | kw
    if "max_tokens" in d:
        room = ctx.max_model_len - max(len(p) for p in prompts)
        cap = int(d["max_tokens"]) if room < 1 else min(int(d["max_tokens"]), room)
        max_tokens, min_tokens = kw.get("max_tokens"), kw.get("min_tokens", 0)
        kw["max_tokens"] = cap if max_tokens is None else min(max_tokens, cap)
        if _is_int(min_tokens):
            kw["min_tokens"] = min(min_tokens, kw["max_tokens"])
    return kw


def _build_params(kw: dict[str, Any], param_names: dict[str, str]) -> SamplingParams:
    """The request's one SamplingParams; its InvalidParam becomes a 400 naming the request's field."""
    try:
        return SamplingParams(**kw)
    except InvalidParam as e:
        raise from_invalid_param(e, param_names) from None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _all_ints(xs: list[Any]) -> bool:
    """`all(_is_int(x) for x in xs)` for what JSON gives (int, never a subclass but bool), in C: a 1k-token prompt is
    checked in ~15 us instead of ~100."""
    return set(map(type, xs)) <= {int}


def _stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = bool(_typed(body, "stream", _BOOL, False))
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not isinstance(opts, dict):
        raise InvalidRequest("'stream_options' must be an object", "stream_options")
    if not stream:
        raise InvalidRequest("'stream_options' is only allowed when 'stream' is true", "stream_options")
    include = opts.get("include_usage", False)
    if not isinstance(include, bool):
        raise InvalidRequest("'stream_options.include_usage' must be a boolean", "stream_options.include_usage")
    return stream, include


def _max_tokens(body: dict[str, Any], names: Sequence[str], default: int | None) -> tuple[int | None, str]:
    for name in names:
        if body.get(name) is not None:
            return _typed(body, name, _INT), name
    return default, names[0]


def _token_ids(ids: list[Any]) -> list[int]:
    """A prompt of token ids: a non-empty list of token-id-sized integers (the engine checks the vocabulary)."""
    if not ids:
        raise InvalidRequest("'prompt' must not be empty", "prompt")
    if not _all_ints(ids) or min(ids) < 0 or max(ids) > INT32_MAX:
        raise InvalidRequest("'prompt' token ids must be integers >= 0", "prompt")
    return ids


def _require_tokenizer(ctx: ServingContext, param: str) -> None:
    if ctx.tokenizer is None:
        raise InvalidRequest("this model has no tokenizer: send 'prompt' as token ids to /v1/completions", param)


def parse_completion(body: Any, ctx: ServingContext) -> GenerationRequest:
    model = _check_common(body, ctx)
    if "prompt" not in body or body["prompt"] is None:
        raise InvalidRequest("'prompt' is required", "prompt", "missing_required_parameter")
    prompt = body["prompt"]
    tok = ctx.tokenizer
    decode = (lambda ids: tok.decode(ids, skip_special_tokens=False)) if tok is not None else (lambda ids: "")
    if isinstance(prompt, str):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise InvalidRequest("'prompt' must be a string, a list of strings, a list of token ids or a list of "
                             "token id lists, and not empty", "prompt")
    if all(isinstance(p, str) for p in prompt):
        _require_tokenizer(ctx, "prompt")
        texts = prompt
        ids = [tok.encode(p) for p in prompt]
        if any(not i for i in ids):
            raise InvalidRequest("'prompt' must not be empty", "prompt")
    elif _all_ints(prompt):
        ids = [_token_ids(prompt)]
        texts = [decode(ids[0])]
    elif all(isinstance(p, list) for p in prompt):
        ids = [_token_ids(p) for p in prompt]
        texts = [decode(i) for i in ids]
    else:
        raise InvalidRequest("'prompt' must be a string, a list of strings, a list of token ids or a list of "
                             "token id lists", "prompt")
    stream, include_usage = _stream_options(body)
    echo = bool(_typed(body, "echo", _BOOL, False))
    logprobs = _typed(body, "logprobs", _INT)
    max_tokens, mt_name = _max_tokens(body, ("max_tokens",), 16)
    for name in ("tools", "tool_choice"):  # chat only
        if body.get(name) is not None:
            raise InvalidRequest(f"'{name}' is only supported on /v1/chat/completions", name, "unsupported_parameter")
    # echo + max_tokens 0 (how evaluation harnesses score a prompt): generate one token, then drop it (vLLM)
    echo_only = echo and max_tokens == 0
    kw = _sampling_kwargs(body, 1 if echo_only else max_tokens, logprobs, parse_structured_outputs(body))
    if echo and logprobs is not None:  # the echoed prompt tokens' logprobs (the first one null)
        kw["prompt_logprobs"] = logprobs
    names = {"prompt_logprobs": "logprobs"}
    plp = _prompt_logprobs(body, kw, names)
    params = _build_params(_with_generation_defaults(body, kw, ctx, ids), names)
    return GenerationRequest(False, model, ids, list(texts), params, stream, include_usage, echo, logprobs,
                             echo_only=echo_only, param_names=names, prompt_logprobs=plp)


_TEMPLATE_OWN = frozenset({"messages", "tools", "documents", "add_generation_prompt"})  # set by the server
MEDIA_PARTS = frozenset({"image_url", "image", "input_image", "video", "video_url", "input_audio", "audio_url",
                         "file"})


def _message_text(i: int, m: Any) -> dict[str, Any]:
    if not isinstance(m, dict):
        raise InvalidRequest(f"'messages[{i}]' must be an object", f"messages[{i}]")
    role = m.get("role")
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise InvalidRequest(f"'messages[{i}].role' must be one of system, developer, user, assistant, tool; "
                             f"got {role!r}", f"messages[{i}].role")
    content = m.get("content")
    if isinstance(content, list):  # content parts: only text
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in MEDIA_PARTS:  # e.g. a multimodal checkpoint (Qwen3.5): only its text model is served
                raise InvalidRequest(f"'messages[{i}].content[{j}]' is a {kind!r} part: images, video and audio "
                                     "are not supported (jinfer serves text models; a multimodal checkpoint's "
                                     "vision tower is not loaded)", f"messages[{i}].content")
            if kind != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequest(f"'messages[{i}].content[{j}]' must be a text part; only text is supported",
                                     f"messages[{i}].content")
            parts.append(part["text"])
        content = "".join(parts)
    if content is None and role == "assistant":
        content = ""
    if not isinstance(content, str):
        raise InvalidRequest(f"'messages[{i}].content' must be a string or a list of text parts",
                             f"messages[{i}].content")
    return {"role": "system" if role == "developer" else role, "content": content, **history_fields(i, m)}


def parse_chat(body: Any, ctx: ServingContext) -> GenerationRequest:
    model = _check_common(body, ctx)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' is required and must be a non-empty list", "messages",
                             None if isinstance(messages, list) else "missing_required_parameter")
    msgs = [_message_text(i, m) for i, m in enumerate(messages)]
    _require_tokenizer(ctx, "messages")
    tools, tool_plan, forced = parse_tools(body, ctx.tool_parser)
    structured = parse_structured_outputs(body)
    if forced is not None and structured is not None:
        raise InvalidRequest("'tool_choice' required or a named function already constrains the output; drop "
                             "'response_format' / the guided_* fields", "tool_choice")
    template_kwargs = body.get("chat_template_kwargs") or {}  # e.g. {"enable_thinking": false} (Qwen3)
    if not isinstance(template_kwargs, dict) or _TEMPLATE_OWN.intersection(template_kwargs):
        raise InvalidRequest("'chat_template_kwargs' must be an object of extra chat template variables (not "
                             f"{', '.join(sorted(_TEMPLATE_OWN))})", "chat_template_kwargs")
    try:
        text = ctx.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tools=tools, **template_kwargs)
    except ValueError as e:
        raise InvalidRequest(str(e), "messages") from None
    except Exception as e:  # the template computing with a request's value (1 + "a"...): that request's fault
        if not template_kwargs:
            raise
        raise InvalidRequest(f"chat template error with 'chat_template_kwargs': {type(e).__name__}: {e}"[:500],
                             "chat_template_kwargs") from None
    ids = ctx.tokenizer.encode(text, add_special_tokens=False)
    stream, include_usage = _stream_options(body)
    want_lp = bool(_typed(body, "logprobs", _BOOL, False))
    top = _typed(body, "top_logprobs", _INT)
    if top is not None and not want_lp:
        raise InvalidRequest("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
    top = (top or 0) if want_lp else None
    max_tokens, mt_name = _max_tokens(body, ("max_completion_tokens", "max_tokens"), None)
    if body.get("max_completion_tokens") is None and body.get("max_tokens") is not None:
        mt_name = "max_tokens"
    names = {"prompt": "messages", "max_tokens": mt_name, "logprobs": "top_logprobs"}
    kw = _sampling_kwargs(body, max_tokens, top, forced or structured)
    if tool_plan is not None and tool_plan.parser == "mistral" and body.get("skip_special_tokens") is None:
        kw["skip_special_tokens"] = False  # [TOOL_CALLS] is a special token: the parser must see it (as in vLLM)
    plp = _prompt_logprobs(body, kw, names)
    params = _build_params(_with_generation_defaults(body, kw, ctx, [ids]), names)
    # a grammar-constrained output has no think block (the grammar holds from its first token)
    reasoning = reasoning_parser(ctx.reasoning_parser, template_kwargs) if forced is None and structured is None \
        else None
    return GenerationRequest(True, model, [ids], [text], params, stream, include_usage, False, top, tools=tool_plan,
                             param_names=names, reasoning=reasoning, prompt_logprobs=plp)

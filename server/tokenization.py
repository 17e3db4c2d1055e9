"""`POST /tokenize` and `POST /detokenize`, with vLLM's request and response shapes.

    /tokenize    {"prompt": "text", "add_special_tokens": true, "return_token_strs": false}
              or {"messages": [...], "add_generation_prompt": true, "continue_final_message": false,
                  "add_special_tokens": false, "return_token_strs": false}
              -> {"count": n, "max_model_len": L, "tokens": [ids], "token_strs": null | [str]}
    /detokenize  {"tokens": [ids]} -> {"prompt": "text"}
    GET /tokenizer_info -> {"tokenizer_class", "bos_token", "eos_token", "pad_token", "chat_template",
                            "model_max_length"}   (what lm-evaluation-harness' remote tokenizer reads)

Both accept an optional "model" (one of the served names). Every field is checked; bad input is a 400
naming it (`InvalidRequest`), like the generation endpoints.
"""

from __future__ import annotations

from typing import Any

from server.errors import InvalidRequest
from server.validation import ServingContext, _message_text, _require_tokenizer


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"'{name}' must be a boolean", name)
    return value


def _model(body: Any, ctx: ServingContext) -> None:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object", None)
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or model not in ctx.model_names):
        raise InvalidRequest(f"The model {str(model)[:100]!r} does not exist; this server serves "
                             f"{list(ctx.model_names)}", "model", "model_not_found")


def tokenize(body: Any, ctx: ServingContext) -> dict[str, Any]:
    _model(body, ctx)
    _require_tokenizer(ctx, "prompt")
    tok = ctx.tokenizer
    if ("prompt" in body) == ("messages" in body):
        raise InvalidRequest("send exactly one of 'prompt' (text) or 'messages' (a chat)", "prompt",
                             "missing_required_parameter")
    if "prompt" in body:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise InvalidRequest("'prompt' must be a string", "prompt")
        ids = tok.encode(prompt, add_special_tokens=_flag(body, "add_special_tokens", True))
    else:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest("'messages' must be a non-empty list", "messages")
        msgs = [_message_text(i, m) for i, m in enumerate(messages)]
        add_gen = _flag(body, "add_generation_prompt", True)
        cont = _flag(body, "continue_final_message", False)
        if add_gen and cont:
            raise InvalidRequest("'add_generation_prompt' and 'continue_final_message' cannot both be true",
                                 "continue_final_message")
        try:
            text = tok.apply_chat_template(msgs, add_generation_prompt=add_gen)
        except ValueError as e:
            raise InvalidRequest(str(e)[:500], "messages") from None
        if cont:  # end the text at the last message's content, so that a generation continues it
            last = msgs[-1]["content"]
            cut = text.rfind(last) if last else -1
            text = text[:cut + len(last)] if cut >= 0 else text
        ids = tok.encode(text, add_special_tokens=_flag(body, "add_special_tokens", False))
    strs = [tok.id_to_token(i) or "" for i in ids] if _flag(body, "return_token_strs", False) else None
    return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(body: Any, ctx: ServingContext) -> dict[str, Any]:
    _model(body, ctx)
    _require_tokenizer(ctx, "tokens")
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                            and 0 <= t < ctx.vocab_size for t in ids):
        raise InvalidRequest(f"'tokens' must be a list of token ids in [0, {ctx.vocab_size})", "tokens",
                             None if "tokens" in body else "missing_required_parameter")
    return {"prompt": ctx.tokenizer.decode(ids, skip_special_tokens=False)}


def tokenizer_info(ctx: ServingContext) -> dict[str, Any]:
    _require_tokenizer(ctx, None)
    tok = ctx.tokenizer
    name = lambda i: None if i is None else tok.id_to_token(i)
    return {"tokenizer_class": "jinfer.tokenizer.Tokenizer", "bos_token": name(tok.bos_token_id),
            "eos_token": name((tok.eos_token_ids or (None,))[0]), "pad_token": None,
            "chat_template": tok.chat_template, "model_max_length": ctx.max_model_len}

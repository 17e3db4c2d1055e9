"""OpenAI response objects (plain dicts, serialized as JSON): completions, chat completions, their
streaming chunks, usage and the two logprobs formats."""

from __future__ import annotations

from typing import Any

TokenLogprobs = dict[int, float]


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _finite(logprob: float | None) -> float | None:
    """JSON has no -inf: clamp like vLLM does (a token the sampler masked out)."""
    return None if logprob is None else max(logprob, -9999.0) if logprob == logprob else -9999.0


def token_text(tokenizer: Any, token_id: int) -> str:
    if tokenizer is None:  # a model without a tokenizer (dummy weights): name the id
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


# ---- logprobs ---------------------------------------------------------------------------------------


def completion_logprobs(tokenizer: Any, token_ids: list[int], lps: list[TokenLogprobs | None],
                        text_offset: int) -> dict[str, Any]:
    """Legacy completions format; `lps[i]` None for tokens without logprobs (echoed prompt tokens)."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, lp in zip(token_ids, lps, strict=True):
        text = token_text(tokenizer, tid)
        out["tokens"].append(text)
        out["token_logprobs"].append(None if lp is None else _finite(lp.get(tid)))
        out["top_logprobs"].append(None if lp is None else {
            token_text(tokenizer, t): _finite(v) for t, v in sorted(lp.items(), key=lambda kv: -kv[1])})
        out["text_offset"].append(text_offset)
        text_offset += len(text)
    return out


def _chat_token(tokenizer: Any, token_id: int, logprob: float) -> dict[str, Any]:
    text = token_text(tokenizer, token_id)
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer: Any, token_ids: list[int], lps: list[TokenLogprobs], top_n: int) -> dict[str, Any]:
    content = []
    for tid, lp in zip(token_ids, lps, strict=True):
        entry = _chat_token(tokenizer, tid, lp.get(tid, float("-inf")))
        top = sorted(lp.items(), key=lambda kv: -kv[1])[:top_n]
        entry["top_logprobs"] = [_chat_token(tokenizer, t, v) for t, v in top]
        content.append(entry)
    return {"content": content}


def prompt_logprobs(tokenizer: Any, prompt: list[int], lps: list[TokenLogprobs | None] | None,
                    ranks: list[int | None] | None) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (the first null) {token id: {logprob, rank, decoded_token}}, the
    prompt's own token first (its rank among the whole vocabulary), then the top N (ranks 1..N)."""
    lps = lps or [None] * len(prompt)
    ranks = ranks or [None] * len(prompt)
    out: list[dict[str, dict[str, Any]] | None] = []
    for tid, lp, rank in zip(prompt, lps, ranks, strict=True):
        if lp is None:
            out.append(None)
            continue
        entry = {str(tid): {"logprob": _finite(lp.get(tid)), "rank": rank, "decoded_token": token_text(tokenizer, tid)}}
        top = sorted(lp.items(), key=lambda kv: -kv[1])
        entry.update((str(t), {"logprob": _finite(v), "rank": k, "decoded_token": token_text(tokenizer, t)})
                     for k, (t, v) in enumerate(top, 1) if t != tid)
        out.append(entry)
    return out


# ---- full responses ---------------------------------------------------------------------------------


def completion_choice(index: int, text: str, logprobs: dict | None, finish_reason: str | None,
                      stop_reason: int | str | None = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def chat_choice(index: int, content: str | None, logprobs: dict | None, finish_reason: str | None,
                stop_reason: int | str | None = None, tool_calls: list[dict] | None = None) -> dict[str, Any]:
    return {"index": index, "message": {"role": "assistant", "content": content, "tool_calls": tool_calls or []},
            "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason}


def response(chat: bool, id: str, created: int, model: str, choices: list[dict],
             usage_: dict[str, Any]) -> dict[str, Any]:
    return {"id": id, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": choices, "usage": usage_, "system_fingerprint": None}


# ---- streaming --------------------------------------------------------------------------------------


def chunk(chat: bool, id: str, created: int, model: str, choices: list[dict],
          usage_: dict[str, Any] | None = None, include_usage: bool = False) -> dict[str, Any]:
    out = {"id": id, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
           "model": model, "choices": choices, "system_fingerprint": None}
    if include_usage:  # OpenAI: null on every chunk but the last one, which has no choices
        out["usage"] = usage_
    return out


def chat_delta(index: int, delta: dict[str, Any], logprobs: dict | None = None, finish_reason: str | None = None,
               stop_reason: int | str | None = None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def model_card(name: str, created: int, max_model_len: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "jinfer", "root": name,
            "max_model_len": max_model_len}

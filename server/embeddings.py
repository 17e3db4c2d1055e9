"""POST /v1/embeddings (OpenAI's): the body checked into an `EmbeddingRequest`, run through the engine as
embedding requests (`PoolingParams`), and the response body.

`input`: a string, a list of strings, a list of token ids or a list of token-id lists; `encoding_format`:
"float" (default) or "base64" (the float32 little-endian bytes, as the engine sends them); `dimensions`:
Matryoshka truncation (the first `dimensions` values, normalised again), at most the model's embedding size.
Only an embedding model serves this route, and it serves no other generation route (`require_task`).
"""

from __future__ import annotations

import base64
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from jinfer.pooling_params import PoolingParams
from server.errors import InvalidRequest
from server.generation import to_http_error
from server.validation import ServingContext, _check_common, _is_int, _token_ids

ENCODING_FORMATS = ("float", "base64")
PARAM_NAMES = {"prompt": "input"}  # an engine refusal's field -> this route's


@dataclass
class EmbeddingRequest:
    model: str
    prompts: list[list[int]]  # token ids of each input
    params: PoolingParams
    base64: bool


def require_task(ctx: ServingContext, embedding: bool) -> None:
    """A 400 when the route does not match the model: generation on an embedding model, or the other way round."""
    if embedding and not ctx.embedding_size:
        raise InvalidRequest("this model generates text: /v1/embeddings needs an embedding model (a checkpoint such "
                             "as Qwen3-Embedding, or --runner pooling)", "model", "model_not_supported")
    if not embedding and ctx.embedding_size:
        raise InvalidRequest("this model is an embedding model: it serves /v1/embeddings, not text generation",
                             "model", "model_not_supported")


def _input_ids(value: Any, ctx: ServingContext) -> list[list[int]]:
    form = "'input' must be a string, a list of strings, a list of token ids or a list of token id lists"
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise InvalidRequest(form + ", and not empty", "input")
    if all(isinstance(v, str) for v in value):
        if ctx.tokenizer is None:
            raise InvalidRequest("this model has no tokenizer: send 'input' as token ids", "input")
        ids = [ctx.tokenizer.encode(v) for v in value]
    elif all(_is_int(t) for t in value):
        ids = [value]
    elif all(isinstance(v, list) for v in value):
        ids = value
    else:
        raise InvalidRequest(form, "input")
    try:
        return [_token_ids(i) for i in ids]
    except InvalidRequest as e:  # (worded for completions' 'prompt')
        raise InvalidRequest(e.message.replace("'prompt'", "'input'"), "input") from None


def parse_embedding(body: Any, ctx: ServingContext) -> EmbeddingRequest:
    model = _check_common(body, ctx)
    require_task(ctx, embedding=True)
    if body.get("input") is None:
        raise InvalidRequest("'input' is required", "input", "missing_required_parameter")
    prompts = _input_ids(body["input"], ctx)
    fmt = body.get("encoding_format") or "float"
    if fmt not in ENCODING_FORMATS:
        raise InvalidRequest(f"'encoding_format' must be one of {list(ENCODING_FORMATS)}, got {fmt!r}"[:300],
                             "encoding_format")
    dims = body.get("dimensions")
    if dims is not None and (not _is_int(dims) or not 1 <= dims <= ctx.embedding_size):
        raise InvalidRequest(f"'dimensions' must be an integer in [1, {ctx.embedding_size}] (the model's embedding "
                             f"size), got {dims!r}"[:300], "dimensions")
    return EmbeddingRequest(model, prompts, PoolingParams(dimensions=dims), fmt == "base64")


async def run_embeddings(client: Any, req: EmbeddingRequest) -> dict[str, Any]:
    """Every input's vector from the engine, as OpenAI's response body; InvalidRequest for a refusal or failure."""
    vectors: list[bytes | None] = [None] * len(req.prompts)
    try:
        async for chunk in client.stream_batch(req.prompts, req.params, f"embd-{uuid.uuid4().hex}"):
            for i, delta in chunk:
                if delta.embedding is not None:
                    vectors[i] = delta.embedding
    except Exception as e:
        raise to_http_error(e, PARAM_NAMES) from None
    if any(v is None for v in vectors):  # aborted (the engine went away between steps)
        raise InvalidRequest("embedding failed: the engine returned no vector", None, "internal_error", 500,
                             "server_error")
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(v).decode() if req.base64 else np.frombuffer(v, "<f4").tolist()}
            for i, v in enumerate(vectors)]
    num_tokens = sum(len(p) for p in req.prompts)
    return {"object": "list", "data": data, "model": req.model,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}

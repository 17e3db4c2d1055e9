"""Embedding requests in the engine (an embedding model: `ModelConfig.pooling`, jinfer/config/pooling.py).

An embedding request is a generation of one token that is never sampled: it goes through the scheduler like any
prompt (paged KV, chunked prefill, prefix-cache hits), with `max_tokens=1`, so the scheduler finishes it after its
prompt and never schedules a decode. The model's pooling executables return, instead of logits, the final normed
hidden state of each row a finished prompt samples from (its last token), L2-normalised (jinfer/models/base.py:
`lm_head_logits`); the runner skips the sampler, and the core turns each such row into the request's one
`EngineOutput`, its vector as float32 bytes (`embedding_output`).
"""

from __future__ import annotations

import numpy as np

from jinfer.config.model import ModelConfig
from jinfer.engine.input_processor import SequenceState
from jinfer.engine.request import Request
from jinfer.errors import InvalidParam
from jinfer.outputs import EngineOutput
from jinfer.pooling_params import PoolingParams
from jinfer.sampling_params import SamplingParams

# What the scheduler sees of an embedding request: one (dummy) token after the prompt, then finished.
EMBED_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def pooling_request(params: SamplingParams | PoolingParams | None, cfg: ModelConfig
                    ) -> tuple[PoolingParams | None, SamplingParams]:
    """(the request's PoolingParams, or None for a generation; the SamplingParams the scheduler runs it with).
    InvalidParam for a generation on an embedding model and the other way round, and for `dimensions` beyond the
    hidden size. None: the model's own task."""
    if params is None:
        return (PoolingParams(), EMBED_SAMPLING) if cfg.pooling else (None, SamplingParams())
    if isinstance(params, PoolingParams):
        if not cfg.pooling:
            raise InvalidParam("model", "this model generates text; embeddings need an embedding model (a "
                                        "Qwen3-Embedding checkpoint, or --runner pooling)")
        if params.dimensions is not None and params.dimensions > cfg.hidden_size:
            raise InvalidParam("dimensions", f"dimensions={params.dimensions} exceeds the model's embedding size "
                                             f"{cfg.hidden_size}")
        return params, EMBED_SAMPLING
    if cfg.pooling:
        raise InvalidParam("model", "this model is an embedding model: it serves /v1/embeddings (LLM.embed), not "
                                    "text generation")
    return None, params


def embedding_output(seq: SequenceState, request: Request, vector: np.ndarray, params: PoolingParams
                     ) -> EngineOutput:
    """The finished delta of an embedding request: `vector` (unit norm), truncated to `params.dimensions` and
    normalised again (Matryoshka), as float32 bytes."""
    v = np.asarray(vector, np.float32)
    if params.dimensions is not None:
        v = v[:params.dimensions]
        v = v / max(float(np.linalg.norm(v)), 1e-12)
    return EngineOutput(seq.parent_id, seq.index, [], "", finished=True, finish_reason="stop",
                        num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=request.num_cached_tokens,
                        embedding=v.astype("<f4").tobytes())

"""What the engine returns: per-step deltas (`EngineOutput`, streamed by the server) and the
vLLM-compatible aggregated `RequestOutput` / `CompletionOutput` (and `EmbeddingRequestOutput`) of the offline API."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import numpy as np

# One entry per generated token: {token_id: logprob} holding the chosen token and the top-N.
TokenLogprobs = dict[int, float]


class EngineOutput(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """New tokens of one sequence (`index` of the request's n samples) from one engine step.

    A msgspec Struct so that the engine protocol (jinfer/engine/protocol.py) sends it as it is: a positional
    msgpack array, decoded and type-checked in C on the client side.
    """

    request_id: str
    index: int
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    new_logprobs: list[TokenLogprobs] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None  # set when finish_reason == "error"
    # prompt_logprobs: on a sequence's first delta, one entry per prompt token (the first None)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # Speculative decoding in this step: verifications (0 or 1), the drafts they verified and the drafts accepted.
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # An embedding request's result (on its one, finished delta): the pooled vector as float32 little-endian bytes
    # (raw bytes on the wire, as OpenAI's base64 encoding wants them; `embedding_list` gives the floats).
    embedding: bytes | None = None

    def embedding_list(self) -> list[float] | None:
        return None if self.embedding is None else np.frombuffer(self.embedding, "<f4").tolist()


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Per-request counters (all its samples): speculative decoding's verifications, drafts and accepted drafts."""

    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens per verifying step (1 + accepted drafts per verification, vLLM's measure); None without drafts."""
        return 1 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # SamplingParams.prompt_logprobs (vLLM's)
    metrics: RequestMetrics = field(default_factory=RequestMetrics)

    def add(self, delta: EngineOutput) -> None:
        """Fold one step's delta into the aggregate."""
        out = self.outputs[delta.index]
        out.token_ids.extend(delta.new_token_ids)
        out.text += delta.new_text
        if delta.new_logprobs is not None:
            out.logprobs = (out.logprobs or []) + delta.new_logprobs
            chosen = sum(lp[t] for lp, t in zip(delta.new_logprobs, delta.new_token_ids, strict=True))
            out.cumulative_logprob = (out.cumulative_logprob or 0.0) + chosen
        if delta.finished:
            out.finish_reason, out.stop_reason = delta.finish_reason, delta.stop_reason
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        if delta.num_drafts:
            m = self.metrics
            m.spec_num_drafts += delta.num_drafts
            m.spec_num_draft_tokens += delta.num_draft_tokens
            m.spec_num_accepted_tokens += delta.num_accepted_tokens
        if delta.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.finished = all(o.finished() for o in self.outputs)


@dataclass
class EmbeddingOutput:
    """vLLM's: the pooled vector of one prompt (normalised; truncated to `dimensions` when asked)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """vLLM's `LLM.embed` result for one prompt: `outputs.embedding` is the vector."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

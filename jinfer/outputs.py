"""What the engine returns: per-step deltas (`EngineOutput`, streamed by the server) and the
vLLM-compatible aggregated `RequestOutput` / `CompletionOutput` (and `EmbeddingRequestOutput`) of the offline API.

The wire keeps logprobs compact ({token id: float} and the chosen token's rank beside them); `RequestOutput.add`
turns them into vLLM's `Logprob` objects, decoding each token's text with the tokenizer it is given.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

# One entry per generated token on the wire: {token_id: logprob}, the top-N best first, then the chosen token
# unless it is among them.
TokenLogprobs = dict[int, float]


@dataclass
class Logprob:
    """vLLM's `Logprob`: a token's logprob, its 1-based rank in the distribution, and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# The offline API's entry per token: {token_id: Logprob}, the chosen token and the top-N.
SampleLogprobs = dict[int, Logprob]


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
    # The chosen token's rank per entry of new_logprobs, and of each prompt_logprobs entry (the first None)
    new_logprob_ranks: list[int] | None = None
    prompt_logprob_ranks: list[int | None] | None = None
    first_scheduled_time: float | None = None  # on a sequence's first delta: time.time() when first scheduled
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
    logprobs: list[SampleLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """vLLM's per-request metrics (its RequestMetrics / RequestStateStats names), wall-clock times (time.time()) of
    the whole request (all its samples), and speculative decoding's verifications, drafts and accepted drafts."""

    arrival_time: float = field(default_factory=time.time)  # when the request was made
    first_scheduled_time: float | None = None  # when the scheduler first ran it (its first sample)
    first_token_time: float | None = None  # when its first token came back
    last_token_time: float | None = None  # when its latest token came back
    finished_time: float | None = None  # when its last sample finished
    num_generation_tokens: int = 0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0

    @property
    def time_in_queue(self) -> float | None:
        """Seconds between arrival and first scheduling."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def first_token_latency(self) -> float | None:
        """Seconds from arrival to the first token (time to first token)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

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
    prompt_logprobs: list[SampleLogprobs | None] | None = None  # SamplingParams.prompt_logprobs (vLLM's)
    metrics: RequestMetrics = field(default_factory=RequestMetrics)

    def add(self, delta: EngineOutput, tokenizer: Any = None) -> None:
        """Fold one step's delta into the aggregate; `tokenizer` (or None) decodes the logprobs' tokens."""
        now = time.time()
        m = self.metrics
        out = self.outputs[delta.index]
        out.token_ids.extend(delta.new_token_ids)
        out.text += delta.new_text
        if delta.new_logprobs is not None:
            out.logprobs = (out.logprobs or []) + _logprobs(delta.new_logprobs, delta.new_token_ids,
                                                            delta.new_logprob_ranks, tokenizer)
            chosen = sum(lp[t] for lp, t in zip(delta.new_logprobs, delta.new_token_ids, strict=True))
            out.cumulative_logprob = (out.cumulative_logprob or 0.0) + chosen
        if delta.finished:
            out.finish_reason, out.stop_reason = delta.finish_reason, delta.stop_reason
        self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
        if delta.num_drafts:
            m.spec_num_drafts += delta.num_drafts
            m.spec_num_draft_tokens += delta.num_draft_tokens
            m.spec_num_accepted_tokens += delta.num_accepted_tokens
        if delta.first_scheduled_time is not None and (m.first_scheduled_time is None
                                                       or delta.first_scheduled_time < m.first_scheduled_time):
            m.first_scheduled_time = delta.first_scheduled_time
        if delta.new_token_ids:
            m.num_generation_tokens += len(delta.new_token_ids)
            m.last_token_time = now
            if m.first_token_time is None:
                m.first_token_time = now
        if delta.prompt_logprobs is not None and self.prompt_logprobs is None:
            targets = [None, *self.prompt_token_ids[1:]]
            self.prompt_logprobs = [None if lp is None else _logprobs([lp], [t], [r], tokenizer)[0] for lp, t, r in
                                    zip(delta.prompt_logprobs, targets,
                                        delta.prompt_logprob_ranks or [None] * len(targets), strict=True)]
        self.finished = all(o.finished() for o in self.outputs)
        if self.finished and m.finished_time is None:
            m.finished_time = now


def _logprobs(entries: list[TokenLogprobs], chosen: list[int], ranks: list[int | None] | None,
              tokenizer: Any) -> list[SampleLogprobs]:
    """Wire entries -> {token_id: Logprob}, in vLLM's order: the chosen token first with its own rank (its place in
    the top-N when there), then the top-N, ranks 1..N (best first on the wire, where the chosen token is in its
    place or after them)."""
    text = (lambda t: tokenizer.decode([t], skip_special_tokens=False)) if tokenizer is not None else (lambda t: None)
    out = []
    for i, (lp, token) in enumerate(zip(entries, chosen, strict=True)):
        d = {token: Logprob(lp[token], ranks[i] if ranks is not None else None, text(token))}
        d.update((t, Logprob(v, k, text(t))) for k, (t, v) in enumerate(lp.items(), 1) if t != token)
        out.append(d)
    return out


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

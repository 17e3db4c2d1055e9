"""One generation request as the scheduler sees it: tokens, progress, pages, and how it ended.

Token-count model: `all_token_ids` = prompt + accepted generated tokens, followed by `pending_token_ids`:
tokens a step consumes before they are accepted outputs. A pending entry is `DEVICE_TOKEN` for a token that a
launched step is sampling (its value is on the device: async scheduling feeds it to the next step there), or a
draft token (speculative decoding) that the step computing it verifies: its id, or `device_input(i)` for one
the device holds at row i of the sampled-ids buffer the next step reads its inputs from (a model drafter's;
the id replaces it once that step is dispatched). `num_computed_tokens` counts the leading tokens (pending
ones too) whose KV is in the cache or is being written by a launched step. A step computes the next
`num_new_tokens` of them; when it reaches the end, it samples a token at each of its last positions that
verify (the last accepted token and every draft after it) and the scheduler's update appends the accepted
ones. Prefill, chunked prefill, decode, verification and recompute after preemption are all this one loop. A
request is one sequence: the engine fans `SamplingParams.n > 1` out into n Requests.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from jinfer.sampling_params import SamplingParams

DEVICE_TOKEN = -1  # a pending token whose value a launched step is sampling (it stays on the device)
DEVICE_DRAFT = -2  # pending ids <= this are drafts the device holds (`device_input`)


def device_input(index: int) -> int:
    """The pending id of a draft the device holds at row `index` of the buffer the next step reads its input ids from
    (the sampled ids, a head's drafts after them): -2 - index, as the batch builder and the sampler read it back."""
    return DEVICE_DRAFT - index


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # never admitted yet
    RUNNING = "running"  # holds pages, scheduled every step while budget allows
    PREEMPTED = "preempted"  # lost its pages; waits at the front of the queue to recompute
    FINISHED_STOPPED = "finished_stopped"  # EOS, stop token or stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "finished_aborted"  # client abort or error

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                       RequestStatus.FINISHED_ABORTED})


class FinishReason(enum.StrEnum):
    """OpenAI `finish_reason` values; a StrEnum, so `FinishReason.STOP == "stop"`."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"

    @property
    def status(self) -> RequestStatus:
        return {FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
                FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
                FinishReason.ABORT: RequestStatus.FINISHED_ABORTED}[self]


@dataclass(eq=False)  # identity equality: requests live in lists/deques and are removed by identity
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: tuple[int, ...] = ()  # the model's EOS ids (several for some models)
    arrival_time: float = field(default_factory=time.monotonic)

    output_token_ids: list[int] = field(default_factory=list, init=False)
    all_token_ids: list[int] = field(init=False)  # prompt + output, the tokens the model consumes
    status: RequestStatus = field(default=RequestStatus.WAITING, init=False)
    num_computed_tokens: int = field(default=0, init=False)
    # Tokens after all_token_ids that steps consume before they are accepted (module doc): DEVICE_TOKEN for one
    # a launched step samples (with one step in flight the scheduler schedules its decode before its value is
    # known: the device feeds it in), or a draft token's id (or `device_input`). Drafts follow the last DEVICE_TOKEN.
    pending_token_ids: list[int] = field(default_factory=list, init=False)
    num_cached_tokens: int = field(default=0, init=False)  # prefix-cache hit at first admission
    first_scheduled_time: float | None = field(default=None, init=False)  # time.time() at first admission
    num_preemptions: int = field(default=0, init=False)
    finish_reason: FinishReason | None = field(default=None, init=False)
    stop_reason: int | str | None = field(default=None, init=False)  # the stop token id or stop string
    # Owned by KVCacheManager: the page table, and chained hashes of the full pages of all_token_ids
    # (kept across preemption: the tokens never change, only grow).
    page_ids: list[int] = field(default_factory=list, init=False)
    # Its slot in the per-sequence state pools (linear-attention layers; 0 = none), held while admitted.
    state_slot: int = field(default=0, init=False)
    page_hashes: list[bytes] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self):
        self.prompt_token_ids = list(self.prompt_token_ids)
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: prompt_token_ids must not be empty")
        self.eos_token_ids = tuple(self.eos_token_ids)
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def num_pending_tokens(self) -> int:
        return len(self.pending_token_ids)

    @property
    def num_sampling_tokens(self) -> int:
        """Pending tokens that launched steps are sampling (not yet read back)."""
        return self.pending_token_ids.count(DEVICE_TOKEN)

    @property
    def num_inflight_tokens(self) -> int:
        """Pending tokens up to the last one being sampled: those launched steps compute or sample, as if every draft
        among them is kept (the most tokens the request may have once they are read back)."""
        p = self.pending_token_ids
        for i in range(len(p) - 1, -1, -1):
            if p[i] == DEVICE_TOKEN:
                return i + 1
        return 0

    @property
    def num_draft_tokens(self) -> int:
        """Draft tokens after the last token being sampled: no launched step covers them yet."""
        pending = self.pending_token_ids
        if not pending or pending[-1] == DEVICE_TOKEN:  # (every step without drafts)
            return 0
        n = 0
        for token in reversed(self.pending_token_ids):
            if token == DEVICE_TOKEN:
                break
            n += 1
        return n

    @property
    def has_drafts_in_flight(self) -> bool:
        """Whether a launched step verifies draft tokens of this request (drafts before its last DEVICE_TOKEN): until
        it is read back nothing may be scheduled after them (some may be rejected)."""
        p = self.pending_token_ids
        if len(p) <= 1:  # (every step without drafts)
            return False
        for i in range(len(p) - 1, -1, -1):
            if p[i] == DEVICE_TOKEN:
                return any(t != DEVICE_TOKEN for t in p[:i])
        return False

    def add_draft_tokens(self, token_ids: Sequence[int]) -> None:
        """Propose tokens to verify after the request's last one (speculative decoding): the next step that
        reaches them computes them and samples at each of their positions (`accept_draft_tokens`)."""
        if any(t == DEVICE_TOKEN for t in token_ids):
            raise ValueError(f"request {self.request_id!r}: draft token ids must be >= 0 (or device inputs), got "
                             f"{list(token_ids)}")
        self.pending_token_ids.extend(token_ids)

    def drop_draft_tokens(self, keep: int = 0) -> None:
        """Forget the uncovered draft tokens past the first `keep` (budget, length, preemption)."""
        n = self.num_draft_tokens
        if n > keep:
            del self.pending_token_ids[len(self.pending_token_ids) - n + keep:]

    def token_at(self, index: int) -> int:
        """Token `index` of the sequence, pending ones included (DEVICE_TOKEN: on the device)."""
        n = len(self.all_token_ids)
        return self.all_token_ids[index] if index < n else self.pending_token_ids[index - n]

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def stop_token_ids_while_min_tokens(self) -> tuple[int, ...]:
        """Token ids the sampler should mask while fewer than `min_tokens` tokens were generated."""
        sp = self.sampling_params
        eos = () if sp.ignore_eos else self.eos_token_ids
        return tuple(dict.fromkeys(eos + sp.stop_token_ids))


def accept_draft_tokens(draft_ids: Sequence[int], sampled_ids: Sequence[int]) -> list[int]:
    """The tokens a verifying step accepts: `sampled_ids[i]` is the token sampled at the position whose next token
    `draft_ids[i]` proposes (len(sampled_ids) == len(draft_ids) + 1). Drafts are accepted while they equal the
    sampled token, then the first sampled token that differs (or the bonus one) ends the list. Each accepted token
    is a sample of the target distribution at its position, so the output is distributed as without drafts."""
    if len(sampled_ids) != len(draft_ids) + 1:
        raise ValueError(f"{len(sampled_ids)} sampled ids for {len(draft_ids)} drafts: need one more")
    out = []
    for draft, token in zip(draft_ids, sampled_ids):
        out.append(int(token))
        if token != draft:
            return out
    out.append(int(sampled_ids[-1]))
    return out

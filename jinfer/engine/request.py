"""One generation request as the scheduler sees it: tokens, progress, pages, and how it ended.

Token-count model: `all_token_ids` = prompt + generated tokens; `num_computed_tokens` counts the
leading tokens whose KV is in the cache or is being written by a launched step. A step computes
the next `num_new_tokens` of them; when it reaches the end of `all_token_ids` a token is sampled
and appended. Prefill, chunked prefill, decode and recompute after preemption are all this one loop.
A request is one sequence: the engine fans
`SamplingParams.n > 1` out into n Requests.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from jinfer.sampling_params import SamplingParams


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
    # Tokens sampled by a launched step but not yet read back (0 or 1): with one step in flight the
    # scheduler schedules their decode before their value is known (the device feeds it in).
    num_pending_tokens: int = field(default=0, init=False)
    num_cached_tokens: int = field(default=0, init=False)  # prefix-cache hit at first admission
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

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def stop_token_ids_while_min_tokens(self) -> tuple[int, ...]:
        """Token ids the sampler should mask while fewer than `min_tokens` tokens were generated."""
        sp = self.sampling_params
        eos = () if sp.ignore_eos else self.eos_token_ids
        return tuple(dict.fromkeys(eos + sp.stop_token_ids))

"""Continuous-batching scheduler (plain Python): which requests compute how many tokens this step.

One step, as the engine core drives it:

    out = scheduler.schedule()                   # SchedulerOutput: the batch, in order
    accepted = ...                               # {request_id: [token, ...]} for each s with s.needs_sample
    finished = scheduler.update(out, accepted)   # append tokens, check stops, free pages

`schedule` advances `num_computed_tokens` at once and enters each token it will sample as pending
(`Request.pending_token_ids`, `DEVICE_TOKEN`), so the engine may schedule step N+1 before step N's tokens are
read back (async scheduling): a request with a pending token gets a decode whose first input the
device takes from step N's samples (`ScheduledRequest.input_from_device`). A request whose pending
token is certainly its last (max_tokens, max_model_len) is not scheduled again; one that turns out to
stop on EOS or a stop string has computed one extra token, which `update` drops. A request whose drafts a launched
step verifies is not scheduled again until that step is read back, unless the drafter moves its next row on the device
(below: verifications in flight).

Multi-token steps (speculative decoding): a request's draft tokens (`Request.add_draft_tokens`) are pending
tokens with known ids. The step that reaches the end of a request computes its last accepted token and every
draft in one row and returns `ScheduledRequest.num_logits` = 1 + drafts logits rows, the last positions of the
row; `update` takes the accepted tokens (1 to num_logits of them, `request.accept_draft_tokens`) and rolls
`num_computed_tokens` back over the rejected drafts (their KV is overwritten later). Drafts that the budget or the
length limit leaves no room for are dropped, so a row never verifies only some of them.
A model with a per-sequence state (linear attention) cannot roll its state back that way: the row advanced it
through every draft. With `kv.state_pairs` each request's state is in one slot of a pair, and a verifying row
reads its slot and writes the other (`ScheduledRequest.write_slot`), and into the slot it reads the state after
its known tokens, the rows before its drafts (`state_keep`): where every draft was accepted the other slot becomes
the request's; where one was rejected `update` rolls `num_computed_tokens` back to the first draft, its slot
holding the state there, so the next step recomputes the drafts accepted (none with one draft: its row is the
sample and the new drafts, as after an acceptance; their KV is rewritten with the same values). Nothing is copied.

Verifications in flight (`schedule(past_drafts=True)`; a model drafter, jinfer/spec/decoding.py): a request whose
drafts a launched step verifies is scheduled again before that step is read back, as if it keeps every draft: its row
starts after them (the sample after them from the device, the drafter's next drafts) and, on the device, moves back
by the drafts rejected (positions, slots, length: `ScheduledRequest.shift_from`, engine/device_step.py `shift_rows`);
its pages cover the row as scheduled. `update` then rolls `num_computed_tokens` back by as many, and where every draft
was kept moves the request to the other slot of its pair. Such a row reads one slot and writes the other whether it has
drafts or not (on the device, where the verification before it kept all, the two swap); without drafts it leaves the
same state in both, and the request stays where it is. Length checks count the
tokens in flight as kept: a request that might reach its limit waits for the read-back.

Policy (vLLM v1 style, token-count model): each step has a budget of `max_num_batched_tokens`.
Running requests go first, in admission order: a decode takes 1 token, an unfinished prefill the
rest of its prompt (chunked to the remaining budget). If a running request needs a page and the
pool is empty, the NEWEST running request is preempted (pages freed, `num_computed_tokens` reset to
0, put at the FRONT of the waiting queue; its generated tokens are kept and recomputed with the
prompt), repeatedly, until it fits or it is itself the victim. Then, if nobody was preempted this
step, waiting requests join in FIFO order while budget, `max_num_seqs` and pages allow, reusing
cached prefix pages. A request that could not run alone in an empty pool is refused at
`add_request`, so the engine never fails for lack of KV space.

Forks (n > 1 samples of a prompt on models with a per-sequence state, which have no prefix cache): the first
sample leads; the others wait beside the queue (`add_request(..., fork_of=leader)`) while the leader's prefill
stops one token short of the prompt's end. At the next schedule each follower is admitted holding the
leader's computed tokens (full pages shared, the last partial page and the state slot copied:
`SchedulerOutput.fork_pages` / `fork_slots`, which the runner copies before the step), and every sample then
computes the last prompt token itself and samples its own first token. A follower that cannot fork (no page,
slot or sequence room then, or its leader gone) joins the front of the waiting queue as a plain request.

Stop conditions (`update`): once `min_tokens` tokens exist, an EOS id (unless `ignore_eos`) or a
`stop_token_ids` id finishes with "stop" (stop_reason = the id, None for EOS); then `max_tokens`
or reaching `max_model_len` tokens finishes with "length". Stop strings are the engine core's job
(it detokenizes); it calls `finish_request(id, FinishReason.STOP, stop_string)`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from jinfer.cache.host_tier import KVTransfers
from jinfer.cache.manager import KVCacheManager
from jinfer.config.engine import SchedulerConfig
from jinfer.engine.request import DEVICE_DRAFT, DEVICE_TOKEN, FinishReason, Request, RequestStatus


@dataclass
class ScheduledRequest:
    """One sequence of the step's batch: tokens `request.all_token_ids[start:start + num_new_tokens]`."""

    request: Request
    num_new_tokens: int
    start: int  # == request.num_computed_tokens when scheduled: position of the first new token
    page_ids: list[int]  # the request's whole page table (live list; read it before the next schedule)
    needs_sample: bool  # this step reaches the end of the request's tokens: sample its next token
    input_from_device: bool = False  # its first token is the one the previous (in-flight) step samples
    # Logits rows this sequence returns: its last num_logits tokens (0 without a sample; 1 + the draft tokens
    # it verifies), and those drafts' ids.
    num_logits: int = 0
    draft_token_ids: list[int] = field(default_factory=list)
    write_slot: int | None = None  # the state slot the row writes, where not its own (module doc: state pairs)
    # A row scheduled past drafts in flight (module doc: verifications in flight): the row of the sampled-ids buffer
    # where the drafter's device step writes how many of them that verification rejected (-1: none)
    shift_from: int = -1

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def token_ids(self) -> list[int]:
        """The row's input ids; DEVICE_TOKEN where the device feeds in the previous step's sample. Read it before
        the next update (which turns pending tokens into outputs)."""
        r, end = self.request, self.start + self.num_new_tokens
        known = r.all_token_ids[self.start:end]
        if len(known) == self.num_new_tokens:
            return known
        first = max(self.start, r.num_tokens) - r.num_tokens
        return known + r.pending_token_ids[first:first + self.num_new_tokens - len(known)]

    @property
    def state_slot(self) -> int:
        return self.request.state_slot

    @property
    def device_drafts(self) -> bool:
        """Whether its drafts are ones the device holds (`request.device_input`; their ids come once it is launched)."""
        return bool(self.draft_token_ids) and self.draft_token_ids[0] <= DEVICE_DRAFT

    @property
    def state_write_slot(self) -> int:
        return self.request.state_slot if self.write_slot is None else self.write_slot

    @property
    def state_keep(self) -> int:
        """The row's leading rows after which its slot read keeps the state (its known tokens, before its drafts), where
        it writes the other slot of its pair; 0 elsewhere (module doc: state pairs)."""
        return self.num_new_tokens - len(self.draft_token_ids) if self.write_slot is not None else 0

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def is_last_chunk(self) -> bool:
        return self.needs_sample


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # batch order
    preempted_ids: list[str] = field(default_factory=list)  # preempted during this schedule()
    finished_ids: list[str] = field(default_factory=list)  # finished/aborted since the last schedule()
    # Copies between the HBM and host tiers this schedule decided (evicted pages out, host hits in): the
    # runner launches them before the step's forward.
    kv_transfers: KVTransfers | None = None
    # Forks admitted by this schedule: (source, destination) KV pages and state slots the runner copies
    # before the step's forward.
    fork_pages: list[tuple[int, int]] = field(default_factory=list)
    fork_slots: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager):
        self.config = config
        self.kv = kv_manager
        self.requests: dict[str, Request] = {}  # unfinished requests by id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one is the newest
        self._finished_ids: list[str] = []
        self._forks: dict[str, list[Request]] = {}  # leader id -> its followers, not yet admitted
        self.num_preemptions_total = 0  # (vLLM's num_preemptions)

    # ---- requests in and out -------------------------------------------------------------------

    def add_request(self, request: Request, fork_of: str | None = None) -> None:
        """Queue a request; ValueError if it could never run (too long for the model or the pool).
        `fork_of`: a queued request with the same prompt (not yet computing) that this one forks from once
        the leader has computed all but the prompt's last token (module doc)."""
        rid, n, cfg = request.request_id, request.num_prompt_tokens, self.config
        if rid in self.requests:
            raise ValueError(f"request_id={rid!r} is already in use")
        if request.status != RequestStatus.WAITING or request.num_output_tokens:
            raise ValueError(f"request {rid!r} is not a fresh request (status {request.status.value})")
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is None:
            if n >= cfg.max_model_len:
                raise ValueError(f"request {rid!r}: prompt of {n} tokens leaves no room to generate "
                                 f"within max_model_len={cfg.max_model_len}")
            max_tokens = cfg.max_model_len - n
        elif n + max_tokens > cfg.max_model_len:
            raise ValueError(f"request {rid!r}: prompt of {n} tokens + max_tokens={max_tokens} exceeds "
                             f"max_model_len={cfg.max_model_len}")
        # The last sampled token is never fed back, so it needs no KV slot.
        pages = self.kv.pages_needed(n + max_tokens - 1)
        if pages > self.kv.num_usable_pages:
            raise ValueError(f"request {rid!r}: {n} prompt + {max_tokens} output tokens need {pages} KV "
                             f"pages but the cache has {self.kv.num_usable_pages}")
        if fork_of is not None:
            leader = self.requests.get(fork_of)
            if leader is None or leader.status != RequestStatus.WAITING or leader.num_computed_tokens \
                    or leader.prompt_token_ids != request.prompt_token_ids or n < 2:
                raise ValueError(f"request {rid!r} cannot fork from {fork_of!r}: not a queued request with the same "
                                 f"prompt of at least 2 tokens")
            self.requests[rid] = request
            self._forks.setdefault(fork_of, []).append(request)
            return
        self.requests[rid] = request
        self.waiting.append(request)

    def finish_request(self, request_id: str, reason: FinishReason,
                       stop_reason: int | str | None = None) -> Request | None:
        """Finish a request now (stop string, abort, error): frees its pages. None if unknown/finished."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        else:  # a follower not yet forked
            for followers in self._forks.values():
                if request in followers:
                    followers.remove(request)
                    break
        self._finish(request, reason, stop_reason)
        return request

    def abort(self, request_id: str) -> Request | None:
        return self.finish_request(request_id, FinishReason.ABORT)

    def _finish(self, request: Request, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        request.status = reason.status
        request.finish_reason = reason
        request.stop_reason = stop_reason
        self.kv.free(request)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.drop_draft_tokens()
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)

    # ---- one step ------------------------------------------------------------------------------

    def _clamp(self, request: Request, start: int, num_new: int, budget: int) -> int:
        """Tokens to compute this step out of `num_new` remaining from `start`; 0 = cannot run this step. A fork's
        leader stops one token short of its prompt's end (module doc)."""
        if request.request_id in self._forks:
            num_new = min(num_new, request.num_prompt_tokens - 1 - start)
        t = self.config.long_prefill_token_threshold
        if t is not None:
            num_new = min(num_new, t)
        if num_new > budget and not self.config.enable_chunked_prefill:
            return 0
        return min(num_new, budget)

    def _fit_drafts(self, request: Request, start: int, budget: int) -> int:
        """Drop the draft tokens this step cannot verify whole (budget, length limit); the tokens left to compute."""
        drafts = request.num_draft_tokens
        remaining = request.num_tokens + request.num_pending_tokens - start
        if drafts:
            without = remaining - drafts
            fits = self._clamp(request, start, remaining, budget) - without  # drafts the step's row can take
            # positions a draft may take
            room = self._length_limit(request) - 1 - request.num_tokens - request.num_inflight_tokens
            request.drop_draft_tokens(max(0, min(drafts, fits, room)))
            remaining = request.num_tokens + request.num_pending_tokens - start
        return self._clamp(request, start, remaining, budget)

    @staticmethod
    def _scheduled(request: Request, num_new: int, start: int) -> ScheduledRequest:
        """The batch entry; advances the request as if the step had run (its sample pending)."""
        pending = request.pending_token_ids
        num_tokens = len(request.all_token_ids)
        end = num_tokens + len(pending)
        needs_sample = start + num_new == end
        drafts = request.num_draft_tokens if pending else 0
        assert not drafts or (needs_sample and start < end - drafts), request.request_id
        s = ScheduledRequest(request, num_new, start, request.page_ids, needs_sample=needs_sample,
                             input_from_device=start >= num_tokens and pending[start - num_tokens] == DEVICE_TOKEN,
                             num_logits=1 + drafts if needs_sample else 0,
                             draft_token_ids=pending[len(pending) - drafts:] if drafts else [])
        request.num_computed_tokens = start + num_new
        if needs_sample:
            request.pending_token_ids.append(DEVICE_TOKEN)
        return s

    def _length_limit(self, request: Request) -> int:
        """The most tokens the request may hold: prompt + max_tokens, within max_model_len."""
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is None:
            return self.config.max_model_len
        return min(self.config.max_model_len, request.num_prompt_tokens + max_tokens)

    def _reaches_length(self, request: Request, pending: int = 0) -> bool:
        """max_tokens or max_model_len is reached, counting `pending` tokens not yet read back."""
        return request.num_tokens + pending >= self._length_limit(request)

    def schedule(self, max_tokens: int | None = None, max_seqs: int | None = None,
                 past_drafts: bool = False) -> SchedulerOutput:
        """One step's work. `max_tokens` / `max_seqs`: tighter limits for this step (the executables ready
        while a staged warm-up compiles the rest). `past_drafts`: requests whose drafts a step in flight verifies are
        scheduled too, as if it keeps them all (module doc: verifications in flight)."""
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        budget = min(self.config.max_num_batched_tokens, max_tokens or self.config.max_num_batched_tokens)
        max_seqs = max_seqs or self.config.max_num_seqs

        if self._forks:
            self._fork(out)
        i = 0
        while i < len(self.running) and budget > 0 and len(out.scheduled) < max_seqs:
            request = self.running[i]
            # A pending token that may end the request (length) needs no decode: wait until it is read.
            sampling = request.num_inflight_tokens
            if sampling and self._reaches_length(request, sampling):
                request.drop_draft_tokens()
                i += 1
                continue
            if sampling and not past_drafts and request.has_drafts_in_flight:  # its row starts where they end
                i += 1
                continue
            start = request.num_computed_tokens
            num_new = self._fit_drafts(request, start, budget)
            if num_new == 0:
                i += 1
                continue
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running.pop()  # newest; never one scheduled earlier in this loop
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is request:  # it was the newest itself: nothing left to schedule
                    break
            if request.status != RequestStatus.RUNNING:
                break
            out.scheduled.append(self._scheduled(request, num_new, request.num_computed_tokens))
            budget -= num_new
            i += 1

        # Admitting while others were just preempted would only thrash.
        while (not out.preempted_ids and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs and len(out.scheduled) < max_seqs):
            request = self.waiting[0]
            if request.num_sampling_tokens:  # preempted with a token in flight: wait until it is read
                break
            # A cached prefix has no logits: prompt logprobs compute the whole prompt (as vLLM does).
            computed, num_cached = (([], 0) if request.sampling_params.prompt_logprobs is not None
                                    else self.kv.get_computed_pages(request))
            num_new = self._fit_drafts(request, num_cached, budget)
            if num_new == 0 or not self.kv.allocate_slots(request, num_new, computed):
                break  # FIFO: nobody overtakes the head of the queue
            self.waiting.popleft()
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_cached
                request.first_scheduled_time = time.time()  # wall clock, as vLLM's RequestOutput.metrics
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(self._scheduled(request, num_new, num_cached))
            budget -= num_new
        if self.kv.state_pairs:  # a row verifying drafts writes the other slot of its pair (module doc), and so does
            for s in out.scheduled:  # one after drafts in flight (the device may swap the two)
                if (s.draft_token_ids or (past_drafts and s.input_from_device)) and s.state_slot:
                    s.write_slot = self.kv.other_slot(s.state_slot)
        out.kv_transfers = self.kv.take_transfers()
        return out

    def _fork(self, out: SchedulerOutput) -> None:
        """Admit the followers of each leader that has computed all but its prompt's last token (module doc);
        release those of a leader that is gone, or that cannot fork, to the front of the waiting queue."""
        for leader_id in list(self._forks):
            leader = self.requests.get(leader_id)  # None: finished or aborted
            if leader is not None and not (leader.status == RequestStatus.RUNNING
                                           and leader.num_computed_tokens == leader.num_prompt_tokens - 1):
                continue  # still computing (or preempted, recomputing): wait
            released = []
            for follower in self._forks.pop(leader_id):
                point = follower.num_prompt_tokens - 1
                copies = (self.kv.fork(leader, follower, point)
                          if leader is not None and len(self.running) < self.config.max_num_seqs else None)
                if copies is None:
                    released.append(follower)
                    continue
                page_copy, slot_copy = copies
                if page_copy is not None:
                    out.fork_pages.append(page_copy)
                if slot_copy is not None:
                    out.fork_slots.append(slot_copy)
                follower.status = RequestStatus.RUNNING
                follower.num_computed_tokens = follower.num_cached_tokens = point
                follower.first_scheduled_time = time.time()
                self.running.append(follower)
            self.waiting.extendleft(reversed(released))

    def update(self, out: SchedulerOutput, accepted: dict[str, list[int]]) -> list[Request]:
        """Apply a step's results: append each sequence's accepted tokens (1 to `s.num_logits` of them, required
        for every `s.needs_sample` of a request still unfinished), roll back over rejected drafts, enter newly full
        pages in the prefix cache, finish requests that hit a stop condition (tokens after the stop are dropped).
        Returns those. Requests finished meanwhile (abort, stop string, a stop in the previous step) are skipped:
        their tokens are dropped."""
        finished = []
        for s in out.scheduled:
            request = s.request
            if s.needs_sample:  # this row's drafts and its sample lead the pending tokens (steps apply in order)
                assert request.pending_token_ids[s.num_logits - 1] == DEVICE_TOKEN, request.request_id
                del request.pending_token_ids[:s.num_logits]
            if request.is_finished:
                continue
            stop = None
            if s.needs_sample:
                try:
                    tokens = accepted[request.request_id]
                except KeyError:
                    raise KeyError(f"no accepted tokens for request {request.request_id!r}") from None
                if not 1 <= len(tokens) <= s.num_logits:
                    raise ValueError(f"request {request.request_id!r}: {len(tokens)} accepted tokens from a row of "
                                     f"{s.num_logits} logits (must be 1 to {s.num_logits})")
                rejected = s.num_logits - len(tokens)
                if rejected and request.status == RequestStatus.RUNNING:  # their KV is garbage: recompute from there
                    if (s.write_slot is not None and request.state_slot and not request.num_sampling_tokens
                            and s.shift_from < 0):  # (a row moved back on the device: its start is not the host's)
                        request.num_computed_tokens = s.start + s.state_keep  # on from the state its slot kept
                    else:  # (a step in flight past them: the device moved its row back as many)
                        request.num_computed_tokens -= rejected
                elif s.write_slot is not None and request.state_slot and s.num_logits > 1:  # every draft kept: the
                    request.state_slot = self.kv.other_slot(request.state_slot)  # state the row wrote (none: both same)
                for token in tokens:
                    request.append_output_token(token)
                    if (stop := self._check_stop(request)) is not None:
                        break
            self.kv.cache_full_pages(request)
            if stop is not None:
                if request.status != RequestStatus.RUNNING:  # preempted while its token was in flight
                    self.waiting.remove(request)
                self._finish(request, *stop)
                finished.append(request)
        if finished:
            self.running = [r for r in self.running if not r.is_finished]
        return finished

    def _check_stop(self, request: Request) -> tuple[FinishReason, int | None] | None:
        sp = request.sampling_params
        n_out = request.num_output_tokens
        if n_out >= sp.min_tokens:
            token = request.output_token_ids[-1]
            if not sp.ignore_eos and token in request.eos_token_ids:
                return FinishReason.STOP, None
            if token in sp.stop_token_ids:
                return FinishReason.STOP, token
        if self._reaches_length(request):
            return FinishReason.LENGTH, None
        return None

    # ---- stats ---------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + sum(map(len, self._forks.values()))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def max_pages_per_seq(self) -> int:
        """Page-table width the runner needs: pages for max_model_len tokens."""
        return self.kv.pages_needed(self.config.max_model_len)

    def stats(self) -> dict[str, float]:
        return {
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "num_preemptions_total": self.num_preemptions_total,
            "kv_cache_usage": self.kv.usage,
            "prefix_cache_hit_rate": self.kv.prefix_cache_hit_rate,
            "prefix_cache_queries": self.kv.num_query_tokens,
            "prefix_cache_hits": self.kv.num_hit_tokens + self.kv.num_host_hit_tokens,
            "prefix_cache_hbm_hits": self.kv.num_hit_tokens,
            "prefix_cache_host_hits": self.kv.num_host_hit_tokens,
            "prefix_cache_hbm_hit_rate": self.kv.num_hit_tokens / max(self.kv.num_query_tokens, 1),
            "prefix_cache_host_hit_rate": self.kv.num_host_hit_tokens / max(self.kv.num_query_tokens, 1),
        }

"""Speculative decoding in the engine: drafts proposed before each schedule, checked against the grammar, and the
counters of what was drafted and accepted.

The step (EngineCore): before scheduling, the requests that are running, past their prefill and have no token in
flight get a draft from the `Proposer` (`propose`), as pending tokens (`Request.add_draft_tokens`); the scheduler
fits them into the request's row (dropping those the budget or the length limit has no room for), the step computes
the row and samples a token at every position, and `accept_draft_tokens` keeps the drafts while they equal the
samples, then the first differing sample (or the bonus one after the last draft). `update` rolls back over the
rejected drafts; their KV is overwritten later and never enters the prefix cache (only computed, accepted tokens do).

Exactness. Drafts are deterministic: the draft distribution q is one-hot on the draft d. The standard rule accepts d
with probability min(1, p(d)/q(d)) = p(d), and on rejection samples from the residual norm(max(0, p - q)), which is
p with d removed and renormalised. Sampling y ~ p at the position and accepting when y == d does exactly that:
P(accept) = p(d), and given rejection, y is distributed as p restricted to y != d. So each emitted token is a
sample of the target distribution p at its position (given the tokens before it), and after the last draft the
bonus token is a plain sample. The sampler keys its noise by (seed, output index, token) (jinfer/engine/sampler.py),
so the sample at an output index is the same whether the step verifies drafts or decodes one token: a seeded
request gives the same tokens with and without speculation (greedy ones trivially), up to floating-point
differences of the logits between a one-token and a multi-token row. Penalties, min_tokens and grammar masks
are computed per position as if the drafts before it were outputs (batch_builder.logits_rows, `grammar_masks`).

Async scheduling: a request's drafts need its last token, which with one step in flight is still on the device. An
engine with a proposer reads each step back before scheduling the next (as vLLM did before it combined the two), and
builds that step's outputs (text, stop strings, logprobs) once the next is launched, while the device runs it;
the scheduler also never schedules a request past drafts still in flight (its rows would start from a token the
verification may reject). A model drafter's head runs behind the step on the device; its drafts are scheduled
without their ids (`request.device_input`: the next step reads them from the device, penalties' samplers too) and
get them once that step is dispatched, so the host does not wait for the head between two steps.

Structured outputs: a draft is cut at the first token its sequence's grammar forbids (`LLMatcher.validate_tokens`)
before it is scheduled; the mask of each verified position is the matcher's after the drafts before it (llguidance
advances through them and rolls back).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jinfer.engine.request import accept_draft_tokens
from jinfer.engine.sampling_tensors import uses_penalties
from jinfer.spec.proposer import Proposer


class SpecDecoding:
    def __init__(self, proposer: Proposer):
        self.proposer = proposer
        self.k = proposer.k
        self.num_drafts = 0  # verifications (a sequence's row with >= 1 draft)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = np.zeros(self.k, np.int64)  # accepted drafts at position 0..k-1
        self.num_overlapped_steps = 0  # steps launched before the step in flight was read back (`shift_rows`)
        # The benchmark-only replay drafter decides acceptance itself (jinfer/spec/replay.py); every other drafter's
        # drafts are accepted by the exact rule (module doc).
        self._forced = proposer.forced_accept if getattr(proposer, "forced", False) else None

    def can_overlap(self, running: Sequence, seqs: dict) -> bool:
        """Whether the next step may be launched before the step in flight is read back (EngineCore, module doc): the
        drafter's drafts stay on the device and every request that step samples allows it: no host work needs its
        tokens first (a grammar, bad words, penalties, min_tokens still due), and on a model with states it drafts
        one token a step (its next row is then the same whatever is kept: the state after the row's first token)."""
        in_flight = getattr(self.proposer, "in_flight", None)
        if in_flight is None or not getattr(self.proposer, "device_drafts", False):
            return False
        for r in running:
            if not r.num_sampling_tokens:
                continue
            seq = seqs[r.request_id]
            if (seq.needs_tokens or not in_flight(r) or uses_penalties(seq.params)
                    or seq.params.min_tokens > r.num_output_tokens or (r.state_slot and self.k > 1)):
                return False
        return True

    def propose(self, running: Sequence, seqs: dict, overlap: bool = False) -> None:
        """Draft the running requests that have no token in flight and are past their prefill (their next step is a
        decode of their last token, or on a model with states the recompute of a row rolled back); `seqs`: the core's
        sequence states (grammar matchers). `overlap` (`can_overlap`): also those the step in flight samples, after
        its tokens as if it keeps every draft (`shift_rows`)."""
        # (a model with states: also a sequence rolled back over a rejected draft, whose row recomputes the accepted
        # tokens, or one recomputing after preemption; its drafts follow those tokens, dropped where they do not fit)
        ready = [r for r in running if (not r.pending_token_ids and (r.num_computed_tokens == r.num_tokens - 1
                                                                    or (r.state_slot and r.num_output_tokens)))
                 or (overlap and r.num_sampling_tokens)]
        # A model drafter hands its drafts over as the device holds them (the next step reads them there: the host
        # waits for no head) where no host work needs their ids first: a grammar's, a multi-token bad word's
        if getattr(self.proposer, "device_drafts", False):
            drafts = self.proposer.propose(ready, [not seqs[r.request_id].needs_tokens for r in ready])
        else:
            drafts = self.proposer.propose(ready)
        for r, draft in zip(ready, drafts, strict=True):
            if not draft:
                continue
            draft = draft[:self.k]
            matcher = seqs[r.request_id].matcher
            if matcher is not None:  # drafts end at the first token the grammar forbids
                draft = draft[:matcher.validate_tokens(draft)] if not matcher.is_stopped() else []
            if draft:
                r.add_draft_tokens(draft)

    def shift_rows(self, out) -> None:
        """A step scheduled before the step in flight is read back: each row that follows a verification in flight
        moves back on the device by the drafts it rejects, read from the row of the sampled ids the drafter's step
        writes that count to (`ScheduledRequest.shift_from`)."""
        self.num_overlapped_steps += 1
        rows = self.proposer.shift_rows
        for s in out.scheduled:
            if s.input_from_device:
                if s.request_id not in rows:
                    raise RuntimeError(f"request {s.request_id!r}: scheduled after a verification in flight that its "
                                       "drafter did not draft")
                s.shift_from = rows[s.request_id]

    def accept(self, request_id: str, draft_ids: list[int], sampled_ids: list[int]) -> list[int]:
        """The tokens a verification keeps (`request.accept_draft_tokens`)."""
        if self._forced is not None:
            accepted = self._forced(request_id, draft_ids, sampled_ids)
        else:
            accepted = accept_draft_tokens(draft_ids, sampled_ids)
        if (hook := getattr(self.proposer, "accepted", None)) is not None:  # (a model drafter's check of its chain)
            hook(request_id, len(accepted) - 1)
        return accepted

    def prepare(self, out, built):
        """A step's batch is built, nothing dispatched yet (`ModelRunner.launch`): a model drafter returns what
        launches its device step behind the target's (spec/eagle.py); None without one."""
        if (hook := getattr(self.proposer, "prepare", None)) is not None:
            return hook(out, built)
        return None

    def record(self, num_drafts: int, accepted: list[int]) -> int:
        """Count one verification of `num_drafts` drafts that accepted `accepted` tokens (drafts matched + 1); the
        drafts accepted."""
        matched = len(accepted) - 1
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += matched
        self.accepted_per_pos[:matched] += 1
        return matched

    def stats(self) -> dict[str, float]:
        """vLLM's counters: spec_decode_num_drafts, _num_draft_tokens, _num_accepted_tokens, and the accepted drafts
        per position (spec_decode_num_accepted_tokens_per_pos_<i>)."""
        return {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
                **{f"spec_decode_num_accepted_tokens_per_pos_{i}": int(n)
                   for i, n in enumerate(self.accepted_per_pos)}}


def grammar_masks(grammar, guided: list, num_rows: int) -> np.ndarray:
    """i32[num_rows, ceil(V/32)] token masks, one per logits row: `guided` holds (matcher, first row, drafts) of each
    constrained sequence; its rows get the matcher's mask after each prefix of its drafts. All ones elsewhere."""
    plain = [(m, row) for m, row, drafts in guided if not drafts]
    masks = grammar.fill_masks(plain, num_rows)
    for matcher, row, drafts in guided:
        if drafts:
            grammar.fill_draft_masks(matcher, drafts, masks, row)
    return masks

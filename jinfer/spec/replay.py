"""A drafter for tests and benchmarks (not a `speculative_config` method): it replays a recorded continuation of each
prompt with a chosen acceptance.

`record` a prompt's output from a run without drafts; later runs of the same prompt are drafted from it (a prompt
with no recording is drafted from its own last tokens). Two modes:
- exact (tests): each draft token is the recorded one with probability `acceptance`, else a wrong one (the recorded
  token - 1, or 1 for token 0), and the engine's exact rule decides, so the output is the target's own;
- `forced` (benchmarks): on random weights the target's greedy tokens are near-ties that a verification row's
  arithmetic (other kernels than a one-token decode) flips, so a recorded continuation is not reproduced and real
  acceptance is ~0. The drafter then decides each verification's outcome when it drafts (k Bernoulli(acceptance)
  trials up to the first failure) and `forced_accept` keeps that many drafts plus the target's sample after them:
  the engine does exactly the work of a verification that accepted them; only the tokens are not the target's.
With per-token acceptance p and k drafts the mean acceptance length is 1 + p + p^2 + ... + p^k.

`ForcedAcceptance` forces the same outcomes on another drafter's drafts (a model head's: EAGLE-3's, Qwen3.5's MTP
layer's), so a benchmark on random weights pays the head's own device work too.
"""

from __future__ import annotations

import zlib
from collections import deque
from collections.abc import Sequence

import numpy as np


class _Trials:
    """k Bernoulli(acceptance) trials per drafted request, and (forced) the leading successes each request's next
    verification accepts."""

    def __init__(self, k: int, acceptance: float, seed: int):
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance={acceptance} must be in [0, 1]")
        self.k, self.acceptance = k, acceptance
        self.planned: dict[str, int] = {}  # request id -> drafts its next verification accepts
        self._rng = np.random.default_rng(seed)

    def draw(self, count: int) -> list[list[bool]]:
        return (self._rng.random((count, self.k)) < self.acceptance).tolist()

    def plan(self, request_id: str, right: list[bool]) -> None:
        self.planned[request_id] = right.index(False) if False in right else self.k

    def accept(self, request_id: str, draft_ids: Sequence[int], sampled_ids: Sequence[int]) -> list[int]:
        """The planned number of drafts and the target's sample after them."""
        a = min(self.planned.pop(request_id, 0), len(draft_ids))
        return [*map(int, draft_ids[:a]), int(sampled_ids[a])]


class ReplayProposer:
    def __init__(self, num_speculative_tokens: int, acceptance: float, seed: int = 0, forced: bool = False):
        self._trials = _Trials(num_speculative_tokens, acceptance, seed)
        self.k, self.acceptance, self.forced = num_speculative_tokens, acceptance, forced
        self._recorded: dict[tuple[int, ...], list[int]] = {}
        self._of: dict[str, list[int] | None] = {}  # request id -> its recording (looked up once)

    def record(self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> None:
        self._recorded[tuple(prompt_token_ids)] = list(output_token_ids)

    def propose(self, requests: Sequence) -> list[list[int]]:
        # (lists, not numpy per request: this runs in series with the device, before every verify step)
        trials = self._trials.draw(len(requests))
        drafts = []
        for r, right in zip(requests, trials):
            rec = self._of.get(r.request_id, 0)
            if rec == 0:
                rec = self._of[r.request_id] = self._recorded.get(tuple(r.prompt_token_ids))
            n = r.num_output_tokens
            draft = rec[n:n + self.k] if rec is not None else r.all_token_ids[-self.k:]
            if self.forced:  # leading successes
                self._trials.plan(r.request_id, right)
            elif rec is not None:
                draft = [t if ok else (t - 1 if t else 1) for t, ok in zip(draft, right)]
            else:
                draft = []
            drafts.append(draft)
        return drafts

    def forced_accept(self, request_id: str, draft_ids: Sequence[int], sampled_ids: Sequence[int]) -> list[int]:
        """Forced mode: the tokens a verification keeps, the planned number of drafts and the target's sample after
        them."""
        return self._trials.accept(request_id, draft_ids, sampled_ids)


class ForcedAcceptance:
    """Benchmarks: `inner`'s drafts (its real work, a model head's device step included), each verification keeping
    a planned number of them as the forced replay drafter does (module doc), then the target's sample. The plan is
    drawn when a row with drafts is launched, from the request's own random stream (the same outcomes whatever the
    other requests do), and used when it is read back, in launch order per request (the next step may be launched
    before one is read back)."""

    forced = True

    def __init__(self, inner, acceptance: float, seed: int = 0):
        self.inner, self.k = inner, inner.k
        self._trials = _Trials(inner.k, acceptance, seed)  # (checks the rate)
        self._seed = seed
        self._streams: dict[str, np.random.Generator] = {}
        self._plans: dict[str, deque[int]] = {}  # request id -> the kept drafts of its launched rows, oldest first

    def __getattr__(self, name):  # (in_flight, shift_rows, accepted, warmup: the inner drafter's)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def device_drafts(self) -> bool:
        return getattr(self.inner, "device_drafts", False)

    def propose(self, requests: Sequence, *on_device) -> list[list[int]]:
        return self.inner.propose(requests, *on_device)

    def prepare(self, out, built):
        """Plan the launched rows' outcomes; what launches the inner drafter's device step, its verifications kept as
        planned (not by the exact rule)."""
        forced = {}
        for s in out.scheduled:  # a request's first rows (its prompt's): what an earlier one of its id left goes
            if not s.draft_token_ids and not s.request.num_output_tokens:
                self._plans.pop(s.request_id, None)
                self._streams.pop(s.request_id, None)
        for rid in (s.request_id for s in out.scheduled if s.draft_token_ids):
            if (stream := self._streams.get(rid)) is None:
                stream = self._streams[rid] = np.random.default_rng([self._seed, zlib.crc32(rid.encode())])
            right = (stream.random(self.k) < self._trials.acceptance).tolist()
            forced[rid] = right.index(False) if False in right else self.k
            self._plans.setdefault(rid, deque()).append(forced[rid])
        if (hook := getattr(self.inner, "prepare", None)) is not None:
            return hook(out, built, forced=forced)
        return None

    def forced_accept(self, request_id: str, draft_ids: Sequence[int], sampled_ids: Sequence[int]) -> list[int]:
        plans = self._plans.get(request_id)
        if not draft_ids or not plans:
            return [int(sampled_ids[0])]
        a = min(plans.popleft(), len(draft_ids))
        return [*map(int, draft_ids[:a]), int(sampled_ids[a])]

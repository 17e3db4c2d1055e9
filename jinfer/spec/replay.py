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
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class ReplayProposer:
    def __init__(self, num_speculative_tokens: int, acceptance: float, seed: int = 0, forced: bool = False):
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance={acceptance} must be in [0, 1]")
        self.k, self.acceptance, self.forced = num_speculative_tokens, acceptance, forced
        self._recorded: dict[tuple[int, ...], list[int]] = {}
        self._of: dict[str, list[int] | None] = {}  # request id -> its recording (looked up once)
        self._planned: dict[str, int] = {}  # forced: request id -> drafts its next verification accepts
        self._rng = np.random.default_rng(seed)

    def record(self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> None:
        self._recorded[tuple(prompt_token_ids)] = list(output_token_ids)

    def propose(self, requests: Sequence) -> list[list[int]]:
        # (lists, not numpy per request: this runs in series with the device, before every verify step)
        trials = (self._rng.random((len(requests), self.k)) < self.acceptance).tolist()
        drafts = []
        for r, right in zip(requests, trials):
            rec = self._of.get(r.request_id, 0)
            if rec == 0:
                rec = self._of[r.request_id] = self._recorded.get(tuple(r.prompt_token_ids))
            n = r.num_output_tokens
            draft = rec[n:n + self.k] if rec is not None else r.all_token_ids[-self.k:]
            if self.forced:  # leading successes
                self._planned[r.request_id] = right.index(False) if False in right else self.k
            elif rec is not None:
                draft = [t if ok else (t - 1 if t else 1) for t, ok in zip(draft, right)]
            else:
                draft = []
            drafts.append(draft)
        return drafts

    def forced_accept(self, request_id: str, draft_ids: Sequence[int], sampled_ids: Sequence[int]) -> list[int]:
        """Forced mode: the tokens a verification keeps, the planned number of drafts and the target's sample after
        them."""
        a = min(self._planned.pop(request_id, 0), len(draft_ids))
        return [*map(int, draft_ids[:a]), int(sampled_ids[a])]

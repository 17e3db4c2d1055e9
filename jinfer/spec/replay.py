"""A drafter for benchmarks only (not a `speculative_config` method): it sets the acceptance itself, so the engine's
cost at a chosen acceptance length is measured on dummy weights.

On random weights the target's greedy tokens are near-ties that a verification row's arithmetic (a multi-token row
runs other kernels than a one-token decode) flips, so a recorded continuation is not reproduced and real acceptance
is ~0. This drafter therefore decides each verification's outcome when it drafts: drafts are the recorded
continuation of the prompt where one was recorded (`record`), else the request's last tokens; the number accepted is
drawn as k Bernoulli(acceptance) trials up to the first failure, and `forced_accept` keeps that many drafts plus the
target's sample at the next position. The engine then does exactly the work of a verification that accepted them
(the row, the rollback of the rest, emitting, the counters); only the tokens are not the target's own choice. With
per-token acceptance p and k drafts the mean acceptance length is 1 + p + p^2 + ... + p^k.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class ReplayProposer:
    def __init__(self, num_speculative_tokens: int, acceptance: float, seed: int = 0):
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance={acceptance} must be in [0, 1]")
        self.k, self.acceptance = num_speculative_tokens, acceptance
        self._recorded: dict[tuple[int, ...], list[int]] = {}
        self._of: dict[str, list[int] | None] = {}  # request id -> its recording (looked up once)
        self._planned: dict[str, int] = {}  # request id -> drafts its next verification accepts
        self._rng = np.random.default_rng(seed)

    def record(self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> None:
        self._recorded[tuple(prompt_token_ids)] = list(output_token_ids)

    def propose(self, requests: Sequence) -> list[list[int]]:
        drafts = []
        trials = self._rng.random((len(requests), self.k)) < self.acceptance
        accepted = np.where(trials.all(axis=1), self.k, np.argmin(trials, axis=1)).tolist()  # leading successes
        for r, a in zip(requests, accepted):
            rec = self._of.get(r.request_id, 0)
            if rec == 0:
                rec = self._of[r.request_id] = self._recorded.get(tuple(r.prompt_token_ids))
            n = r.num_output_tokens
            draft = rec[n:n + self.k] if rec is not None else list(r.all_token_ids[-self.k:])
            self._planned[r.request_id] = a
            drafts.append(draft)
        return drafts

    def forced_accept(self, request_id: str, draft_ids: Sequence[int], sampled_ids: Sequence[int]) -> list[int]:
        """The tokens a verification keeps: the planned number of drafts, then the target's sample after them."""
        a = min(self._planned.pop(request_id, 0), len(draft_ids))
        return [*map(int, draft_ids[:a]), int(sampled_ids[a])]

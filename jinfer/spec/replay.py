"""A drafter for benchmarks only (not a `speculative_config` method): it replays a recorded continuation of each
prompt, so the engine's cost at a chosen acceptance length can be measured on dummy weights.

Record a prompt's greedy output from a run without drafts (`record`); later runs of the same prompt are drafted
from it: each draft token is the recorded one with probability `acceptance`, else a wrong one (the recorded token
- 1, or 1 for token 0), and the target's own samples keep the output on the recording. With per-token acceptance p
and k drafts the mean acceptance length is 1 + p + p^2 + ... + p^k. Prompts with no recording get no drafts.
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
        self._rng = np.random.default_rng(seed)

    def record(self, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> None:
        self._recorded[tuple(prompt_token_ids)] = list(output_token_ids)

    def propose(self, requests: Sequence) -> list[list[int]]:
        drafts = []
        for r in requests:
            rec = self._of.get(r.request_id, 0)
            if rec == 0:
                rec = self._of[r.request_id] = self._recorded.get(tuple(r.prompt_token_ids))
            if rec is None:
                drafts.append([])
                continue
            n = r.num_output_tokens
            draft = rec[n:n + self.k]
            wrong = self._rng.random(len(draft)) >= self.acceptance
            drafts.append([(t - 1 if t else 1) if w else t for t, w in zip(draft, wrong.tolist())])
        return drafts

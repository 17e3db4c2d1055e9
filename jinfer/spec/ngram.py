"""Prompt-lookup drafts (vLLM's `NgramProposer`): a sequence's next tokens guessed from an earlier occurrence of its
last tokens, on the host, no model.

For a sequence's tokens t (prompt + output), find the longest n in [prompt_lookup_min, prompt_lookup_max] such that
its last n tokens occurred before (ending before the last token; occurrences may overlap the suffix), take the
earliest such occurrence, and propose the up-to-k tokens that followed it (k also capped by max_model_len). This is
vLLM's rule (longest match first, then the earliest position), which its KMP search computes.

Cost: per request and step one comparison of the whole sequence with its last token (`t[:-1] == t[-1]`), then the
positions that matched are extended backwards up to prompt_lookup_max tokens (in Python for a few, else one gather
of [matches, prompt_lookup_max]: all positions in a run of one repeated token, still O(len)). Each sequence's tokens
are kept in a growing numpy buffer that only takes the tokens appended since its last proposal, so nothing is
converted from Python lists per step but the new tokens.
benchmarks/bench_ngram.py measures it at 8k-token contexts and batch 64.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int, token_list: list[int] | None = None
                  ) -> np.ndarray:
    """The draft for one sequence `tokens` (1-D int array): up to k tokens, empty when no suffix of length >= min_n
    occurred earlier. `k` is already capped by the room left in the context. `token_list`: the same tokens as a list
    (a few candidates are checked in Python, cheaper than numpy calls on tiny arrays)."""
    L = tokens.shape[0]
    if L < min_n + 1 or k <= 0:
        return tokens[:0]
    ends = np.flatnonzero(tokens[:L - 1] == tokens[L - 1])  # occurrences of the last token, by position
    if ends.size == 0:
        return tokens[:0]
    n = min(max_n, L - 1)
    if token_list is not None and ends.size <= SMALL:
        t = token_list
        best, best_end = 0, 0
        for e in ends.tolist():
            m = 1
            while m < n and m <= e and t[e - m] == t[L - 1 - m]:
                m += 1
            if m > best:  # (strictly longer: the earliest end of the longest match is kept)
                best, best_end = m, e
        longest, end = best, best_end
    else:
        idx = ends[:, None] - np.arange(n)  # [candidates, n]: positions back from each end
        eq = tokens[np.maximum(idx, 0)] == tokens[L - 1 - np.arange(n)]
        eq &= idx >= 0
        length = np.logical_and.accumulate(eq, axis=1).sum(axis=1)  # matched suffix length, capped at n
        longest = int(length.max())
        end = int(ends[np.argmax(length == longest)])  # the earliest occurrence of the longest match
    if longest < min_n:
        return tokens[:0]
    return tokens[end + 1:end + 1 + k]


SMALL = 16  # candidates checked in Python below this many


class NgramProposer:
    """Drafts for a batch of requests (the engine's `Proposer` interface: jinfer/spec/proposer.py)."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int,
                 max_model_len: int):
        self.k, self.min_n, self.max_n = num_speculative_tokens, prompt_lookup_min, prompt_lookup_max
        self.max_model_len = max_model_len
        # request -> (token buffer, tokens in it): grown in place, dropped with the request
        self._buffers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _tokens(self, request) -> np.ndarray:
        ids = request.all_token_ids
        entry = self._buffers.get(request)
        if entry is None:
            buf = np.empty(max(64, 2 * len(ids)), np.int32)
            buf[:len(ids)] = ids
            self._buffers[request] = entry = [buf, len(ids)]
        buf, n = entry
        if n < len(ids):
            if len(ids) > buf.shape[0]:
                grown = np.empty(2 * len(ids), np.int32)
                grown[:n] = buf[:n]
                entry[0] = buf = grown
            buf[n:len(ids)] = ids[n:]
            entry[1] = len(ids)
        return buf[:len(ids)]

    def propose(self, requests: Sequence) -> list[list[int]]:
        """One draft per request (each a list of up to k ids, maybe empty), from its accepted tokens."""
        drafts = []
        for r in requests:
            tokens = self._tokens(r)
            k = min(self.k, self.max_model_len - tokens.shape[0])
            drafts.append(propose_ngram(tokens, self.min_n, self.max_n, k, r.all_token_ids).tolist())
        return drafts

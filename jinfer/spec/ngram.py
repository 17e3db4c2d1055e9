"""Prompt-lookup drafts (vLLM's `NgramProposer`): a sequence's next tokens guessed from an earlier occurrence of its
last tokens, on the host, no model.

For a sequence's tokens t (prompt + output), find the longest n in [prompt_lookup_min, prompt_lookup_max] such that
its last n tokens occurred before (ending before the last token; occurrences may overlap the suffix), take the
earliest such occurrence, and propose the up-to-k tokens that followed it (k also capped by max_model_len). This is
vLLM's rule (longest match first, then the earliest position), which its KMP search computes.

Cost: per request and step one comparison of the whole sequence with its last token (`t[:-1] == t[-1]`), then
`prompt_lookup_max - 1` gathers over the positions that matched (few in text; all of them in a run of one repeated
token, still O(len)). Each sequence's tokens are kept in a growing numpy buffer that only takes the tokens appended
since its last proposal, so nothing is converted from Python lists per step but the new tokens.
benchmarks/bench_ngram.py measures it at 8k-token contexts and batch 64.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import numpy as np


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """The draft for one sequence `tokens` (1-D int array): up to k tokens, empty when no suffix of length >= min_n
    occurred earlier. `k` is already capped by the room left in the context."""
    L = tokens.shape[0]
    if L < min_n + 1 or k <= 0:
        return tokens[:0]
    last = tokens[L - 1]
    ends = np.flatnonzero(tokens[:L - 1] == last)  # occurrences of the 1-gram, by the position they end at
    if ends.size == 0:
        return tokens[:0]
    length = np.ones(ends.size, np.int32)  # matched suffix length at each end, capped at max_n
    alive = np.ones(ends.size, bool)
    for i in range(1, max_n):
        pos = ends - i
        ok = pos >= 0
        alive &= ok
        alive[ok] &= tokens[pos[ok]] == tokens[L - 1 - i]
        if not alive.any():
            break
        length += alive
    longest = int(length.max())
    if longest < min_n:
        return tokens[:0]
    start = int(ends[np.argmax(length == longest)]) + 1  # the earliest occurrence of the longest match
    return tokens[start:start + k]


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
            drafts.append(propose_ngram(tokens, self.min_n, self.max_n, k).tolist())
        return drafts

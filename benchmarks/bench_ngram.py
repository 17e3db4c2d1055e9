"""Host cost of the n-gram drafter (jinfer/spec/ngram.py) per engine step: `NgramProposer.propose` over a batch of
requests with long contexts, each step after one more token was accepted (the incremental buffer takes it).

    python -m benchmarks.bench_ngram --batch 64 --context 8192 --k 4 --min 2 --max 5

Contexts: random tokens over a vocabulary (few matches: the common case), and text that repeats a 50-token phrase
(every position matches: the worst case for the candidate scan). CPU only; prints microseconds per step.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from jinfer.spec.ngram import NgramProposer


class _Req:
    def __init__(self, rid: str, tokens: list[int]):
        self.request_id, self.all_token_ids = rid, tokens


def measure(contexts: list[list[int]], k: int, lo: int, hi: int, steps: int, rng) -> float:
    proposer = NgramProposer(k, lo, hi, max_model_len=1 << 20)
    reqs = [_Req(str(i), list(c)) for i, c in enumerate(contexts)]
    proposer.propose(reqs)  # first sight: buffers filled once
    times = []
    for _ in range(steps):
        for r in reqs:
            r.all_token_ids.append(int(rng.integers(0, 32000)))
        t = time.perf_counter()
        proposer.propose(reqs)
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--min", type=int, default=2)
    ap.add_argument("--max", type=int, default=5)
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rand = [rng.integers(0, 32000, args.context).tolist() for _ in range(args.batch)]
    phrase = rng.integers(0, 32000, 50).tolist()
    rep = [(phrase * (args.context // 50 + 1))[:args.context] for _ in range(args.batch)]
    for name, contexts in (("random", rand), ("repeating", rep)):
        us = measure(contexts, args.k, args.min, args.max, args.steps, rng)
        print(f"{name:9s} batch {args.batch} x {args.context} tokens: {us:.0f} us per step "
              f"({us / args.batch:.1f} us per request)")


if __name__ == "__main__":
    main()

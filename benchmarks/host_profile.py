"""cProfile of the engine's host loop during decode (dummy weights): where a step's host time goes.

    python -m benchmarks.host_profile --shape qwen3-4b --batch-size 1 --out host_profile.txt

Runs one untimed batch (compiles), then a profiled one and an unprofiled one; prints the unprofiled run's median
step time and the profiled run's top functions by own time and by cumulative time. Works on older trees too (the
EngineConfig import falls back to its old place), so two trees' host loops can be compared in one device call.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import numpy as np

try:
    from jinfer.config.engine import EngineConfig
except ImportError:  # a tree from before jinfer/config/
    from jinfer.engine.core import EngineConfig
from jinfer.engine.core import EngineCore
from jinfer.sampling_params import SamplingParams


def run(core, prompts, output_len, tag):
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(f"{tag}-{i}", p, params)
    times = []
    while core.has_unfinished_requests():
        t = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t)
    return float(np.median(times[len(prompts) + 1:]) * 1e3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-4b")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--top", type=int, default=45)
    ap.add_argument("--out")
    args = ap.parse_args()
    core = EngineCore(EngineConfig(model=f"dummy:{args.shape}", dtype="bfloat16",
                                   max_model_len=args.input_len + args.output_len, max_num_seqs=max(args.batch_size, 8),
                                   warmup=False))
    rng = np.random.default_rng(0)
    make = lambda: [rng.integers(0, core.model_config.vocab_size, args.input_len).tolist()  # noqa: E731
                    for _ in range(args.batch_size)]
    run(core, make(), 16, "warm")
    prof = cProfile.Profile()
    prof.enable()
    profiled = run(core, make(), args.output_len, "prof")
    prof.disable()
    plain = [run(core, make(), args.output_len, f"plain{i}") for i in range(2)]
    s = io.StringIO()
    s.write(f"median step ms: unprofiled {plain}, profiled {profiled:.3f}\n")
    stats = pstats.Stats(prof, stream=s)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumtime").print_stats(args.top)
    text = s.getvalue().replace("/usr/local/lib/python3.12/site-packages/", "").replace("/tmp/site/", "")
    print(text)
    if args.out:
        open(args.out, "w").write(text)


if __name__ == "__main__":
    main()

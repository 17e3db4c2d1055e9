"""Host time of one step's sampling set-up (`SamplingTensors.from_params`), no device.

    python -m benchmarks.bench_sampler_host --rows 256 --vocab 248320

Rows sharing one params object (one `generate()` call's requests) and rows with a params object each (a server's
requests); median of --repeat timings of --iters calls each. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from jinfer import SamplingParams
from jinfer.engine.sampling_tensors import SamplingTensors


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    shared = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    cases = {"shared_params": [(shared, list(range(50)), None, None) for _ in range(args.rows)],
             "params_per_row": [(SamplingParams(temperature=0.7, top_p=0.9, seed=i, max_tokens=128), list(range(50)),
                                 None, None) for i in range(args.rows)]}
    stop = [[1, 2]] * args.rows
    result = {"benchmark": "sampler_host", "rows": args.rows}
    for name, rows in cases.items():
        times = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            for _ in range(args.iters):
                SamplingTensors.from_params(rows, args.vocab, num_seqs=args.rows, min_tokens_ids=stop)
            times.append((time.perf_counter() - t) / args.iters * 1e3)
        result[f"{name}_ms"] = round(statistics.median(times), 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

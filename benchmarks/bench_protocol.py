"""Wire protocol micro-benchmark: encode and decode of jinfer's engine protocol (jinfer/engine/protocol.py,
msgspec Structs decoded by msgspec's typed msgpack decoder) on the messages that matter.

    .venv/bin/python -m benchmarks.bench_protocol [--out benchmarks/results/protocol_codec_cpu.json]

Messages: an engine step's Outputs (1 and 256 one-token deltas, and 256 with 5 logprobs each), an AddRequest
of a 1k-token prompt with its SamplingParams. Reported: microseconds per encode and per decode (median of 7
runs of N calls; decode includes the type checks and builds the `EngineOutput`s a client uses) and the frame
sizes. Before the switch to msgspec (protocol 2, hand-checked msgpack, ids packed int32) the same cases were
measured by this script's previous version (git history); the figures are in docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import msgspec

from jinfer.engine import protocol as proto
from jinfer.outputs import EngineOutput
from jinfer.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


def timed(fn, n: int) -> float:
    runs = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(runs)


def cases() -> dict[str, proto.Message]:
    delta = lambda i, lp=None: EngineOutput(f"cmpl-{i:032x}-0", 0, [1234 + i], " word", new_logprobs=lp,
                                            num_prompt_tokens=1000, num_cached_tokens=512)
    lp5 = [{1234: -0.1, 1: -2.0, 2: -3.0, 3: -4.0, 4: -5.0, 5: -6.0}]
    return {
        "outputs_1": proto.Outputs([delta(0)]),
        "outputs_256": proto.Outputs([delta(i) for i in range(256)]),
        "outputs_256_logprobs5": proto.Outputs([delta(i, lp5) for i in range(256)]),
        "add_request_1k": proto.AddRequest("r" * 36, list(range(1000)),
                                           SamplingParams(temperature=0.7, top_p=0.9, stop=["\n\n"], seed=1,
                                                          max_tokens=128).to_dict()),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "protocol_codec_cpu.json"))
    args = ap.parse_args()
    rows = {}
    for name, msg in cases().items():
        n = 20000 if name == "outputs_1" else 300 if "256" in name else 5000
        frame = proto.encode(msg)
        assert proto.decode(frame) == msg
        rows[name] = {"encode_us": round(timed(lambda msg=msg: proto.encode(msg), n), 2),
                      "decode_us": round(timed(lambda frame=frame: proto.decode(frame), n), 2),
                      "frame_bytes": len(frame)}
        print(name, rows[name])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    Path(args.out).write_text(json.dumps({
        "what": "wire protocol codec (msgspec Structs, typed msgpack decoder), protocol "
                f"{proto.PROTOCOL_VERSION}", "script": "benchmarks/bench_protocol.py",
        "commit": commit.stdout.strip(), "msgspec": msgspec.__version__,
        "python": platform.python_version(), "cpu": platform.processor() or platform.machine(),
        "note": "shared 2-core CPU; medians of 7 runs", "cases": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()

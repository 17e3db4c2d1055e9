"""benchmarks.trace_summary.gpu_kernel_times: GPU kernels' time by name from a profiler trace (what
bench_local_step, bench_gemv and bench_decode_mlp report), host spans and other device streams left out."""

from __future__ import annotations

import gzip
import json

from benchmarks.trace_summary import gpu_kernel_times


def test_gpu_kernel_times(tmp_path):
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "thread_name", "pid": 2, "tid": 7, "args": {"name": "Stream #7(Compute)"}},
        {"ph": "M", "name": "thread_name", "pid": 2, "tid": 8, "args": {"name": "Stream #8(MemcpyH2D)"}},
        {"ph": "X", "name": "gemm", "pid": 2, "tid": 7, "ts": 0, "dur": 10.0},
        {"ph": "X", "name": "gemm", "pid": 2, "tid": 7, "ts": 20, "dur": 14.0},
        {"ph": "X", "name": "attn", "pid": 2, "tid": 7, "ts": 40, "dur": 6.0},
        {"ph": "X", "name": "copy", "pid": 2, "tid": 8, "ts": 0, "dur": 99.0},  # not a compute stream
        {"ph": "X", "name": "gemm", "pid": 1, "tid": 1, "ts": 0, "dur": 50.0},  # a host span of the same name
    ]
    old, new = tmp_path / "plugins/profile/1", tmp_path / "plugins/profile/2"
    for d, scale in ((old, 100.0), (new, 1.0)):  # the newest trace is read
        d.mkdir(parents=True)
        scaled = [dict(e, dur=e["dur"] * scale) if "dur" in e else e for e in events]
        with gzip.open(d / "host.trace.json.gz", "wt") as f:
            json.dump({"traceEvents": scaled}, f)
    per, count = gpu_kernel_times(str(tmp_path), per=2)
    assert per == {"gemm": 12.0, "attn": 3.0}
    assert count == 3

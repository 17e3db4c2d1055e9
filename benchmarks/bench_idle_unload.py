"""The first requests after an idle unload against warm ones: `jinfer serve` with a short keep-alive
(`--executable-keep-alive`), streamed greedy completions before and after the engine dropped its idle executables.

    python -m benchmarks.bench_idle_unload [--keep-alive 8] [--requests 3] [--out F] [-- SERVE_ARGS...]

Starts the server (the embedded model unless SERVE_ARGS name one), waits for its staged warm-up to finish, sends
`--requests` requests one after another (warm), waits until the engine logs its idle unload, then sends as many again.
Reports each request's TTFT and TPOT (ms) and the first request after the unload over the warm median.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.bench_startup import ROOT, free_port, wait_for_unloads
from benchmarks.common import write_result
from benchmarks.wait_ready import wait_ready

PROMPT = "Write a short story about a robot learning to paint. " * 8


def wait_log(path: Path, text: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in path.read_text(errors="replace"):
            return True
        time.sleep(0.5)
    return False


def request(url: str, model: str, max_tokens: int, i: int) -> dict:
    """One streamed completion; prompt i's first page differs from every other's (no prefix-cache hits)."""
    t0, times = time.perf_counter(), []
    body = {"model": model, "prompt": f"{i}. {PROMPT}", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter())
    return {"ttft_ms": (times[0] - t0) * 1e3, "tpot_ms": (times[-1] - times[0]) / max(1, len(times) - 1) * 1e3}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--keep-alive", type=float, default=8.0)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out")
    ap.add_argument("serve_args", nargs="*")
    args = ap.parse_args()
    port, log = free_port(), Path(tempfile.mkdtemp()) / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "server.launcher", "--port", str(port), "--executable-keep-alive",
                             str(args.keep_alive), *args.serve_args], cwd=ROOT, stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        if wait_ready(f"{url}/health", timeout=600, proc=proc) is None or not wait_log(log, "token buckets ready", 900):
            raise SystemExit(f"server not ready:\n{log.read_text()[-3000:]}")
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        warm = [request(url, model, args.max_tokens, i) for i in range(args.requests)]
        if not wait_for_unloads(log, proc, args.keep_alive * 4 + 30, 0):  # every idle bucket gone
            raise SystemExit("the engine unloaded nothing")
        after = [request(url, model, args.max_tokens, args.requests + i) for i in range(args.requests)]
    finally:
        proc.terminate()
        proc.wait(30)
    ratio = {k: after[0][k] / statistics.median(r[k] for r in warm) for k in ("ttft_ms", "tpot_ms")}
    print(f"warm {warm}\nafter idle {after}\nfirst after idle / warm median: TTFT {ratio['ttft_ms']:.2f}x, "
          f"TPOT {ratio['tpot_ms']:.2f}x")
    write_result({"benchmark": "idle_unload", "keep_alive_s": args.keep_alive, "serve_args": args.serve_args,
                  "warm": warm, "after_idle": after, "first_after_idle_over_warm": ratio}, args.out)


if __name__ == "__main__":
    main()

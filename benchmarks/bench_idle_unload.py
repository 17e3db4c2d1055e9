"""The first request after an idle unload against warm ones: `jinfer serve` with a short keep-alive
(`--executable-keep-alive`), streamed greedy completions before and after the engine dropped its idle executables.

    python -m benchmarks.bench_idle_unload [--runs 3] [--keep-alive 8] [--requests 3] [--out F] [-- SERVE_ARGS...]

Each run starts a server (the embedded model unless SERVE_ARGS name one), waits for its staged warm-up to finish,
sends `--requests` requests one after another (warm), then leaves it idle until every bucket past its keep-alive was
unloaded (the keep-alive after the last warm request, then no unload for 3 s), reads the server's and engine's RSS,
and sends as many requests again. A run reports each request's TTFT and TPOT (ms), the first request after the
idle spell over the warm median, and the buckets unloaded after the warm requests. `first_after_idle_over_warm`
is the median of the runs' ratios (a process each).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.bench_startup import ROOT, UNLOAD_LINE, descendants, free_port, memory
from benchmarks.common import environment, write_result
from benchmarks.wait_ready import wait_ready

PROMPT = "Write a short story about a robot learning to paint. " * 8


def wait_log(path: Path, text: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in path.read_text(errors="replace"):
            return True
        time.sleep(0.5)
    return False


def wait_unloads_quiet(path: Path, proc: subprocess.Popen, quiet_s: float, timeout: float) -> None:
    """Wait until the log gained no unload line for `quiet_s` (an unload on CPU takes seconds: it may be under way)."""
    deadline = time.monotonic() + timeout
    count, since = path.read_text(errors="replace").count(UNLOAD_LINE), time.monotonic()
    while time.monotonic() - since < quiet_s:
        if time.monotonic() > deadline or proc.poll() is not None:
            raise SystemExit(f"the engine's unloads did not settle:\n{path.read_text()[-3000:]}")
        time.sleep(0.25)
        if (n := path.read_text(errors="replace").count(UNLOAD_LINE)) != count:
            count, since = n, time.monotonic()


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


def one_run(args: argparse.Namespace) -> dict:
    port, log = free_port(), Path(tempfile.mkdtemp()) / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "server.launcher", "--port", str(port), "--executable-keep-alive",
                             str(args.keep_alive), *args.serve_args], cwd=ROOT, stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        if wait_ready(f"{url}/health", timeout=900, proc=proc) is None or not wait_log(log, "token buckets ready", 900):
            raise SystemExit(f"server not ready:\n{log.read_text()[-3000:]}")
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        warm = [request(url, model, args.max_tokens, i) for i in range(args.requests)]
        lines = len(log.read_text(errors="replace").splitlines())
        time.sleep(args.keep_alive + 2.0)  # every bucket the warm requests did not use is past its keep-alive
        wait_unloads_quiet(log, proc, 3.0, 120.0)
        text = log.read_text(errors="replace")
        if UNLOAD_LINE not in text:
            raise SystemExit(f"the engine unloaded nothing:\n{text[-3000:]}")
        unloaded = [line.split(": ", 2)[-1] for line in text.splitlines()[lines:] if UNLOAD_LINE in line]
        procs = [m for m in map(memory, [proc.pid, *descendants(proc.pid)]) if m]
        rss = {"server" if m["pid"] == proc.pid else m["role"]: m["rss_mb"] for m in procs}
        after = [request(url, model, args.max_tokens, args.requests + i) for i in range(args.requests)]
    finally:
        proc.terminate()
        proc.wait(30)
    ratio = {k: after[0][k] / statistics.median(r[k] for r in warm) for k in ("ttft_ms", "tpot_ms")}
    print(f"warm {warm}\nafter idle {after}\nunloaded after the warm requests: {unloaded}\nidle RSS {rss} MB\n"
          f"first after idle / warm median: TTFT {ratio['ttft_ms']:.2f}x, TPOT {ratio['tpot_ms']:.2f}x",
          file=sys.stderr)
    return {"warm": warm, "after_idle": after, "unloaded_after_warm": unloaded, "idle_rss_mb": rss,
            "first_after_idle_over_warm": ratio}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=1, help="server processes, one after another")
    ap.add_argument("--keep-alive", type=float, default=8.0)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out")
    ap.add_argument("serve_args", nargs="*")
    args = ap.parse_args()
    for name in ("runs", "requests", "max_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.keep_alive <= 0:
        ap.error(f"--keep-alive={args.keep_alive} must be > 0 (0 never unloads)")
    runs = [one_run(args) for _ in range(args.runs)]
    ratio = {k: statistics.median(r["first_after_idle_over_warm"][k] for r in runs) for k in ("ttft_ms", "tpot_ms")}
    print(f"first after idle / warm median, median of {len(runs)} runs: TTFT {ratio['ttft_ms']:.2f}x "
          f"({', '.join(f'{r['first_after_idle_over_warm']['ttft_ms']:.2f}' for r in runs)}), "
          f"TPOT {ratio['tpot_ms']:.2f}x", file=sys.stderr)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # (no server runs now: JAX may start)
    write_result({**environment(), "benchmark": "idle_unload", "keep_alive_s": args.keep_alive,
                  "serve_args": args.serve_args, "max_tokens": args.max_tokens,
                  "first_after_idle_over_warm": ratio, "runs": runs}, args.out)


if __name__ == "__main__":
    main()

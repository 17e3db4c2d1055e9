"""Summarize a Perfetto trace written by a benchmark's `--profile DIR` (engine steps on the host, GPU kernels).

    python -m benchmarks.trace_summary path/to/*.trace.json.gz [--skip 2] [--top 20]

For the engine steps (`EngineCore.step` spans) after the first `--skip`: the step time, the GPU's
busy time and kernel count per step, the longest host phases inside one step, and the kernels that
take the most GPU time per step. Writes nothing; prints a table.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json


def load(path: str) -> tuple[list[dict], dict, dict]:
    with gzip.open(path) if path.endswith(".gz") else open(path) as f:
        events = json.load(f)["traceEvents"]
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e["name"] == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e["name"] == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    return [e for e in events if e.get("ph") == "X"], procs, threads


def gpu_kernel_times(trace_dir: str, per: float = 1.0) -> tuple[dict[str, float], int]:
    """GPU kernel time by kernel name (us, divided by `per`: calls or steps) and the number of kernels, from the
    newest trace a `jax.profiler.trace(trace_dir)` wrote."""
    import glob

    spans, procs, threads = load(sorted(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True))[-1])
    out: dict[str, float] = {}
    count = 0
    for e in spans:
        if procs.get(e["pid"], "").startswith("/device") and "Compute" in threads.get((e["pid"], e["tid"]), ""):
            out[e["name"]] = out.get(e["name"], 0.0) + e["dur"] / per
            count += 1
    return out, count


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--skip", type=int, default=2, help="engine steps to skip at the start (prefill, warm-up)")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--count", type=int, default=0,
                    help="only this many steps after --skip (e.g. --skip 0 --count 1: the first, a prefill)")
    ap.add_argument("--steps", type=int, default=0,
                    help="a trace without engine steps (bench_parallel's): per device, every kernel's time over "
                         "this many steps")
    args = ap.parse_args()
    spans, procs, threads = load(args.trace)
    if args.steps:
        return per_device(spans, procs, threads, args.steps, args.top)
    steps = sorted((e for e in spans if e["name"].endswith(" step") and "core.py" in e["name"]),
                   key=lambda e: e["ts"])[args.skip:]
    if args.count:
        steps = steps[:args.count + 1]  # the window ends where the step after the last one begins
    if len(steps) < 2:
        raise SystemExit(f"{len(steps)} engine steps after --skip {args.skip}: nothing to summarize")
    gpu = [e for e in spans if procs.get(e["pid"], "").startswith("/device")
           and "Compute" in threads.get((e["pid"], e["tid"]), "")]
    host = [e for e in spans if threads.get((e["pid"], e["tid"])) == "python3"]
    lo, hi = steps[0]["ts"], steps[-1]["ts"]
    n = len(steps) - 1
    in_window = [e for e in gpu if lo <= e["ts"] < hi]
    busy = sum(e["dur"] for e in in_window)
    print(f"{n} steps: {(hi - lo) / n / 1e3:.2f} ms per step, GPU busy {busy / n / 1e3:.2f} ms per step, "
          f"{len(in_window) / n:.0f} kernels per step")

    mid = steps[(len(steps) - 1) // 2]  # (a step of the window: with --count 1, the step measured)
    print("\nhost phases of one step (>= 0.1 ms), ms from its start:")
    for e in sorted((e for e in host if mid["ts"] <= e["ts"] < mid["ts"] + mid["dur"] and e["dur"] >= 100),
                    key=lambda e: e["ts"]):
        print(f"  {(e['ts'] - mid['ts']) / 1e3:7.2f} +{e['dur'] / 1e3:6.2f}  {e['name'][:90]}")

    count, total = collections.Counter(), collections.Counter()
    for e in in_window:
        count[e["name"]] += 1
        total[e["name"]] += e["dur"]
    print(f"\nGPU time per step by kernel (top {args.top}):")
    for name, t in total.most_common(args.top):
        print(f"  {t / n:9.1f} us  x{count[name] / n:5.1f}  {name[:90]}")


def idle_gaps(evs: list[dict], n: int = 1, top: int = 6) -> None:
    """Where the device waits: the gaps between one kernel's end and the next one's start, by size; then the gaps
    over 100 us by the kernels around them (the one before -> the one after), per step of `n`."""
    evs = sorted(evs, key=lambda e: e["ts"])
    end, gaps, around = evs[0]["ts"] + evs[0]["dur"], [], collections.Counter()
    for prev, e in zip(evs, evs[1:]):
        gaps.append(max(e["ts"] - end, 0))
        if gaps[-1] > 100:
            around[f"{prev['name'][:45]} -> {e['name'][:45]}"] += gaps[-1]
        end = max(end, e["ts"] + e["dur"])
    span = end - evs[0]["ts"]
    edges = (0, 10, 100, 1000, 10000, float("inf"))  # us
    parts = []
    for a, b in zip(edges, edges[1:]):
        sel = [g for g in gaps if a < g <= b]
        parts.append(f"({a:g}, {b:g}] us: {len(sel)} gaps, {sum(sel) / 1e3:.1f} ms")
    print(f"  idle {sum(gaps) / 1e3:.1f} ms of {span / 1e3:.1f} ms ({sum(gaps) / span:.1%}); " + "; ".join(parts))
    for where, t in around.most_common(top):
        print(f"    gaps > 100 us: {t / n:8.1f} us per step  {where}")


def per_device(spans: list[dict], procs: dict, threads: dict, n: int, top: int) -> None:
    """Each device's kernels (all streams) over `n` steps: span, busy time, and the top kernels; then the host's
    (XLA runtime) events per step: how often each one ran and its time (command buffers launched / updated)."""
    host = [e for e in spans if procs.get(e["pid"], "").startswith("/host")]
    count, total = collections.Counter(), collections.Counter()
    for e in host:
        count[e["name"]] += 1
        total[e["name"]] += e["dur"]
    print(f"host events per step (top {top}, all threads):")
    for name, t in total.most_common(top):
        print(f"  {t / n:9.1f} us  x{count[name] / n:6.1f}  {name[:100]}")
    for pid in sorted({e["pid"] for e in spans if procs.get(e["pid"], "").startswith("/device")}):
        by_thread = collections.Counter()
        for e in spans:
            if e["pid"] == pid:
                by_thread[threads.get((pid, e["tid"]), str(e["tid"]))] += e["dur"]
        print(f"{procs[pid]} streams: " + ", ".join(f"{name} {t / n:.0f} us" for name, t in by_thread.most_common(8)))
        evs = [e for e in spans if e["pid"] == pid and "Compute" in threads.get((e["pid"], e["tid"]), "")]
        if not evs:
            continue
        lo, hi = min(e["ts"] for e in evs), max(e["ts"] + e["dur"] for e in evs)
        count, total = collections.Counter(), collections.Counter()
        for e in evs:
            count[e["name"]] += 1
            total[e["name"]] += e["dur"]
        print(f"{procs[pid]}: {(hi - lo) / n / 1e3:.2f} ms per step first to last kernel, busy "
              f"{sum(total.values()) / n / 1e3:.2f} ms, {len(evs) / n:.0f} kernels per step")
        idle_gaps(evs, n)
        for name, t in total.most_common(top):
            print(f"  {t / n:9.1f} us  x{count[name] / n:5.1f}  {name[:100]}")


if __name__ == "__main__":
    main()

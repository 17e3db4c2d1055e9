"""Which allocation moves a command buffer between steps: reads a log of XLA's CUDA-pool allocator and command-buffer
thunks (the engine's default allocator) and prints, per engine step (host_profile's JINFER_STEP_MARK lines), the
allocations and frees since the
last one, which of them re-recorded their command buffer, and the allocation sizes seen at more than one address.

    JINFER_STEP_MARK=1 TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3,gpu_cudamallocasync_allocator=10 \
        python -m benchmarks.host_profile --shape qwen3-8b-fp8 --batch-size 1 --output-len 48 --runs 1 > LOG 2>&1
    python -m benchmarks.cb_alloc_trace LOG --steps 40

An execution's temp buffer is allocated just before its thunks run and freed (stream-ordered) just after; an update
(`U<commands>`) means one of the command buffer's allocations (usually that temp) is not where it was last time.
"""

from __future__ import annotations

import argparse
import collections
import re

ALLOC = re.compile(r"Allocated (\d+) at (0x[0-9a-f]+)")
FREE = re.compile(r"Freed ptr: (0x[0-9a-f]+)")
UPDATE = re.compile(r"Update command buffer .*num_commands=(\d+); updated_allocs=(\d+)")
MARK = re.compile(r"== (step|forward|sample|head)\s*$")  # host_profile's JINFER_STEP_MARK=1 lines


def size_str(n: int) -> str:
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return f"{n}B"


def parse(lines):
    """Events in order: ("A", size, addr), ("F", addr), ("U", commands, allocs), ("X",) (an engine step begins),
    ("M", "forward" | "sample" | "head") (the runner calls a forward / sampler executable, a model drafter its head)."""
    for line in lines:
        if m := ALLOC.search(line):
            yield "A", int(m[1]), int(m[2], 16)
        elif m := FREE.search(line):
            yield "F", int(m[1], 16)
        elif m := UPDATE.search(line):
            yield "U", int(m[1]), int(m[2])
        elif m := MARK.search(line):
            yield ("X",) if m[1] == "step" else ("M", m[1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("log")
    ap.add_argument("--steps", type=int, default=40, help="engine steps to print in full (the last ones)")
    ap.add_argument("--min-size", type=int, default=1 << 16, help="allocations below this many bytes are counted only")
    args = ap.parse_args()
    with open(args.log, errors="replace") as f:
        events = list(parse(f))
    live: dict[int, int] = {}
    addrs = collections.defaultdict(collections.Counter)  # size -> address -> times
    rows, cur, small = [], [], 0
    for ev in events:
        if ev[0] == "A":
            size, addr = ev[1], ev[2]
            live[addr] = size
            addrs[size][addr] += 1
            if size >= args.min_size:
                cur.append(f"A{size_str(size)}@{addr & 0xFFFFFFF:07x}")
            else:
                small += 1
        elif ev[0] == "F":
            size = live.pop(ev[1], 0)
            if size >= args.min_size:
                cur.append(f"F{size_str(size)}@{ev[1] & 0xFFFFFFF:07x}")
        elif ev[0] == "U":
            cur.append(f"U{ev[1]}/{ev[2]}")
        elif ev[0] == "M":
            cur.append(f"[{ev[1]}]")
        else:
            cur.append(f"(+{small} small)")
            rows.append(" ".join(cur))
            cur, small = [], 0
    updates = collections.Counter(ev[1] for ev in events if ev[0] == "U")
    print(f"{sum(1 for e in events if e[0] == 'X')} engine steps; updates by command count: {dict(updates)}")
    print("sizes at several addresses (size: times at each address):")
    for size, where in sorted(addrs.items(), key=lambda kv: -kv[0]):
        if len(where) > 1 and size >= args.min_size:
            at = ", ".join(f"{a & 0xFFFFFFF:07x} x{n}" for a, n in where.most_common(6))
            print(f"  {size_str(size)} ({size}): {at}")
    print(f"the last {args.steps} engine steps (A alloc, F free, U update commands/allocs, [call]; addresses' low "
          "bits):")
    for row in rows[-args.steps:]:
        print("  " + row)


if __name__ == "__main__":
    main()

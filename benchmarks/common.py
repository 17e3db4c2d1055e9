"""Shared by the benchmarks: environment facts every result JSON carries, and JSON output."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from pathlib import Path

import jax


def source_hash() -> str:
    """sha1 of the engine's Python sources (jinfer/, pallas_kernels/, server/, benchmarks/): names the code a
    result ran even where git cannot (the device machine's copy of the tree carries a stale .git HEAD)."""
    import hashlib

    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha1()
    dirs = ("jinfer", "pallas_kernels", "server", "benchmarks")
    for path in sorted(p for d in dirs for p in (root / d).rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def environment() -> dict:
    dev = jax.devices()[0]
    commit = os.environ.get("JINFER_COMMIT")  # the device machine's copy of the tree may carry a stale .git
    try:
        commit = commit or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, check=True).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        commit = "unknown"
    return {"device": getattr(dev, "device_kind", dev.platform), "platform": dev.platform,
            "num_devices": jax.device_count(), "jax_version": jax.__version__, "commit": commit,
            "source_hash": source_hash(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def profiled(trace_dir: str | None):
    """`with profiled(args.profile):` writes a jax.profiler (Perfetto/TensorBoard) trace when a directory is given."""
    return jax.profiler.trace(trace_dir) if trace_dir else contextlib.nullcontext()


def add_profile_argument(ap) -> None:
    ap.add_argument("--profile", metavar="DIR", help="write a jax.profiler (Perfetto) trace of the timed run here")


def write_result(result: dict, out: str | None) -> None:
    text = json.dumps(result, indent=2)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    print(text)

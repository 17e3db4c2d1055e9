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


def profiled(trace_dir: str | None, python: bool = True):
    """`with profiled(args.profile):` writes a jax.profiler (Perfetto/TensorBoard) trace when a directory is given.
    `python=False` leaves out the Python tracer: the host runs at nearly its own speed (the tracer slows a
    serving step's host work ~2x) and a long run fits the trace, but `trace_summary` then finds no engine
    steps (use its `--steps`)."""
    if not trace_dir:
        return contextlib.nullcontext()
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 1 if python else 0
    return jax.profiler.trace(trace_dir, profiler_options=options)


def add_profile_argument(ap) -> None:
    ap.add_argument("--profile", metavar="DIR", help="write a jax.profiler (Perfetto) trace of the timed run here")
    ap.add_argument("--profile-no-python", action="store_true",
                    help="the trace without the Python tracer (GPU timeline and XLA's host events only)")


def write_result(result: dict, out: str | None) -> None:
    text = json.dumps(result, indent=2)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    print(text)


class ReplayDrafts:
    """`--speculative-config` with `--replay-acceptance P` on dummy weights (whose own greedy tokens a verification
    does not reproduce): a model-free method is replaced by the forced replay drafter (jinfer/spec/replay.py); a
    model drafter (EAGLE-3, MTP) keeps its head and work and only its verifications' outcomes are forced
    (`ForcedAcceptance`). `proposer` and `speculative_config` go to EngineCore / EngineConfig, then `apply(core)`."""

    def __init__(self, spec, acceptance: float | None):
        self.acceptance = acceptance
        self.forced_head = acceptance is not None and spec is not None and spec.method in ("eagle3", "mtp")
        replay = acceptance is not None and not self.forced_head
        from jinfer.spec.replay import ReplayProposer

        self.proposer = ReplayProposer(spec.num_speculative_tokens, acceptance, forced=True) if replay else None
        self.speculative_config = None if replay else spec

    def apply(self, core) -> None:
        if self.forced_head:
            from jinfer.spec.decoding import SpecDecoding
            from jinfer.spec.replay import ForcedAcceptance

            core.spec = SpecDecoding(ForcedAcceptance(core.spec.proposer, self.acceptance))

"""Starting an engine process, with nothing but the standard library imported: `jinfer serve` starts its
engine before it imports the HTTP server, ZeroMQ or numpy, so the engine's own (much longer) start-up
begins as early as it can."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# JAX's GPU memory pool, as a fraction of the device, when the engine is first to start JAX (its default is 0.75,
# which left a 61 GB Qwen3-30B-A3B no KV cache on an 80 GB H100); the KV pool then takes
# gpu_memory_utilization of it, less what the weights use.
MEM_FRACTION = "0.95"


def set_jax_env_defaults() -> None:
    """JAX's GPU client settings for an engine (in this process, before anything starts JAX's backend; a variable the
    user set wins): the pool's MEM_FRACTION, and CUDA's stream-ordered pool (cudaMallocAsync) as the allocator. XLA's
    default (BFC) keeps a host-side table of 8 bytes per 256 bytes of its pool (1.9 GB of host RSS for the ~60 GB pool
    of an 80 GB H100); the CUDA pool has none and measured as fast (one H100: batch-1 TPOT 6.41 vs 6.44 ms, throughput
    37.1k vs 37.0k tok/s; one H200, Qwen3-8B batch 1 / 8, medians of 3 processes: 1.00x / 1.00x with bf16 and with
    FP8 weights, benchmarks/run_gpu_alloc.sh). The same allocator in the serving engine and in-process `LLM`s."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", MEM_FRACTION)
    os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "cuda_async")


def default_address() -> str:
    """A fresh ipc:// address in a private temp dir (nothing listens on a network interface)."""
    return f"ipc://{tempfile.mkdtemp(prefix='jinfer-')}/engine.sock"


def config_to_dict(config: Any) -> dict[str, Any]:
    """EngineConfig (a frozen dataclass, nested ones as dicts) or a plain dict -> JSON-able dict."""
    if dataclasses.is_dataclass(config):
        config = dataclasses.asdict(config)
    return json.loads(json.dumps(config, default=str))


def start_engine_process(config: Any, address: str, *, core_factory: str | None = None,
                         env: dict[str, str] | None = None, owned_ipc_dir: str | None = None) -> subprocess.Popen:
    """Start the engine in a fresh interpreter (its own session: a terminal's Ctrl-C goes to the parent,
    which shuts the engine down in order; the engine exits by itself if the parent dies). `env`: variables
    set for it on top of ours (a data-parallel replica's CUDA_VISIBLE_DEVICES). `owned_ipc_dir`: the private
    directory `default_address()` made for the socket, which the engine removes if it outlives its parent
    (never a directory the user named)."""
    cmd = [sys.executable, "-m", "jinfer.engine.core_proc", "--address", address,
           "--config", json.dumps(config_to_dict(config)), "--parent-pid", str(os.getpid())]
    if core_factory:
        cmd += ["--core-factory", core_factory]
    if owned_ipc_dir:
        cmd += ["--owned-ipc-dir", owned_ipc_dir]
    return subprocess.Popen(cmd, env=child_env(env), start_new_session=True)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Our environment plus `extra`, with this checkout on PYTHONPATH (so that `-m jinfer...` works from any cwd)."""
    env = dict(os.environ) | (extra or {})
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def discard_engine_process(proc: subprocess.Popen, ipc_dir: str | None) -> None:
    """Stop an engine process no client took over (it runs in its own session: a terminal's Ctrl-C does not
    reach it; it would notice its parent's exit, but not while the parent lives on) and remove its socket dir."""
    import shutil

    proc.kill()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass
    if ipc_dir:
        shutil.rmtree(ipc_dir, ignore_errors=True)

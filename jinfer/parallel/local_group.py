"""One process per GPU on one host (`--distributed-executor-backend mp`, the default where it applies): the engine
process of `jinfer serve -tp N` spawns N - 1 followers and becomes process 0 of an `nnodes = N` group on 127.0.0.1
(jinfer/parallel/multihost.py), each process driving one GPU through a `CUDA_VISIBLE_DEVICES` of its own.

Why: one process launching every GPU's step in turn spends the host time of all of them on each step; a process per
GPU launches them at once, and small reductions run our one-shot kernel over CUDA IPC memory (peer_memory.py).
Qwen3-8B tp=2 on two H200s: 3.44 / 4.28 ms a token at batch 1 / 16 against 3.95 / 4.75 in one process
(docs/performance.md).

"auto" takes it for tp > 1 on GPUs when the configuration is one a group supports: one engine (no `-dp`, no
`--nnodes` of the user's), no host KV tier, no EAGLE-3 / MTP drafter, not an embedding model; otherwise one process.
Runs in the engine process before JAX starts a backend (the GPUs a process sees are fixed then).
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
from typing import Any

from jinfer.config.engine import EngineConfig
from jinfer.engine.spawn import child_env, set_jax_env_defaults

log = logging.getLogger(__name__)

FOLLOWER_STOP_S = 30.0


def visible_gpus(env=os.environ) -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (or /dev/nvidiaN: their ordinals); none
    where JAX is told to run elsewhere. Nothing here starts CUDA."""
    platforms = env.get("JAX_PLATFORMS", "").lower()
    if platforms and not {"cuda", "gpu"} & set(platforms.split(",")):
        return []
    if (named := env.get("CUDA_VISIBLE_DEVICES")) is not None:
        return [d.strip() for d in named.split(",") if d.strip() and d.strip() != "-1"]
    try:
        ordinals = sorted(int(m.group(1)) for f in os.listdir("/dev") if (m := re.fullmatch(r"nvidia(\d+)", f)))
    except OSError:
        return []
    return [str(i) for i in ordinals]


def _is_embedding_model(config: EngineConfig) -> bool:
    if config.runner != "auto":
        return config.runner == "pooling"
    from jinfer.weights.loader import resolve_model

    try:
        source = resolve_model(config.model, config.load_format, revision=config.revision,
                               download_dir=config.download_dir)
    except Exception:  # noqa: BLE001 - the engine's own start-up says what is wrong with the model
        return True  # (and one process is what it would have been)
    return source.config.pooling


def one_process_per_gpu(config: EngineConfig, env=os.environ) -> bool:
    """Whether the engine process should spread over a process per GPU."""
    backend, tp = config.distributed_executor_backend, config.tensor_parallel_size
    if backend == "uni" or tp == 1 or config.nnodes > 1:
        return False
    return backend == "mp" or (config.group_refusal() is None and len(visible_gpus(env)) >= tp
                               and not _is_embedding_model(config))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spread(config: dict[str, Any]) -> tuple[dict[str, Any], list[subprocess.Popen]]:
    """Start the followers (ranks 1..tp-1, one GPU each) and return process 0's config (EngineConfig fields) and them.
    Sets this process's CUDA_VISIBLE_DEVICES to its own GPU: call it before anything starts JAX's backend."""
    tp = int(config["tensor_parallel_size"])
    gpus = visible_gpus()
    if gpus and len(gpus) < tp:
        raise ValueError(f"tensor_parallel_size={tp} needs {tp} GPUs; CUDA_VISIBLE_DEVICES / the host has "
                         f"{len(gpus)}")
    group = dict(config, nnodes=tp, node_rank=0, master_addr="127.0.0.1", master_port=_free_port(),
                 distributed_executor_backend="uni")
    set_jax_env_defaults()  # as one engine process on its GPUs
    followers = []
    try:
        for rank in range(1, tp):
            cmd = [sys.executable, "-m", "jinfer.engine.worker_proc", "--config",
                   json.dumps(group | {"node_rank": rank})]
            own_gpu = {"CUDA_VISIBLE_DEVICES": gpus[rank]} if gpus else None
            followers.append(subprocess.Popen(cmd, env=child_env(own_gpu)))
    except BaseException:
        stop(followers, timeout=0)
        raise
    if gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus[0]
    log.info("one process per GPU: %d followers started (pids %s), this process GPU %s, coordinator port %d",
             len(followers), [p.pid for p in followers], gpus[0] if gpus else "-", group["master_port"])
    return group, followers


def stop(followers: list[subprocess.Popen], timeout: float = FOLLOWER_STOP_S) -> None:
    """Wait for the followers (process 0's clean stop ends them), then kill what is left."""
    for p in followers:
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        if p.poll() is None:
            log.warning("follower %d still running: killed", p.pid)
            p.kill()
            p.wait()

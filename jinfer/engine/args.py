"""Engine options on the command line, shared by `jinfer generate` and `jinfer serve`.

Every flag defaults to None, meaning "EngineConfig's default", so the defaults live in one place
(`jinfer/config/engine.py:EngineConfig`). The environment variables that set a default are read here, where the
arguments are parsed, never below (JINFER_COMPILATION_CACHE: `compilation_cache_dir_from_env`).
"""

from __future__ import annotations

import argparse
import os

from jinfer.config.engine import ATTENTION_BACKENDS
from jinfer.config.kernels import KernelPolicy
from jinfer.config.pooling import RUNNERS, TASK_RUNNERS

# `jinfer serve` is ready once these steps compile; the other shapes follow in the background.
SERVE_WARMUP_FIRST_TOKENS = 256
# ... and drops the executables of the other shapes after this many seconds unused (they load again on demand).
SERVE_EXECUTABLE_KEEP_ALIVE_S = 60.0

# CLI flag -> EngineConfig field.
_ENGINE_OPTIONS = ("dtype", "load_format", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_pages",
                   "page_size", "gpu_memory_utilization", "tensor_parallel_size", "seed", "attention_backend",
                   "compilation_cache_dir", "nnodes", "node_rank", "master_addr", "master_port",
                   "log_stats_interval", "generation_config", "kv_offload_gb", "executable_keep_alive",
                   "speculative_config", "runner")


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    e = parser.add_argument_group("engine")
    e.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto (default): bfloat16 on GPU, float32 on CPU")
    e.add_argument("--load-format", default=None, choices=["auto", "dummy"])
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--max-num-seqs", type=int, default=None)
    e.add_argument("--max-num-batched-tokens", type=int, default=None)
    e.add_argument("--num-pages", type=int, default=None)
    e.add_argument("--page-size", type=int, default=None)
    e.add_argument("--gpu-memory-utilization", type=float, default=None)
    e.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                   help="devices the model is split over (tensor parallel; experts too, see below)")
    e.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE models: split whole experts over the tensor-parallel devices instead of each "
                        "expert's columns")
    e.add_argument("--nnodes", type=int, default=None,
                   help="processes (hosts) one mesh spans; each runs this command with its own --node-rank")
    e.add_argument("--node-rank", type=int, default=None,
                   help="this process's rank in [0, nnodes): 0 schedules (and serves); the others follow it, headless")
    e.add_argument("--master-addr", default=None, help="host of process 0 (JAX's coordinator), default 127.0.0.1")
    e.add_argument("--master-port", type=int, default=None, help="port of JAX's coordinator on process 0 (29500)")
    e.add_argument("--seed", type=int, default=None)
    e.add_argument("--attention-backend", default=None, choices=list(ATTENTION_BACKENDS),
                   help="pallas: Pallas kernels (Mosaic GPU for long prefills, Triton elsewhere); "
                        "pallas-triton: Triton kernels only; auto: pallas on GPU, reference elsewhere")
    e.add_argument("--compilation-cache-dir", default=None,
                   help="JAX compilation cache ('' = off; default $JINFER_COMPILATION_CACHE, else ~/.cache/jinfer/xla)")
    e.add_argument("--no-prefix-caching", action="store_true")
    e.add_argument("--kv-offload-gb", type=float, default=None, metavar="GIB",
                   help="host memory (GiB, pinned) for KV pages evicted from the HBM prefix cache: a prefix found "
                        "there is copied back instead of recomputed (default 0: off)")
    e.add_argument("--no-chunked-prefill", action="store_true")
    e.add_argument("--no-warmup", action="store_true", help="compile shapes on first use instead of at start")
    e.add_argument("--warmup-first-tokens", type=_non_negative_int, default=None, metavar="N",
                   help="staged warm-up: compile the 1-token and N-token steps before serving and the other shapes "
                        f"in the background while serving (serve's default: {SERVE_WARMUP_FIRST_TOKENS}; 0: every "
                        "shape before serving)")
    e.add_argument("--executable-keep-alive", type=float, default=None, metavar="SECONDS",
                   help="with a staged warm-up: drop the executables of the shapes beyond the first ones after this "
                        "many seconds unused (their host memory goes back; a step that wants one again runs padded "
                        "into a loaded shape while it loads from the executable cache, ~0.2-0.7 s); serve's default "
                        f"{SERVE_EXECUTABLE_KEEP_ALIVE_S:g}, 0: never")
    e.add_argument("--log-stats-interval", type=float, default=None,
                   help="seconds between the engine's stats log lines (throughput, running/waiting, KV usage, "
                        "prefix-cache hit rate); default 10, 0 turns them off")
    e.add_argument("--generation-config", default=None,
                   help="default sampling parameters: auto (default: the model's generation_config.json), vllm "
                        "(none), or a directory holding a generation_config.json; a request's values win")
    e.add_argument("--disable-log-stats", action="store_true", help="no periodic stats lines (vLLM's flag)")
    e.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as vLLM takes it: \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_min": 2, "prompt_lookup_max": 5}\' (n-gram drafts from the sequence itself; '
                        'steps are then read back before the next is scheduled)')
    e.add_argument("--runner", default=None, choices=list(RUNNERS),
                   help="generate (text), pooling (embeddings: /v1/embeddings), or auto (default): pooling for "
                        "embedding checkpoints (a base model without an LM head, or sentence-transformers metadata)")
    e.add_argument("--task", default=None, choices=sorted(TASK_RUNNERS),
                   help="vLLM's older name for --runner: embed = pooling")
    e.add_argument("--no-async-scheduling", action="store_true",
                   help="read each step's tokens back before scheduling the next (no overlap of host and device)")


def engine_config_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig keyword arguments for the flags given (model included)."""
    kw = {name: getattr(args, name) for name in _ENGINE_OPTIONS if getattr(args, name, None) is not None}
    kw["model"] = args.model
    if getattr(args, "task", None) is not None and "runner" not in kw:
        kw["runner"] = TASK_RUNNERS[args.task]
    if args.no_prefix_caching:
        kw["enable_prefix_caching"] = False
    if args.no_chunked_prefill:
        kw["enable_chunked_prefill"] = False
    if getattr(args, "enable_expert_parallel", False):
        kw["enable_expert_parallel"] = True
    if args.no_warmup:
        kw["warmup"] = False
    first = getattr(args, "warmup_first_tokens", None)
    if first is not None:
        kw["warmup_first_tokens"] = first or None  # 0: everything before serving
    if getattr(args, "no_async_scheduling", False):
        kw["async_scheduling"] = False
    if getattr(args, "disable_log_stats", False):
        kw["log_stats_interval"] = 0.0
    kw["kernel_policy"] = KernelPolicy.from_env()  # the JINFER_* kernel switches: read here and nowhere below
    return compilation_cache_dir_from_env(kw)


def compilation_cache_dir_from_env(kw: dict) -> dict:
    """`kw` with compilation_cache_dir from $JINFER_COMPILATION_CACHE when it names none (CLI and LLM(...))."""
    env = os.environ.get("JINFER_COMPILATION_CACHE")
    if kw.get("compilation_cache_dir") is None and env:
        return {**kw, "compilation_cache_dir": env}
    return kw

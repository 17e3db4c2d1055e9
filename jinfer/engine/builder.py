"""Engine start-up: from a validated `EngineConfig` to the parts `EngineCore` runs (`build_engine`).

In order: JAX's settings (memory fraction, persistent compilation cache), the multi-process group (joined before
anything starts JAX's backends), the model and its tokenizer, the dtype, the mesh of this data-parallel replica,
the weights, the KV pool's size (from free device memory, agreed over a group), the host tier, the scheduler and
the model runner, then the warm-up. Each phase's seconds and the process's RSS go to one log line. An engine
built is released at interpreter exit, on the main thread (`release_at_exit`).
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import time
import weakref
from dataclasses import dataclass, replace
from typing import Any

import jax

from jinfer.cache.layout import check_kv_dtype, kv_cache_bytes_per_page, state_bytes_per_slot
from jinfer.cache.manager import KVCacheManager, cdiv
from jinfer.config.engine import EngineConfig
from jinfer.config.model import ModelConfig
from jinfer.config.pooling import resolve_runner
from jinfer.engine.runner import ModelRunner
from jinfer.engine.scheduler import Scheduler
from jinfer.engine.spawn import set_jax_env_defaults
from jinfer.generation_config import load_generation_defaults
from jinfer.models.fp8 import FP8, KERNEL_LAYOUT_FIELDS, kernel_layout, quantize_fields
from jinfer.models.registry import shard_weights, state_specs
from jinfer.ops import select_ops
from jinfer.parallel.mesh import check_parallel, make_mesh
from jinfer.parallel.multihost import Follower, Leader, join
from jinfer.spec import eagle, mtp
from jinfer.spec.proposer import Proposer, build_proposer, check_proposer
from jinfer.tokenizer import Tokenizer
from jinfer.weights.hub import resolve_path
from jinfer.weights.loader import DTYPES, load_kv_scales, load_weights, resolve_model, with_online_fp8

log = logging.getLogger("jinfer.engine.core")

CPU_KV_CACHE_BYTES = 1 << 30  # default KV pool on CPU, where free memory is not reported
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def enable_compilation_cache(path: str) -> str:
    """Keep compiled executables on disk (JAX persistent cache): a restart skips the compiles."""
    path = os.path.expanduser(path)
    jax.config.update("jax_compilation_cache_dir", path)
    # every compile, the small ones too: the dummy weights' two init programs (~0.2 s each on an H100) were
    # compiled again at every start below the default threshold
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


@dataclass
class EngineParts:
    """What start-up built, for EngineCore to hold."""

    group: Leader | Follower | None  # the multi-process group (None: one process)
    model_config: ModelConfig
    model_name: str
    generation_defaults: dict[str, Any]
    tokenizer: Tokenizer | None
    tokenizer_path: str | None  # where another process on this host can load the tokenizer
    dtype: str
    num_state_slots: int
    max_model_len: int
    kv: KVCacheManager
    scheduler: Scheduler
    runner: ModelRunner
    eos_token_ids: tuple[int, ...]
    proposer: Proposer | None = None  # speculative_config's drafter


_LIVE_ENGINES: weakref.WeakSet = weakref.WeakSet()


def release_at_exit(core) -> None:
    """Have `core`'s device state freed on the main thread at interpreter exit (`release_engines`)."""
    _LIVE_ENGINES.add(core)


@atexit.register
def release_engines() -> None:
    """Free every engine's device state on the main thread before the interpreter shuts down. Left to
    the final garbage collection, its XLA objects could be freed on a daemon thread (tqdm's monitor),
    which aborted the process ("terminate called without an active exception") about half the time."""
    for core in list(_LIVE_ENGINES):
        if isinstance(core.group, Leader):
            core.close()
        if core.runner is not None:
            core.runner.host_tier_join()  # its reservation and offload threads hold XLA buffers
        core.runner = None
        core._inflight = None
    gc.collect()


def _process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc), or None."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as up:
            start_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
            uptime = float(up.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _rss_mb() -> float | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class _Phases:
    """Start-up phases: seconds each, and the process's RSS after it (one log line at the end)."""

    def __init__(self):
        self.t, self.parts = time.perf_counter(), []

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        rss = _rss_mb()
        self.parts.append(f"{name} {now - self.t:.2f} s" + ("" if rss is None else f" ({rss:.0f} MB)"))
        self.t = now

    def __str__(self) -> str:
        return ", ".join(self.parts)


def _load_tokenizer(config: EngineConfig, source_path, tokenizer: Tokenizer | None) -> tuple[Tokenizer | None,
                                                                                              str | None]:
    """The tokenizer given, else `config.tokenizer`'s (a path or Hub ID), else the model's; with
    `config.chat_template` in place of its own."""
    path = None
    if tokenizer is None and config.tokenizer is not None:
        revision = config.revision if config.tokenizer == config.model else None
        path = resolve_path(config.tokenizer, revision=revision, download_dir=config.download_dir, field="tokenizer")
        tokenizer = Tokenizer.from_pretrained(path)
    elif tokenizer is None and source_path is not None:
        if Tokenizer.found_in(source_path):
            try:
                path, tokenizer = source_path, Tokenizer.from_pretrained(source_path)
            except ValueError as e:  # a tiktoken file without its split pattern (a snapshot taken without the module)
                if source_path.is_file() or (source_path / "tokenizer.json").is_file():
                    raise
                path = None
                log.warning("%s: its tiktoken tokenizer does not load (%s): prompts must be token ids, outputs carry "
                            "no text", source_path, e)
        else:
            log.warning("%s has no tokenizer (tokenizer.json, a tiktoken file): prompts must be token ids, outputs "
                        "carry no text", source_path)
    if config.chat_template is not None:
        if tokenizer is None:
            raise ValueError("chat_template= needs a tokenizer: this model has none (give tokenizer=)")
        tokenizer.chat_template = config.chat_template
    return tokenizer, None if path is None else str(path)


def check_max_model_len(requested: int | None, max_positions: int, kv_capacity: int | None = None, *,
                        explicit_pages: bool = False) -> int:
    """The context length: `requested` if the model (max_position_embeddings) and the KV pool hold it, else a
    ValueError naming both numbers (vLLM's rule, not a silent change); None: the model's, capped by the pool.
    `explicit_pages`: a pool sized by num_pages (a test's small pool) caps a larger request, with a log line."""
    if requested is not None and requested > max_positions:
        raise ValueError(f"max_model_len={requested} is larger than the model's max_position_embeddings="
                         f"{max_positions}: give at most {max_positions}")
    if kv_capacity is None:
        return requested or max_positions
    wanted = requested or max_positions
    if wanted <= kv_capacity:
        return wanted
    if requested is not None and not explicit_pages:
        raise ValueError(f"max_model_len={requested} is larger than the {kv_capacity} tokens the KV cache holds: "
                         "raise gpu_memory_utilization, or give a smaller max_model_len")
    log.info("max_model_len %d: the KV cache's %d tokens (the model allows %d)", kv_capacity, kv_capacity, wanted)
    return kv_capacity


def kv_dtype(config: EngineConfig, dtype: str):
    """The KV pages' dtype: float8_e4m3fn for kv_cache_dtype="fp8", else the model's `dtype`."""
    return FP8 if config.kv_cache_dtype == "fp8" else DTYPES[dtype]


def _num_host_pages(config: EngineConfig, model_config: ModelConfig, dtype: str, prefix_caching: bool) -> int:
    """Pages the host tier holds: kv_offload_gb GiB at one page's KV over all layers and devices."""
    if not config.kv_offload_gb:
        return 0
    if not prefix_caching:
        log.info("no KV host tier: prefix caching is off for %s", model_config.architecture)
        return 0
    tp = config.tensor_parallel_size
    per_page = tp * kv_cache_bytes_per_page(model_config, config.page_size, kv_dtype(config, dtype), tp)
    num = int(config.kv_offload_gb * 2**30 // per_page)
    if num < 1:
        raise ValueError(f"kv_offload_gb={config.kv_offload_gb} holds no page ({per_page} bytes each)")
    log.info("KV host tier: %d pages (%.2f GiB)", num, num * per_page / 2**30)
    return num


def _auto_num_pages(config: EngineConfig, model_config: ModelConfig, dtype: str, num_state_slots: int,
                    device, extra_page_bytes: int = 0) -> int:
    """KV pages that fit gpu_memory_utilization of the device's free memory (1 GiB on CPU). `extra_page_bytes`: what
    a draft head's layer adds to each page."""
    per_page = extra_page_bytes + kv_cache_bytes_per_page(model_config, config.page_size, kv_dtype(config, dtype),
                                                          config.tensor_parallel_size)  # on each device
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        budget = int(stats["bytes_limit"] * config.gpu_memory_utilization - stats.get("bytes_in_use", 0))
    else:
        budget = CPU_KV_CACHE_BYTES
    budget -= num_state_slots * state_bytes_per_slot(model_config, DTYPES[dtype], config.tensor_parallel_size)
    # never more than max_num_seqs full-length sequences would need
    cap = config.max_num_seqs * cdiv(config.max_model_len or model_config.max_position_embeddings,
                                     config.page_size) + 1
    num_pages = min(budget // per_page, cap)
    if num_pages < 2:
        raise ValueError(f"not enough memory for the KV cache ({budget} bytes, {per_page} per page)")
    return int(num_pages)


def _mesh(config: EngineConfig, model_config: ModelConfig, group):
    check_parallel(model_config, config.tensor_parallel_size, config.enable_expert_parallel)
    tp, rank = config.tensor_parallel_size, config.data_parallel_rank
    if group is not None and tp != jax.device_count():
        raise ValueError(f"tensor_parallel_size={tp} must be the group's {jax.device_count()} devices "
                         f"({config.nnodes} processes): one mesh spans them all")
    if config.data_parallel_size * tp > len(jax.devices()):
        raise ValueError(f"data_parallel_size={config.data_parallel_size} x tensor_parallel_size={tp} needs "
                         f"{config.data_parallel_size * tp} devices; {len(jax.devices())} are available")
    return make_mesh(tp, jax.devices()[rank * tp:(rank + 1) * tp])


def build_engine(config: EngineConfig, tokenizer: Tokenizer | None = None, speculative: int = 0) -> EngineParts:
    """Everything an EngineCore needs, built and warmed up (see the module's docstring for the order). `speculative`:
    the drafts per step of a drafter besides `config.speculative_config`'s (0: none): state slots go in pairs, verify
    steps their executables."""
    t0 = time.perf_counter()
    age = _process_age_s()
    phases = _Phases()
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        set_jax_env_defaults()
    # Several processes: join the group before anything starts JAX's backends (jinfer/parallel/multihost.py).
    group = join(config.nnodes, config.node_rank, config.master_addr, config.master_port,
                 peer_timeout_s=config.peer_timeout_s)
    cache_dir = enable_compilation_cache(config.compilation_cache_dir) if config.compilation_cache_dir else None
    source = resolve_model(config.model, config.load_format, revision=config.revision,
                           download_dir=config.download_dir)
    source = replace(source, config=resolve_runner(config.runner, source.config, source.path))
    phases("resolve")
    model_config: ModelConfig = source.config
    check_max_model_len(config.max_model_len, model_config.max_position_embeddings)  # before the weights load
    if config.quantization == "gguf" and source.kind != "gguf":
        raise ValueError(f"quantization='gguf' needs a .gguf model, not {config.model!r}")
    if config.quantization == "fp8":  # online: the linear weights quantized at load (jinfer/models/fp8.py)
        source = with_online_fp8(source)
        model_config = source.config
    spec = config.speculative_config
    if model_config.pooling and (spec is not None or group is not None):
        raise ValueError("an embedding model (runner='pooling') runs without speculative_config and in one process "
                         "(nnodes=1)")
    if spec is not None:  # refused before the weights load (e.g. a recurrent-state model)
        check_proposer(spec, num_state_slots=int(bool(state_specs(model_config))))
        if spec.method == "mtp" and model_config.architecture != "qwen3_5":
            raise ValueError(f"speculative_config.method='mtp' reads the MTP layer of Qwen3.5 checkpoints, not of "
                             f"{model_config.architecture!r}")
    if config.expert_load_stats and not model_config.num_experts:  # (before the weights load)
        raise ValueError(f"expert_load_stats=True needs a mixture-of-experts model; {model_config.architecture!r} "
                         "has no experts")
    generation_defaults = load_generation_defaults(config.generation_config, source.path)
    tokenizer, tokenizer_path = _load_tokenizer(config, source.path, tokenizer)
    phases("tokenizer")
    dtype = config.dtype if config.dtype != "auto" else ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    if config.kv_cache_dtype not in ("auto", "fp8", dtype):
        raise ValueError(f"kv_cache_dtype={config.kv_cache_dtype!r} must be 'auto', 'fp8' or the model's dtype "
                         f"({dtype!r} here)")
    check_kv_dtype(model_config, kv_dtype(config, dtype))
    jax.devices()  # (the backend starts here when dtype was given, else above)
    phases("backend")
    mesh = _mesh(config, model_config, group)
    weights = load_weights(source, dtype, mesh, seed=config.seed, expert_parallel=config.enable_expert_parallel)
    weights = shard_weights(model_config, weights, mesh, expert_parallel=config.enable_expert_parallel)
    head = None  # an EAGLE-3 or MTP draft head: (config, weights), after the target (it shares its embedding)
    head_kind = eagle if spec is None or spec.method != "mtp" else mtp
    if spec is not None and spec.method == "eagle3":
        head = eagle.load_head(spec, model_config, weights, dtype, mesh)
    elif spec is not None and spec.method == "mtp":
        head = mtp.load_head(None if source.kind == "dummy" else source.path, model_config, weights, dtype, mesh,
                             seed=config.seed + 1)  # (a dummy head's values: not the target's first layers')
    if head is not None:  # (FP8 dense weights [out, in] for the decode kernels, as the target's: shard_weights)
        if spec.quantization == "fp8":  # (its projections and lm_head; the embedding and norms as they are)
            head = (head[0], quantize_fields(head[1], KERNEL_LAYOUT_FIELDS))
        head = (head[0], kernel_layout(head[1]))
    phases("weights")
    # Models with per-sequence state layers (linear attention): one state slot per running sequence, plus
    # the reserved slot 0. Their state summarises a whole prefix, so prefix-cache hits would need it
    # checkpointed at page boundaries: not built; hits are off for such models.
    num_state_slots = config.max_num_seqs + 1 if state_specs(model_config) else 0
    # Speculative decoding on such a model: slots in pairs, one keeps the state before a row of drafts (scheduler.py)
    state_pairs = bool(num_state_slots) and (spec is not None or speculative)
    prefix_caching = config.enable_prefix_caching and not num_state_slots
    if config.enable_prefix_caching and not prefix_caching:
        log.info("prefix caching is off: %s keeps a per-sequence state in its linear-attention layers, "
                 "which a cached prefix's pages cannot restore", model_config.architecture)
    num_pages = config.num_pages or _auto_num_pages(
        config, model_config, dtype, num_state_slots * (2 if state_pairs else 1),
        next(d for d in mesh.devices.flat if d.process_index == jax.process_index()),
        head_kind.head_page_bytes(head[0], config.page_size, DTYPES[dtype]) if head else 0)
    if group is not None:  # the same pool (and executables) in every process
        num_pages = group.agree_min("num_pages", num_pages)
    # (page 0 is reserved: the pool holds num_pages - 1 pages of a sequence)
    max_len = check_max_model_len(config.max_model_len, model_config.max_position_embeddings,
                                  (num_pages - 1) * config.page_size, explicit_pages=config.num_pages is not None)
    num_host_pages = _num_host_pages(config, model_config, dtype, prefix_caching)
    kv = KVCacheManager(num_pages, config.page_size, prefix_caching, num_state_slots, num_host_pages,
                        hit_drop_last_page=head is not None, state_pairs=state_pairs)
    scheduler = Scheduler(config.scheduler_config(max_len), kv)
    runner = ModelRunner(model_config, weights, mesh, num_pages=num_pages, page_size=config.page_size,
                         kv_dtype=kv_dtype(config, dtype), dtype=DTYPES[dtype],
                         kv_scales=load_kv_scales(source) if config.kv_cache_dtype == "fp8" else None,
                         max_num_batched_tokens=config.max_num_batched_tokens,
                         max_num_seqs=config.max_num_seqs, max_model_len=max_len,
                         ops=select_ops(config.attention_backend, policy=config.kernel_policy),
                         num_state_slots=kv.num_device_state_slots,
                         num_host_pages=num_host_pages, keep_alive=config.executable_keep_alive,
                         executable_dir=os.path.join(cache_dir, "executables")
                         if cache_dir and config.executable_cache and group is None else None,
                         aux_layers=head_kind.aux_layers(head[0]) if head else (),
                         verify_query_len=1 + (speculative or ((spec.num_speculative_tokens or 1) if spec else 0)),
                         expert_load=config.expert_load_stats)
    eos_token_ids = tuple(tokenizer.eos_token_ids) if tokenizer else model_config.eos_token_ids
    proposer = None if spec is None else build_proposer(spec, max_model_len=max_len, num_state_slots=num_state_slots,
                                                         head=head, runner=runner, kv_manager=kv)
    phases("kv cache and runner")
    if config.warmup:
        # every process of a group warms up the same shapes in the same order, all before serving
        runner.warmup(first_tokens=config.warmup_first_tokens if group is None else None, compile_turn=group)
        if (warm_head := getattr(proposer, "warmup", None)) is not None:  # (a drafter's head: its buckets too)
            warm_head()
    if isinstance(group, Leader):
        group.wait_for_workers()
        runner.on_launch = group.send_step
    phases("warm-up")
    log.info("start-up phases: process started %s s before the engine, then %s",
             "?" if age is None else f"{age:.2f}", phases)
    model_name = config.model or DEFAULT_MODEL_NAME
    log.info("engine ready in %.1f s: %s, %d KV pages of %d tokens, max_model_len %d", time.perf_counter() - t0,
             model_name, num_pages, config.page_size, max_len)
    return EngineParts(group, model_config, model_name, generation_defaults, tokenizer, tokenizer_path, dtype,
                       num_state_slots, max_len, kv, scheduler, runner, eos_token_ids, proposer)

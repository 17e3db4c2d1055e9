"""EngineCore: one scheduler, one model runner, and the per-request text state between them.

The offline `LLM` drives it in-process; the ZeroMQ engine process (core_proc.py) wraps it. Per
step: schedule -> run the batch -> update the scheduler with the sampled tokens -> detokenize,
apply stop strings, and emit one `EngineOutput` delta per sequence that produced text or finished.
`n > 1` is fanned out here into n sequences sharing the prompt (and its cached prefix pages).
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import time
import weakref
from array import array
from dataclasses import dataclass, field

import jax
import numpy as np

from jinfer.cache.manager import KVCacheManager, cdiv
from jinfer.config.kernels import BACKENDS
from jinfer.config.model import ModelConfig
from jinfer.engine.grammar import GrammarEngine
from jinfer.engine.request import FinishReason, Request
from jinfer.engine.runner import (
    Launched,
    ModelRunner,
    StepRow,
    kv_cache_bytes_per_page,
    state_bytes_per_slot,
)
from jinfer.engine.sampler import num_logprobs_for, pack_token_mask
from jinfer.engine.scheduler import Scheduler, SchedulerConfig
from jinfer.engine.spawn import MEM_FRACTION
from jinfer.generation_config import check_setting as check_generation_config
from jinfer.generation_config import load_generation_defaults
from jinfer.models.registry import state_specs
from jinfer.ops import select_ops
from jinfer.outputs import EngineOutput
from jinfer.parallel.mesh import check_parallel, make_mesh, shard_attention_weights
from jinfer.parallel.multihost import Leader, check_group, join
from jinfer.sampling_params import SamplingParams
from jinfer.tokenizer import IncrementalDetokenizer, Tokenizer
from jinfer.weights.loader import DTYPES, load_weights, resolve_model

log = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30  # default KV pool on CPU, where free memory is not reported


def enable_compilation_cache(path: str | None = None) -> str:
    """Keep compiled executables on disk (JAX persistent cache): a restart skips the compiles."""
    path = path or os.environ.get("JINFER_COMPILATION_CACHE") or os.path.expanduser("~/.cache/jinfer/xla")
    jax.config.update("jax_compilation_cache_dir", path)
    # every compile, the small ones too: the dummy weights' two init programs (~0.2 s each on an H100) were
    # compiled again at every start below the default threshold
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None: the embedded default model
    dtype: str = "auto"  # "auto": bfloat16 on accelerators, float32 on CPU (faster there)
    load_format: str = "auto"  # "dummy": random weights at the model's config
    max_model_len: int | None = None  # default: the model's context, capped by the KV pool
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    page_size: int = 16
    num_pages: int | None = None  # default: from gpu_memory_utilization (GPU) or 1 GiB (CPU)
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # GiB of host memory for KV pages evicted from the HBM prefix cache (the host tier); 0: none
    kv_offload_gb: float = 0.0
    enable_chunked_prefill: bool = True
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False  # MoE: whole experts split over the devices (else their columns)
    # Offline data parallelism (`LLM(data_parallel_size=N)`): this engine is replica `data_parallel_rank`,
    # on devices [rank * tp, (rank + 1) * tp). (The server runs each replica in its own process instead.)
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    # Several processes (hosts), one mesh over all their devices (jinfer/parallel/multihost.py): this process is
    # `node_rank` of `nnodes`; process 0 hosts JAX's coordinator at master_addr:master_port and schedules.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    seed: int = 0
    attention_backend: str = "auto"  # "auto" (Pallas on GPU, jnp elsewhere) | "reference" | "pallas"
    warmup: bool = True  # compile every bucket at start-up
    # Staged warm-up: compile only T = 1 and the bucket of this many tokens before serving, the rest in the
    # background while serving (steps padded into ready buckets meanwhile). None: everything first.
    warmup_first_tokens: int | None = None
    # With a staged warm-up and the executable cache: the other buckets' executables are dropped after this many
    # seconds in which no step used them (their host memory goes back) and loaded again from the cache, in the
    # background, when a step wants them (steps are padded into loaded buckets meanwhile). 0: never.
    executable_keep_alive: float = 0.0
    async_scheduling: bool = True  # launch step N+1 before reading step N's tokens (one step in flight)
    executable_cache: bool = True  # keep compiled executables on disk (warm starts skip tracing); False: plain jit
    compilation_cache_dir: str | None = None  # default $JINFER_COMPILATION_CACHE or ~/.cache/jinfer/xla; "" off
    log_stats_interval: float = 10.0  # seconds between the engine process's stats lines (0: none)
    generation_config: str = "auto"  # default sampling parameters: "auto" (the model's), "vllm" (none) or a dir

    def __post_init__(self):
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} must be 'auto' or one of {sorted(DTYPES)}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "page_size", "tensor_parallel_size",
                     "data_parallel_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r} must be an integer >= 1")
        if not isinstance(self.data_parallel_rank, int) or not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(f"data_parallel_rank={self.data_parallel_rank!r} must be in "
                             f"[0, data_parallel_size={self.data_parallel_size})")
        check_group(self.nnodes, self.node_rank, self.master_port)
        if self.warmup_first_tokens is not None and (not isinstance(self.warmup_first_tokens, int)
                                                     or isinstance(self.warmup_first_tokens, bool)
                                                     or self.warmup_first_tokens < 1):
            raise ValueError(f"warmup_first_tokens={self.warmup_first_tokens!r} must be None or an integer >= 1")
        if self.nnodes > 1 and self.data_parallel_size > 1:
            raise ValueError(f"data_parallel_size={self.data_parallel_size} with nnodes={self.nnodes}: data-parallel "
                             "replicas of a multi-process group are not supported (run one server per group)")
        if self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size={self.page_size} must be a power of two")
        for name in ("max_model_len", "num_pages"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name}={v!r} must be an integer >= 1 or None")
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r} must be one of {BACKENDS}")
        check_generation_config(self.generation_config)
        for name, what in (("executable_keep_alive", "seconds >= 0 (0: never unload)"),
                           ("log_stats_interval", "seconds >= 0"), ("kv_offload_gb", "GiB >= 0 (0: no host tier)")):
            v = getattr(self, name)
            if not isinstance(v, int | float) or isinstance(v, bool) or not 0 <= v < float("inf"):
                raise ValueError(f"{name}={v!r} must be a number of {what}")
        v = self.kv_offload_gb
        if v and not self.enable_prefix_caching:
            raise ValueError(f"kv_offload_gb={v} needs enable_prefix_caching=True: the host tier holds pages "
                             "evicted from the prefix cache")
        if v and self.nnodes > 1:
            raise ValueError(f"kv_offload_gb={v} with nnodes={self.nnodes}: the host tier is not supported "
                             "across several processes")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")


@dataclass
class _Seq:
    """Text-side state of one sequence (one of a request's n samples)."""

    parent_id: str
    index: int
    params: SamplingParams
    seed: int
    detok: IncrementalDetokenizer | None
    prompt_mask: object = None  # packed prompt token set, only for repetition penalty
    text: str = ""  # all text decoded so far (stop strings are searched here)
    emitted: int = 0  # chars of `text` already sent
    num_prompt_tokens: int = 0
    min_tokens_ids: tuple[int, ...] = ()  # masked (EOS, stop ids) while fewer than min_tokens tokens exist
    # prompt_logprobs: the prompt's ids and one entry per prompt token (the first None), filled as the
    # prefill's chunks are read back and sent with the first delta; None when not asked for.
    prompt_ids: list[int] | None = None
    prompt_lps: list[dict[int, float] | None] | None = None
    matcher: object = None  # structured outputs: this sequence's llguidance matcher (jinfer/engine/grammar.py)
    held: list[int] = field(default_factory=list)  # token ids whose text is not sent yet


_LIVE_ENGINES: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _release_engines() -> None:
    """Free every engine's device state on the main thread before the interpreter shuts down. Left to
    the final garbage collection, its XLA objects could be freed on a daemon thread (tqdm's monitor),
    which aborted the process ("terminate called without an active exception") about half the time."""
    for core in list(_LIVE_ENGINES):
        if isinstance(core.group, Leader):
            core.close()
        if core.runner is not None and core.runner.host_pool is not None:
            core.runner.host_pool.join()  # its reservation and offload threads hold XLA buffers
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


class EngineCore:
    def __init__(self, config: EngineConfig = EngineConfig(), *, tokenizer: Tokenizer | None = None):
        t0 = time.perf_counter()
        age = _process_age_s()
        phases = _Phases()
        from jax._src import xla_bridge

        if not xla_bridge.backends_are_initialized():
            os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", MEM_FRACTION)
        self.config = config
        # Several processes: join the group before anything starts JAX's backends (distributed.py).
        self.group = join(config.nnodes, config.node_rank, config.master_addr, config.master_port)
        cache_dir = enable_compilation_cache(config.compilation_cache_dir) if config.compilation_cache_dir != "" \
            else None
        source = resolve_model(config.model, config.load_format)
        phases("resolve")
        self.model_config: ModelConfig = source.config
        self.model_name = config.model or "SmolLM2-135M-Instruct"
        self.generation_defaults = load_generation_defaults(config.generation_config, source.path)
        self.tokenizer = tokenizer
        self.tokenizer_path: str | None = None  # where another process on this host can load it
        if self.tokenizer is None and source.path is not None:
            if source.path.is_file() or (source.path / "tokenizer.json").exists():
                self.tokenizer = Tokenizer.from_pretrained(source.path)
                self.tokenizer_path = str(source.path)
            else:
                log.warning("%s has no tokenizer.json: prompts must be token ids, outputs carry no text", source.path)
        phases("tokenizer")
        self.dtype = config.dtype if config.dtype != "auto" else (
            "float32" if jax.default_backend() == "cpu" else "bfloat16")
        jax.devices()  # (the backend starts here when dtype was given, else above)
        phases("backend")
        check_parallel(self.model_config, config.tensor_parallel_size, config.enable_expert_parallel)
        tp, rank = config.tensor_parallel_size, config.data_parallel_rank
        if self.group is not None and tp != jax.device_count():
            raise ValueError(f"tensor_parallel_size={tp} must be the group's {jax.device_count()} devices "
                             f"({config.nnodes} processes): one mesh spans them all")
        if config.data_parallel_size * tp > len(jax.devices()):
            raise ValueError(f"data_parallel_size={config.data_parallel_size} x tensor_parallel_size={tp} needs "
                             f"{config.data_parallel_size * tp} devices; {len(jax.devices())} are available")
        mesh = make_mesh(tp, jax.devices()[rank * tp:(rank + 1) * tp])
        weights = load_weights(source, self.dtype, mesh, seed=config.seed,
                               expert_parallel=config.enable_expert_parallel)
        weights = shard_attention_weights(self.model_config, weights, mesh,
                                          expert_parallel=config.enable_expert_parallel)
        phases("weights")
        # Models with per-sequence state layers (linear attention): one state slot per running sequence, plus
        # the reserved slot 0. Their state summarises a whole prefix, so prefix-cache hits would need it
        # checkpointed at page boundaries: not built; hits are off for such models.
        self.num_state_slots = config.max_num_seqs + 1 if state_specs(self.model_config) else 0
        prefix_caching = config.enable_prefix_caching and not self.num_state_slots
        if config.enable_prefix_caching and not prefix_caching:
            log.info("prefix caching is off: %s keeps a per-sequence state in its linear-attention layers, "
                     "which a cached prefix's pages cannot restore", self.model_config.architecture)
        num_pages = config.num_pages or self._auto_num_pages(
            next(d for d in mesh.devices.flat if d.process_index == jax.process_index()))
        if self.group is not None:  # the same pool (and executables) in every process
            num_pages = self.group.agree_min("num_pages", num_pages)
        max_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                      (num_pages - 1) * config.page_size)
        self.max_model_len = max_len
        num_host_pages = self._num_host_pages(prefix_caching)
        self.kv = KVCacheManager(num_pages, config.page_size, prefix_caching, self.num_state_slots, num_host_pages)
        self.scheduler = Scheduler(SchedulerConfig(
            max_model_len=max_len, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill), self.kv)
        self.runner = ModelRunner(self.model_config, weights, mesh, num_pages=num_pages, page_size=config.page_size,
                                  kv_dtype=DTYPES[self.dtype], max_num_batched_tokens=config.max_num_batched_tokens,
                                  max_num_seqs=config.max_num_seqs, max_model_len=max_len,
                                  ops=select_ops(config.attention_backend), num_state_slots=self.num_state_slots,
                                  num_host_pages=num_host_pages, keep_alive=config.executable_keep_alive,
                                  executable_dir=os.path.join(cache_dir, "executables")
                                  if cache_dir and config.executable_cache and self.group is None else None)
        self._seqs: dict[str, _Seq] = {}  # sequence id -> state
        self._children: dict[str, list[str]] = {}  # request id -> its sequence ids
        self._rng = np.random.default_rng(config.seed)
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids) if self.tokenizer else self.model_config.eos_token_ids
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        # steps read back, and the host's time blocked reading them (waiting for the device). Time not spent
        # here is not all host work: a launch also blocks while the device's queue is full, so little waiting
        # does not by itself mean the device idles (a whole-run profile says; docs/ARCHITECTURE.md)
        self.num_steps_total = 0
        self.device_wait_seconds_total = 0.0
        self._inflight: Launched | None = None  # the launched step whose tokens are not read yet
        self.grammar = GrammarEngine(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        phases("kv cache and runner")
        if config.warmup:
            # every process of a group warms up the same shapes in the same order, all before serving
            self.runner.warmup(first_tokens=config.warmup_first_tokens if self.group is None else None)
        if isinstance(self.group, Leader):
            self.group.wait_for_workers()
            self.runner.on_launch = self.group.send_step
        phases("warm-up")
        self.startup_seconds = time.perf_counter() - t0
        log.info("start-up phases: process started %s s before the engine, then %s",
                 "?" if age is None else f"{age:.2f}", phases)
        _LIVE_ENGINES.add(self)
        log.info("engine ready in %.1f s: %s, %d KV pages of %d tokens, max_model_len %d", self.startup_seconds,
                 self.model_name, num_pages, config.page_size, max_len)

    def _num_host_pages(self, prefix_caching: bool) -> int:
        """Pages the host tier holds: kv_offload_gb GiB at one page's KV over all layers and devices."""
        cfg = self.config
        if not cfg.kv_offload_gb:
            return 0
        if not prefix_caching:
            log.info("no KV host tier: prefix caching is off for %s", self.model_config.architecture)
            return 0
        per_page = cfg.tensor_parallel_size * kv_cache_bytes_per_page(self.model_config, cfg.page_size,
                                                                      DTYPES[self.dtype], cfg.tensor_parallel_size)
        num = int(cfg.kv_offload_gb * 2**30 // per_page)
        if num < 1:
            raise ValueError(f"kv_offload_gb={cfg.kv_offload_gb} holds no page ({per_page} bytes each)")
        log.info("KV host tier: %d pages (%.2f GiB)", num, num * per_page / 2**30)
        return num

    def _auto_num_pages(self, device) -> int:
        cfg = self.config
        per_page = kv_cache_bytes_per_page(self.model_config, cfg.page_size, DTYPES[self.dtype],
                                           cfg.tensor_parallel_size)  # on each device
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            free = stats["bytes_limit"] * cfg.gpu_memory_utilization - stats.get("bytes_in_use", 0)
            budget = int(free)
        else:
            budget = CPU_KV_CACHE_BYTES
        budget -= self.num_state_slots * state_bytes_per_slot(self.model_config, DTYPES[self.dtype])
        # never more than max_num_seqs full-length sequences would need
        cap = cfg.max_num_seqs * cdiv(cfg.max_model_len or self.model_config.max_position_embeddings,
                                      cfg.page_size) + 1
        num_pages = min(budget // per_page, cap)
        if num_pages < 2:
            raise ValueError(f"not enough memory for the KV cache ({budget} bytes, {per_page} per page)")
        return int(num_pages)

    # ---- requests -----------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None) -> None:
        """Queue a request (its n samples). ValueError, naming the field, if it can never run."""
        params = params or SamplingParams()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id={request_id!r} must be a non-empty string")
        if request_id in self._children:
            raise ValueError(f"request_id={request_id!r} is already in use")
        # One C pass checks the ids are integers (a 32k-token prompt: 1.4 ms instead of 3.7 for list(map(int))
        # and min / max in Python, paid before its first token)
        if isinstance(prompt_token_ids, (str, bytes, bytearray, memoryview)):  # array("q", b) reads raw bytes
            raise ValueError(f"prompt token ids must be integers, not {type(prompt_token_ids).__name__}")
        try:
            packed = array("q", prompt_token_ids)
        except (TypeError, OverflowError) as e:
            raise ValueError(f"prompt token ids must be integers ({e})") from None
        if not packed:
            raise ValueError("prompt must not be empty")
        vocab, view = self.model_config.vocab_size, np.frombuffer(packed, np.int64)
        if view.min() < 0 or view.max() >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        ids = packed.tolist()
        n_max = params.max_tokens if params.max_tokens is not None else 1
        if len(ids) + n_max > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({n_max}) exceeds the context length "
                             f"of {self.max_model_len} tokens")
        seq_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        mask = pack_token_mask(ids, vocab) if params.repetition_penalty != 1.0 else None
        if params.logit_bias and params.logit_bias[-1][0] >= vocab:  # sorted by id
            raise ValueError(f"logit_bias= keys must be token ids in [0, {vocab})")
        # Structured outputs: the grammar compiles (or comes from the cache) before anything is queued.
        matcher = self.grammar.matcher(params.structured_outputs) if params.structured_outputs else None
        added = []
        # n > 1 on a model with per-sequence states (no prefix cache to share the prompt): the other samples fork
        # from the first once it has computed all but the prompt's last token (scheduler.py). Not with prompt
        # logprobs (every sample scores the whole prompt) nor in a multi-process group (whose other processes
        # replay steps, not the fork's copies).
        fork = (params.n > 1 and self.num_state_slots and params.prompt_logprobs is None and len(ids) > 1
                and self.group is None)
        try:
            for i, sid in enumerate(seq_ids):
                seed = params.seed + i if params.seed is not None else int(self._rng.integers(0, 2**31))
                request = Request(sid, ids, params, self.eos_token_ids)
                self.scheduler.add_request(request, fork_of=seq_ids[0] if fork and i else None)
                added.append(sid)
                detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens,
                                               prompt_ids=ids) if self.tokenizer else None
                own = matcher if i == 0 or matcher is None else self.grammar.matcher(params.structured_outputs)
                self._seqs[sid] = _Seq(request_id, i, params, seed, detok, mask, num_prompt_tokens=len(ids),
                                       min_tokens_ids=request.stop_token_ids_while_min_tokens()
                                       if params.min_tokens else (), matcher=own)
                if params.prompt_logprobs is not None:
                    self._seqs[sid].prompt_ids, self._seqs[sid].prompt_lps = ids, [None] * len(ids)
        except ValueError:
            for sid in added:
                self.scheduler.abort(sid)
                self._drop(sid)
            raise
        self._children[request_id] = seq_ids
        self.num_prompt_tokens_total += len(ids) * params.n

    def abort(self, request_id: str) -> None:
        """Drop a request and all its samples now; its pages go back to the pool. Unknown ids are ignored."""
        for sid in self._children.pop(request_id, ()):
            self.scheduler.abort(sid)
            self._drop(sid)

    def _drop(self, seq_id: str) -> None:
        self._seqs.pop(seq_id, None)

    def has_unfinished_requests(self) -> bool:
        # A step still in flight holds only finished requests once the scheduler has none: nothing to read.
        return self.scheduler.has_unfinished_requests()

    # ---- one step -----------------------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        """Schedule and launch one step; return the outputs of the step read back in this call.

        With `async_scheduling` the step launched here is read back by the next call (after it has
        launched the one after), so the host's scheduling, batch building and detokenizing overlap the
        device's work; the outputs returned are one step behind (penalties too: the sampler takes a
        pending output token from the previous step's samples on the device).
        A step that fails in a multi-process group ends the process: the group's collectives are out of
        step for good (jinfer/parallel/multihost.py).
        """
        if self.group is None:
            return self._step()
        try:
            return self._step()
        except Exception as e:
            self.group.lost(f"a step failed ({type(e).__name__}: {e}); the group cannot go on")
            raise

    def _step(self) -> list[EngineOutput]:
        outputs = []
        out = self.scheduler.schedule(*self.runner.ready_limits())
        pool = self.runner.host_pool
        if pool is not None and not out.is_empty:  # the host tier's copies now wait for read-backs
            pool.hold()
        if out.kv_transfers:  # copies between the HBM and host tiers go to the device ahead of the step
            self._transfer(out.kv_transfers)
        if out.fork_pages or out.fork_slots:  # forked samples' pages and states, ahead of the step too
            self.runner.fork(out.fork_pages, out.fork_slots)
        launched = None
        if not out.is_empty:
            rows = []
            for s in out.scheduled:
                seq, r = self._seqs[s.request_id], s.request
                rows.append(StepRow(seq.params, r.output_token_ids, seq.prompt_mask, seq.seed,
                                    r.num_output_tokens + r.num_pending_tokens - 1, seq.min_tokens_ids)
                            if s.needs_sample else None)
            wanted = [r.params for r in rows if r is not None]
            num_logprobs = num_logprobs_for(wanted) if wanted else -1
            prompt_logprobs = self._prompt_logprobs_wanted(out)
            guided = [b for b, s in enumerate(out.scheduled) if s.needs_sample and self._seqs[s.request_id].matcher]
            if not guided:
                launched = self.runner.launch(out, rows, num_logprobs, self._inflight, prompt_logprobs)
            else:
                launched, outputs = self._launch_guided(out, rows, num_logprobs, guided, outputs, prompt_logprobs)
        if self._inflight is not None:
            outputs += self._complete(self._inflight)
        self._inflight = launched
        if launched is not None and not self.config.async_scheduling:
            outputs += self._complete(launched)
            self._inflight = None
        return outputs

    def _transfer(self, transfers) -> None:
        if dropped := self.runner.transfer(transfers):
            self.kv.host.forget(dropped)

    def idle(self) -> None:
        """Work for an engine with nothing to run (its loop calls this when it goes idle): the host tier's
        write-backs still waiting are copied now, not in front of the next request's schedule (a restore
        would wait for them on PCIe)."""
        if self.kv.host is not None and (transfers := self.kv.take_transfers(flush=True)):
            self._transfer(transfers)
        if self.runner.host_pool is not None:
            self.runner.host_pool.release()

    def unload_idle(self) -> int:
        """Drop the executables no step used for `executable_keep_alive` seconds (the engine loop calls this while
        idle); returns how many buckets were dropped."""
        return self.runner.unload_idle()

    def _prompt_logprobs_wanted(self, out) -> tuple[int, list[bool]] | None:
        """(top k, which scheduled sequences) for the prompt logprobs of this step's prefill chunks."""
        wants = []
        for s in out.scheduled:
            seq = self._seqs[s.request_id]
            wants.append(seq.prompt_lps is not None and s.start < seq.num_prompt_tokens - 1)
        if not any(wants):
            return None
        k = max(self._seqs[s.request_id].params.prompt_logprobs for s, w in zip(out.scheduled, wants) if w)
        return k, wants

    def _record_prompt_logprobs(self, launched: Launched) -> None:
        plp = self.runner.fetch_prompt_logprobs(launched)
        if plp is None:
            return
        for i, (sid, pos) in enumerate(launched.prompt_rows):
            seq = self._seqs.get(sid)
            if seq is None or seq.prompt_lps is None:  # aborted, or sent already (a recompute after preemption)
                continue
            k = seq.params.prompt_logprobs
            lp = {int(t): float(v) for t, v in zip(plp.top_ids[i][:k], plp.top_logprobs[i][:k])}
            lp[seq.prompt_ids[pos]] = float(plp.logprobs[i])
            seq.prompt_lps[pos] = lp

    def _launch_guided(self, out, rows, num_logprobs: int, guided: list[int], outputs: list[EngineOutput],
                       prompt_logprobs=None):
        """Launch a step with grammar-constrained rows. Their masks need the grammars advanced by the step
        in flight: the forward goes first, then that step is read back and the masks computed while the
        device runs the forward, then the sampler follows (async scheduling stays on). A multi-process group
        replays whole steps, so there (and in steps with prompt logprobs) the step in flight is read back
        before the launch."""
        prev = self._inflight
        if prev is not None and self.runner.on_launch is None and prompt_logprobs is None:
            fwd = self.runner.launch_forward(out, prev)
            outputs += self._complete(prev)
            self._inflight = None
            return self.runner.launch_sample(fwd, rows, num_logprobs, self._grammar_masks(out, guided)), outputs
        if prev is not None:
            outputs += self._complete(prev)
            self._inflight = None
        return self.runner.launch(out, rows, num_logprobs, prev, prompt_logprobs, self._grammar_masks(out, guided),
                                  pending_outputs=False), outputs

    def _grammar_masks(self, out, guided: list[int]):
        live = [(self._seqs[s.request_id].matcher, b) for b in guided
                if not (s := out.scheduled[b]).request.is_finished]
        return self.grammar.fill_masks(live, self.runner.batch_rows(out))  # padded rows allow everything

    def _complete(self, launched: Launched) -> list[EngineOutput]:
        """Read a launched step's tokens back, advance the scheduler and build the deltas."""
        out = launched.out
        t = time.perf_counter()
        result = self.runner.fetch(launched)
        self.device_wait_seconds_total += time.perf_counter() - t
        self.num_steps_total += 1
        if self.runner.host_pool is not None:  # host-tier copies may go out until the next read-back is due
            self.runner.host_pool.read_back()
        self._record_prompt_logprobs(launched)
        live = [(b, s) for b, s in enumerate(out.scheduled) if s.needs_sample and not s.request.is_finished]
        sampled = {s.request_id: int(result.tokens[b]) for b, s in live}
        finished = {r.request_id: r for r in self.scheduler.update(out, sampled)}
        for _, s in live:  # structured outputs: a grammar that can go no further ends its sequence
            matcher = self._seqs[s.request_id].matcher
            if matcher is not None and self.grammar.advance(matcher, sampled[s.request_id]) \
                    and s.request_id not in finished:
                finished[s.request_id] = self.scheduler.finish_request(s.request_id, FinishReason.STOP)
        outputs = []
        for b, s in live:
            request, seq = s.request, self._seqs[s.request_id]
            token = sampled[s.request_id]
            self.num_generation_tokens_total += 1
            lps = None
            if seq.params.logprobs is not None:
                n = seq.params.logprobs
                lp = {int(i): float(v) for i, v in zip(result.top_ids[b][:n], result.top_logprobs[b][:n])}
                lp[token] = float(result.logprobs[b])
                lps = [lp]
            outputs.append(self._emit(request, seq, token, lps, finished.get(s.request_id)))
        return outputs

    def _emit(self, request: Request, seq: _Seq, token: int, lps, finished: Request | None) -> EngineOutput:
        """Detokenize one new token, apply stop strings, and build the delta to send."""
        sp = seq.params
        stop_hit = None
        eos_finish = finished is not None and finished.finish_reason == FinishReason.STOP and \
            finished.stop_reason is None and token in request.eos_token_ids
        if seq.detok is not None:
            if not eos_finish:  # the EOS token's own text is never part of the output
                seq.text += seq.detok.add(token)
            if finished is not None:
                seq.text += seq.detok.flush()
            if sp.stop and request.num_output_tokens >= sp.min_tokens:  # as vLLM: no stop string before min_tokens
                stop_hit = self._find_stop(seq, sp)
        seq.held.append(token)
        done = finished is not None or stop_hit is not None
        if stop_hit is not None and finished is None:
            self.scheduler.finish_request(request.request_id, FinishReason.STOP, stop_hit)
        # Hold back text that may be the start of a stop string, so it is never sent then retracted.
        hold = 0 if done or not sp.stop else max(len(s) for s in sp.stop) - 1
        upto = max(seq.emitted, len(seq.text) - hold)
        new_text = seq.text[seq.emitted:upto]
        seq.emitted = upto
        ids, seq.held = seq.held, []
        delta = EngineOutput(seq.parent_id, seq.index, ids, new_text, finished=done,
                             new_logprobs=lps, num_prompt_tokens=seq.num_prompt_tokens,
                             num_cached_tokens=request.num_cached_tokens, prompt_logprobs=seq.prompt_lps)
        seq.prompt_lps = None  # sent with the first delta
        if done:
            delta.finish_reason = str(FinishReason.STOP if stop_hit is not None else request.finish_reason)
            delta.stop_reason = stop_hit if stop_hit is not None else request.stop_reason
            self._forget(request.request_id)
        return delta

    @staticmethod
    def _find_stop(seq: _Seq, sp: SamplingParams) -> str | None:
        """Search the not-yet-sent text for a stop string; on a hit, cut the text there."""
        longest = max(len(s) for s in sp.stop)
        start = max(0, seq.emitted - longest + 1)
        best = None
        for stop in sp.stop:
            i = seq.text.find(stop, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, stop)
        if best is None:
            return None
        i, stop = best
        seq.text = seq.text[:i + len(stop)] if sp.include_stop_str_in_output else seq.text[:i]
        return stop

    def _forget(self, seq_id: str) -> None:
        seq = self._seqs[seq_id]
        self._drop(seq_id)
        children = self._children.get(seq.parent_id)
        if children is not None and all(c not in self._seqs for c in children):
            del self._children[seq.parent_id]

    # ---- stats --------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop a staged warm-up's background compiles and a multi-process group (the other processes exit)."""
        self.runner.stop_background()
        if self.group is not None:
            self.group.close()

    def _host_tier_stats(self) -> dict:
        host, pool = self.kv.host, self.runner.host_pool
        if host is None:
            return {}
        return {"kv_host_pages": host.num_slots, "kv_host_used_pages": host.num_used_slots,
                "kv_host_usage": host.num_used_slots / host.num_slots,
                "kv_offload_bytes_total": host.num_offloaded_pages * pool.page_bytes,
                "kv_restore_bytes_total": host.num_restored_pages * pool.page_bytes,
                "kv_offload_dropped_pages": host.num_dropped_offloads}

    def stats(self) -> dict:
        return {**self.scheduler.stats(), "kv_usage": self.kv.usage, "num_pages": self.kv.num_usable_pages,
                "num_free_pages": self.kv.num_free_pages,
                "prompt_tokens_total": self.num_prompt_tokens_total,
                "generation_tokens_total": self.num_generation_tokens_total,
                "steps_total": self.num_steps_total, "device_wait_seconds_total": self.device_wait_seconds_total,
                **self._host_tier_stats(),
                "compiles_after_warmup": self.runner.compiles_after_warmup,
                "warmup_pending": self.runner.warmup_pending(),
                "executable_unloads_total": self.runner.unloads, "executable_reloads_total": self.runner.reloads}

"""Engine and scheduler options: frozen dataclasses, validated once in `__post_init__` (ValueError naming the
field) where the arguments are parsed: `jinfer serve` / `jinfer generate` (server/cli.py, jinfer/engine/args.py)
or `LLM(...)`. JAX-free, so the HTTP server's process validates the options before it starts the engine; the
engine process gets the fields (`dataclasses.asdict`) and builds the same config again, which checks them again.

No environment reads here: the ones that set a default (JINFER_COMPILATION_CACHE) are read where the
arguments are parsed (`jinfer.engine.args.compilation_cache_dir_from_env`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jinfer.cache.kv_events import KVEventsConfig
from jinfer.config.kernels import BACKENDS, KernelPolicy
from jinfer.config.pooling import RUNNERS
from jinfer.config.speculative import SpeculativeConfig
from jinfer.generation_config import check_setting as check_generation_config
from jinfer.sampling_params import MAX_LOGPROBS

DTYPE_NAMES = ("float32", "bfloat16", "float16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's (and PyTorch's) other names
# KV pages' dtype: "auto" or the model's dtype by name, or "fp8": float8_e4m3fn with a float32 scale per layer and
# kv head (jinfer/cache/spec.py's AttentionKV), twice the pages in the same memory. vLLM's "fp8_e4m3" names it too.
KV_CACHE_DTYPES = ("auto", *DTYPE_NAMES, "fp8")
KV_CACHE_DTYPE_ALIASES = {"fp8_e4m3": "fp8"}
# None: the checkpoint's own format (unquantized, block FP8, or a GGUF's blocks dequantized at load); "gguf" names the
# last; "fp8" quantizes a float checkpoint's linear weights at load to block FP8 (jinfer/config/quantization.py).
QUANTIZATIONS = ("gguf", "fp8")
# "auto": Pallas on GPU, jnp elsewhere; "pallas-triton": no Mosaic GPU kernel.
ATTENTION_BACKENDS = BACKENDS
DEFAULT_COMPILATION_CACHE_DIR = "~/.cache/jinfer/xla"
DISTRIBUTED_EXECUTOR_BACKENDS = ("auto", "mp", "uni")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_positive_ints(obj: object, names: tuple[str, ...], *, optional: bool = False) -> None:
    for name in names:
        v = getattr(obj, name)
        if optional and v is None:
            continue
        if not _is_int(v) or v < 1:
            raise ValueError(f"{name}={v!r} must be an integer >= 1" + (" or None" if optional else ""))


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    max_model_len: int  # max tokens per sequence, prompt + output
    max_num_seqs: int = 256  # cap on running requests
    max_num_batched_tokens: int = 2048  # token budget per step
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int | None = None  # cap on one request's tokens per step

    def __post_init__(self):
        _check_positive_ints(self, ("max_model_len", "max_num_seqs", "max_num_batched_tokens"))
        _check_positive_ints(self, ("long_prefill_token_threshold",), optional=True)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                             f"max_model_len={self.max_model_len} when chunked prefill is off")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None: the embedded default model; else a path, dummy:<shape> or a Hugging Face ID
    revision: str | None = None  # the model's Hub revision: branch, tag or commit (default: main)
    download_dir: str | None = None  # Hub cache directory (default: huggingface_hub's, under $HF_HOME)
    tokenizer: str | None = None  # a directory, .gguf file or Hub ID (default: the model's)
    chat_template: str | None = None  # a Jinja chat template (its text) replacing the tokenizer's
    dtype: str = "auto"  # "auto": bfloat16 on accelerators, float32 on CPU (faster there); "half" = float16
    kv_cache_dtype: str = "auto"  # "auto": the model's dtype; "fp8" (= "fp8_e4m3"): e4m3 pages with scales
    quantization: str | None = None  # None: the checkpoint's own format
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
    # How an engine process drives its -tp GPUs of one host (vLLM's flag; jinfer/parallel/local_group.py): "mp" one
    # process per GPU (the engine process spawns the others: a `nnodes` group on 127.0.0.1), "uni" one process for
    # all, "auto" mp where it applies (GPUs, tp > 1, one engine, nothing a group refuses), else uni.
    distributed_executor_backend: str = "auto"
    seed: int = 0
    attention_backend: str = "auto"  # one of ATTENTION_BACKENDS (overrides kernel_policy's)
    # Every other kernel choice (jinfer/config/kernels.py); part of the compiled step's key. The CLI builds it from
    # the JINFER_* measurement switches (`KernelPolicy.from_env`); a dict (the fields, as sent) is accepted.
    kernel_policy: KernelPolicy = field(default_factory=KernelPolicy)
    # A multi-process group: a peer silent this long once the group is up is lost (a dead process is seen at once
    # by its closed connection; this covers a host that vanished).
    peer_timeout_s: float = 5.0
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
    # JAX's persistent compilation cache ("" off). The CLI and LLM(...) take $JINFER_COMPILATION_CACHE over this.
    compilation_cache_dir: str = DEFAULT_COMPILATION_CACHE_DIR
    log_stats_interval: float = 10.0  # seconds between the engine process's stats lines (0: none)
    generation_config: str = "auto"  # default sampling parameters: "auto" (the model's), "vllm" (none) or a dir
    max_logprobs: int = MAX_LOGPROBS  # most top logprobs a request may ask for (logprobs, prompt_logprobs)
    # Speculative decoding (jinfer/config/speculative.py): vLLM's dict or JSON form is accepted. None: off.
    speculative_config: SpeculativeConfig | None = None
    # KV-cache events over ZeroMQ for cache-aware routers (jinfer/cache/kv_events.py): vLLM's KVEventsConfig as a
    # dict or JSON. None: off.
    kv_events_config: KVEventsConfig | None = None
    # "generate", "pooling" (embeddings) or "auto" (pooling for embedding checkpoints): jinfer/config/pooling.py
    runner: str = "auto"
    # MoE models: each step also counts the (token, top-k slot) pairs every expert got (jinfer/engine/expert_load.py:
    # per step and cumulative, per expert-parallel rank, the imbalance) into the stats. Part of the step's key.
    expert_load_stats: bool = False

    def __post_init__(self):
        if isinstance(self.kernel_policy, dict):
            object.__setattr__(self, "kernel_policy", KernelPolicy(**self.kernel_policy))
        if not isinstance(self.kernel_policy, KernelPolicy):
            raise ValueError(f"kernel_policy={self.kernel_policy!r} must be a KernelPolicy")
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        object.__setattr__(self, "kv_events_config", KVEventsConfig.parse(self.kv_events_config))
        if not isinstance(self.peer_timeout_s, int | float) or not 0 < self.peer_timeout_s < float("inf"):
            raise ValueError(f"peer_timeout_s={self.peer_timeout_s!r} must be a number of seconds > 0")
        object.__setattr__(self, "dtype", DTYPE_ALIASES.get(self.dtype, self.dtype))
        if self.dtype != "auto" and self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype={self.dtype!r} must be 'auto' or one of {sorted([*DTYPE_NAMES, *DTYPE_ALIASES])}")
        self._check_formats()
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format={self.load_format!r} must be 'auto' or 'dummy'")
        _check_positive_ints(self, ("max_num_seqs", "max_num_batched_tokens", "page_size", "tensor_parallel_size",
                                    "data_parallel_size", "nnodes"))
        _check_positive_ints(self, ("max_model_len", "num_pages", "warmup_first_tokens"), optional=True)
        if not _is_int(self.data_parallel_rank) or not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(f"data_parallel_rank={self.data_parallel_rank!r} must be in "
                             f"[0, data_parallel_size={self.data_parallel_size})")
        if not _is_int(self.node_rank) or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank={self.node_rank!r} must be in [0, nnodes={self.nnodes})")
        if not _is_int(self.master_port) or not 0 < self.master_port < 65536:
            raise ValueError(f"master_port={self.master_port!r} must be a TCP port in [1, 65535]")
        if self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size={self.page_size} must be a power of two")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r} must be one of {ATTENTION_BACKENDS}")
        if not isinstance(self.compilation_cache_dir, str):
            raise ValueError(f"compilation_cache_dir={self.compilation_cache_dir!r} must be a directory ('' = off)")
        check_generation_config(self.generation_config)
        for name in ("expert_load_stats",):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner={self.runner!r} must be one of {RUNNERS}")
        for name, what in (("executable_keep_alive", "seconds >= 0 (0: never unload)"),
                           ("log_stats_interval", "seconds >= 0"), ("kv_offload_gb", "GiB >= 0 (0: no host tier)")):
            v = getattr(self, name)
            if not isinstance(v, int | float) or isinstance(v, bool) or not 0 <= v < float("inf"):
                raise ValueError(f"{name}={v!r} must be a number of {what}")
        v = self.kv_offload_gb
        if v and not self.enable_prefix_caching:
            raise ValueError(f"kv_offload_gb={v} needs enable_prefix_caching=True: the host tier holds pages "
                             "evicted from the prefix cache")
        self._check_group()
        if not isinstance(self.gpu_memory_utilization, int | float) or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")

    def group_refusal(self) -> tuple[str, str] | None:
        """What in this configuration a multi-process group (`nnodes`, or `distributed_executor_backend='mp'`) does
        not support, as (the field and its value, why), or None."""
        if self.data_parallel_size > 1:
            return (f"data_parallel_size={self.data_parallel_size}", "data-parallel replicas of a multi-process group "
                    "are not supported (run one server per group)")
        if self.kv_offload_gb:
            return f"kv_offload_gb={self.kv_offload_gb}", "the host tier is not supported across several processes"
        if (spec := self.speculative_config) is not None and spec.method in ("eagle3", "mtp"):
            return f"speculative_config.method={spec.method!r}", "a draft head runs in one process"
        return None

    def _check_group(self) -> None:
        backend = self.distributed_executor_backend
        if backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend={backend!r} must be one of "
                             f"{DISTRIBUTED_EXECUTOR_BACKENDS}")
        if backend == "mp" and self.nnodes > 1:
            raise ValueError(f"distributed_executor_backend='mp' with nnodes={self.nnodes}: the group is already one "
                             "process per member")
        if (self.nnodes > 1 or backend == "mp") and (refused := self.group_refusal()):
            what, why = refused
            group = f"nnodes={self.nnodes}" if self.nnodes > 1 else "distributed_executor_backend='mp'"
            raise ValueError(f"{what} with {group}: {why}")

    def _check_formats(self) -> None:
        """kv_cache_dtype, quantization, max_logprobs and the strings naming where the model comes from."""
        kv = self.kv_cache_dtype
        kv = KV_CACHE_DTYPE_ALIASES.get(kv, DTYPE_ALIASES.get(kv, kv)) if isinstance(kv, str) else kv
        object.__setattr__(self, "kv_cache_dtype", kv)
        if kv not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={kv!r} must be one of {[*KV_CACHE_DTYPES, *KV_CACHE_DTYPE_ALIASES]} "
                             "(FP8 is e4m3 only)")
        if kv not in ("auto", "fp8") and self.dtype != "auto" and kv != self.dtype:
            raise ValueError(f"kv_cache_dtype={kv!r} must be 'auto', 'fp8' or the model's dtype={self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization={self.quantization!r} is not supported: jinfer loads unquantized and FP8 "
                             "safetensors checkpoints (block-FP8, compressed-tensors: their own format, read from "
                             f"config.json) and GGUF files (dequantized at load); one of {QUANTIZATIONS} or None")
        if not _is_int(self.max_logprobs) or not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"max_logprobs={self.max_logprobs!r} must be an integer in [0, {MAX_LOGPROBS}]")
        for name in ("revision", "download_dir", "tokenizer", "chat_template"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"{name}={v!r} must be a non-empty string or None")

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The scheduler's options, once the context length is known (it depends on the KV pool's size)."""
        return SchedulerConfig(max_model_len=max_model_len, max_num_seqs=self.max_num_seqs,
                               max_num_batched_tokens=self.max_num_batched_tokens,
                               enable_chunked_prefill=self.enable_chunked_prefill)

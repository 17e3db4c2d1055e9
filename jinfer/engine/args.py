"""Engine options on the command line, shared by `jinfer generate` and `jinfer serve`.

Every flag defaults to None, meaning "EngineConfig's default", so the defaults live in one place
(`jinfer/config/engine.py:EngineConfig`). The environment variables that set a default are read here, where the
arguments are parsed, never below (JINFER_COMPILATION_CACHE: `compilation_cache_dir_from_env`).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from pathlib import Path

from jinfer.config.engine import (
    ATTENTION_BACKENDS,
    DISTRIBUTED_EXECUTOR_BACKENDS,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    EngineConfig,
)
from jinfer.config.kernels import KernelPolicy
from jinfer.config.pooling import RUNNERS, TASK_RUNNERS

log = logging.getLogger("jinfer")

# `jinfer serve` is ready once these steps compile; the other shapes follow in the background.
SERVE_WARMUP_FIRST_TOKENS = 256
# ... and drops the executables of the other shapes after this many seconds unused (they load again on demand).
SERVE_EXECUTABLE_KEEP_ALIVE_S = 60.0

# CLI flag -> EngineConfig field (when given: None means "EngineConfig's default").
_ENGINE_OPTIONS = ("dtype", "load_format", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_pages",
                   "page_size", "gpu_memory_utilization", "tensor_parallel_size", "seed", "attention_backend",
                   "compilation_cache_dir", "nnodes", "node_rank", "master_addr", "master_port",
                   "distributed_executor_backend",
                   "log_stats_interval", "generation_config", "kv_offload_gb", "executable_keep_alive",
                   "speculative_config", "revision", "download_dir", "tokenizer", "chat_template", "kv_cache_dtype",
                   "quantization", "max_logprobs", "enable_prefix_caching", "enable_chunked_prefill", "runner")
# vLLM's engine arguments that are no EngineConfig field, as flags and as LLM(...) keywords: `vllm_engine_args`
# says what each becomes here.
VLLM_ARGS = ("enforce_eager", "block_size", "swap_space", "trust_remote_code", "disable_log_stats",
             "disable_log_requests")
# Accepted for a vLLM user's command line or script, with no effect here: why, logged once when given.
_NO_EFFECT = {
    "trust_remote_code": "jinfer runs its own implementation of each architecture, never code from a model's "
                         "repository",
    "swap_space": "preempted requests are recomputed, as in vLLM V1 (--kv-offload-gb gives the prefix cache a host "
                  "tier)",
}
# Characters only a template has (vLLM's rule): a --chat-template value without them must be a file.
_JINJA_CHARS = "{}\n"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help shows its default: a help that names it is left alone (the engine flags default to None,
    "not given", and name EngineConfig's default), a None default is "none", the others argparse's "(default: X)"."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS:
            return text
        if action.default is None:
            return f"{text} (default: none)"
        return super()._get_help_string(action)


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def _default(name: str) -> str:
    """" (default: X)" with EngineConfig's default for field `name`: the flags default to None (not given)."""
    value = _CONFIG_DEFAULTS[name]
    return f" (default: {'none' if value is None else value})"


_CONFIG_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    e = parser.add_argument_group("engine")
    e.add_argument("--dtype", default=None, choices=["auto", "half", "float16", "bfloat16", "float", "float32"],
                   help="weights' and activations' dtype; auto: bfloat16 on GPU, float32 on CPU" + _default("dtype"))
    e.add_argument("--load-format", default=None, choices=["auto", "dummy"],
                   help="dummy: random weights at the model's config" + _default("load_format"))
    e.add_argument("--revision", default=None, help="the model's Hub revision: branch, tag or commit (default: main)")
    e.add_argument("--download-dir", default=None,
                   help="Hugging Face cache to download to and look in (default: huggingface_hub's, under $HF_HOME)")
    e.add_argument("--tokenizer", default=None, help="tokenizer directory, .gguf file or Hub ID (default: the model's)")
    e.add_argument("--chat-template", default=None,
                   help="Jinja chat template replacing the tokenizer's: a file, or the template itself "
                        "(default: the tokenizer's)")
    e.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM's command lines; no effect: no model code is ever run from a repository")
    e.add_argument("--quantization", "-q", default=None, metavar="|".join(QUANTIZATIONS),
                   help="fp8: linear weights quantized at load to FP8 with a scale per 128 x 128 block (a block-FP8 "
                        "checkpoint is read as it is); gguf: a GGUF file, dequantized at load (default: the "
                        "checkpoint's format)")
    e.add_argument("--kv-cache-dtype", default=None, metavar="|".join(KV_CACHE_DTYPES),
                   help="KV pages' dtype: auto (the model's), or fp8 (= fp8_e4m3: e4m3 with a scale per layer and kv "
                        "head, 1.0 or the checkpoint's k_scale / v_scale; twice the pages)"
                        + _default("kv_cache_dtype"))
    e.add_argument("--max-model-len", type=int, default=None,
                   help="tokens per sequence, prompt and output; above the model's limit or the KV cache's "
                        "capacity is an error (default: the model's max_position_embeddings, capped by the KV cache)")
    e.add_argument("--max-num-seqs", type=int, default=None,
                   help="most sequences running at once" + _default("max_num_seqs"))
    e.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step (prefill chunks and decodes)" + _default("max_num_batched_tokens"))
    e.add_argument("--num-pages", type=int, default=None,
                   help="KV pages in the pool (default: what --gpu-memory-utilization leaves; 1 GiB on CPU)")
    e.add_argument("--block-size", "--page-size", dest="page_size", type=int, default=None, metavar="N",
                   help="tokens per KV page, a power of two" + _default("page_size"))
    e.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="fraction of the device's memory for weights, activations and KV cache"
                        + _default("gpu_memory_utilization"))
    e.add_argument("--swap-space", type=float, default=None, metavar="GIB",
                   help="accepted for vLLM's command lines; no effect: preempted requests are recomputed "
                        "(see --kv-offload-gb)")
    e.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                   help="devices the model is split over (tensor parallel; experts too, see below)"
                        + _default("tensor_parallel_size"))
    e.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE models: split whole experts over the tensor-parallel devices instead of each "
                        "expert's columns")
    e.add_argument("--nnodes", type=int, default=None,
                   help="processes (hosts) one mesh spans; each runs this command with its own --node-rank"
                        + _default("nnodes"))
    e.add_argument("--node-rank", type=int, default=None,
                   help="this process's rank in [0, nnodes): 0 schedules (and serves); the others follow it, "
                        "headless" + _default("node_rank"))
    e.add_argument("--master-addr", default=None,
                   help="host of process 0 (JAX's coordinator)" + _default("master_addr"))
    e.add_argument("--master-port", type=int, default=None,
                   help="port of JAX's coordinator on process 0" + _default("master_port"))
    e.add_argument("--distributed-executor-backend", default=None, choices=list(DISTRIBUTED_EXECUTOR_BACKENDS),
                   help="-tp GPUs of one host: mp = one process per GPU (faster), uni = one process for all; "
                        "auto = mp where a multi-process group supports the configuration"
                        + _default("distributed_executor_backend"))
    e.add_argument("--seed", type=int, default=None, help="seed of requests without one" + _default("seed"))
    e.add_argument("--attention-backend", default=None, choices=list(ATTENTION_BACKENDS),
                   help="pallas: Pallas kernels (Mosaic GPU for long prefills, Triton elsewhere); "
                        "pallas-triton: Triton kernels only; auto: pallas on GPU, reference elsewhere"
                        + _default("attention_backend"))
    e.add_argument("--compilation-cache-dir", default=None,
                   help="JAX compilation cache ('' = off; default $JINFER_COMPILATION_CACHE, else ~/.cache/jinfer/xla)")
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV pages of prompts' shared prefixes (default: on)")
    e.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false", default=None,
                   help=argparse.SUPPRESS)
    e.add_argument("--kv-offload-gb", type=float, default=None, metavar="GIB",
                   help="host memory (GiB, pinned) for KV pages evicted from the HBM prefix cache: a prefix found "
                        "there is copied back instead of recomputed (default 0: off)")
    e.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="split long prompts over steps of --max-num-batched-tokens (default: on)")
    e.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false", default=None,
                   help=argparse.SUPPRESS)
    e.add_argument("--enforce-eager", action="store_true",
                   help="compile each step shape when first used instead of all at start-up (vLLM: no CUDA graph "
                        "capture): a faster start, slower first requests; the same as --no-warmup")
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
    e.add_argument("--max-logprobs", type=int, default=None,
                   help="most top logprobs a request may ask for" + _default("max_logprobs"))
    e.add_argument("--log-stats-interval", type=float, default=None,
                   help="seconds between the engine's stats log lines (throughput, running/waiting, KV usage, "
                        "prefix-cache hit rate); 0 turns them off" + _default("log_stats_interval"))
    e.add_argument("--generation-config", default=None,
                   help="default sampling parameters: auto (the model's generation_config.json), vllm "
                        "(none), or a directory holding a generation_config.json; a request's values win"
                        + _default("generation_config"))
    e.add_argument("--disable-log-stats", action="store_true", help="no periodic stats lines (vLLM's flag)")
    e.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as vLLM takes it: \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_min": 2, "prompt_lookup_max": 5}\' (n-gram drafts from the sequence itself; '
                        'steps are then read back before the next is scheduled; default: off)')
    e.add_argument("--runner", default=None, choices=list(RUNNERS),
                   help="generate (text), pooling (embeddings: /v1/embeddings), or auto (default): pooling for "
                        "embedding checkpoints (a base model without an LM head, or sentence-transformers metadata)")
    e.add_argument("--task", default=None, choices=sorted(TASK_RUNNERS),
                   help="vLLM's older name for --runner: embed = pooling")
    e.add_argument("--no-async-scheduling", action="store_true",
                   help="read each step's tokens back before scheduling the next (no overlap of host and device)")
    e.add_argument("--expert-load-stats", action="store_true",
                   help="MoE models: count each step's tokens per expert on the device and report the load per "
                        "expert and expert-parallel rank and its imbalance (max / mean rank load) in the stats line "
                        "and /metrics (default: off, the step unchanged)")


def engine_config_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig keyword arguments for the flags given (model included)."""
    kw = {name: getattr(args, name) for name in _ENGINE_OPTIONS if getattr(args, name, None) is not None}
    kw |= {name: getattr(args, name) for name in VLLM_ARGS if getattr(args, name, None)}
    kw["model"] = _model_argument(args)
    if getattr(args, "task", None) is not None and "runner" not in kw:
        kw["runner"] = TASK_RUNNERS[args.task]
    if getattr(args, "enable_expert_parallel", False):
        kw["enable_expert_parallel"] = True
    if args.no_warmup:
        kw["warmup"] = False
    first = getattr(args, "warmup_first_tokens", None)
    if first is not None:
        kw["warmup_first_tokens"] = first or None  # 0: everything before serving
    if getattr(args, "no_async_scheduling", False):
        kw["async_scheduling"] = False
    if getattr(args, "expert_load_stats", False):
        kw["expert_load_stats"] = True
    kw = vllm_engine_args(kw)
    kw["kernel_policy"] = KernelPolicy.from_env()  # the JINFER_* kernel switches: read here and nowhere below
    return compilation_cache_dir_from_env(kw)


def _model_argument(args: argparse.Namespace) -> str | None:
    """`jinfer serve MODEL` or `--model MODEL` (vLLM takes both); both, if they differ, is an error."""
    tag, option = getattr(args, "model_tag", None), getattr(args, "model", None)
    if tag and option and tag != option:
        raise ValueError(f"model given twice: {tag!r} (positional) and --model {option!r}")
    return tag or option


def vllm_engine_args(kw: dict) -> dict:
    """`kw` (EngineConfig fields and VLLM_ARGS) as EngineConfig fields: the one mapping of vLLM's names, for the
    command line and LLM(...). Those with no effect here are logged once, saying why."""
    kw = dict(kw)
    for name, why in _NO_EFFECT.items():
        if kw.pop(name, None):
            log.warning("%s: no effect here: %s", name, why)
    kw.pop("disable_log_requests", None)  # the server's access log (server/launcher.py); the engine logs none
    if kw.pop("enforce_eager", False):  # no ahead-of-time compiles: jinfer's counterpart of CUDA graph capture
        kw["warmup"] = False
    if kw.pop("disable_log_stats", False):
        kw["log_stats_interval"] = 0.0
    block = kw.pop("block_size", None)
    if block is not None:
        if kw.get("page_size", block) != block:
            raise ValueError(f"block_size={block} and page_size={kw['page_size']} name the same thing: give one")
        kw["page_size"] = block
    if kw.get("chat_template") is not None:
        kw["chat_template"] = load_chat_template(kw["chat_template"])
    return kw


def load_chat_template(value: str) -> str:
    """A chat template given as a file or as its text (vLLM's rule: text has '{', '}' or a newline), parsed once
    here so that a broken one fails at start-up, naming the field."""
    import jinja2

    if not isinstance(value, str) or not value:
        raise ValueError(f"chat_template={value!r} must be a file or a Jinja template")
    if not any(c in value for c in _JINJA_CHARS):
        path = Path(value).expanduser()
        try:
            value = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"chat_template={str(path)!r} looks like a file path but cannot be read "
                             f"({e.strerror or e})") from None
    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(value)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat_template: not a valid Jinja template (line {e.lineno}: {e.message})") from None
    return value


def compilation_cache_dir_from_env(kw: dict) -> dict:
    """`kw` with compilation_cache_dir from $JINFER_COMPILATION_CACHE when it names none (CLI and LLM(...))."""
    env = os.environ.get("JINFER_COMPILATION_CACHE")
    if kw.get("compilation_cache_dir") is None and env:
        return {**kw, "compilation_cache_dir": env}
    return kw

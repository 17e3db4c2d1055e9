"""KernelPolicy: every choice of kernel the forward pass makes, as one frozen value.

The policy travels inside `jinfer.ops.ModelOps` (a static argument of the jitted step), so each policy compiles its
own executables and the executable cache keys on it. Nothing below the command line reads the environment: the
`JINFER_*` measurement switches are read once, by `KernelPolicy.from_env`, where arguments are parsed (the engine's
CLI, the benchmarks). JAX-free: the choices that depend on the device (is there a GPU?) are resolved by
`jinfer.ops.select_ops`.

The defaults are the measured choices (H100 figures; docs/performance.md has the comparisons):
- pallas_mlp_tokens: the fused Pallas MLP beat XLA at T = 1 (63.7 vs 77.5 us). With the partials' padding gone it was
  still slower at decode batches 8 / 16 / 32 (TPOT 4.44 / 5.13 / 7.62 ms against XLA's 4.30 / 4.96 / 6.05;
  latency_mlp_tokens_*_qwen3-4b_h100.json), the same at 5 tokens (Qwen3-8B, 4.60 vs 4.55 ms), far slower at 40 (10.6
  vs 6.8; local_step_verify_mlp_qwen3-8b_h200.json); faster at 2 (Qwen3.5-4B's verify step of a token and a draft:
  3.09 vs 3.38 ms, local_step_verify_qwen3.5-4b_h200.json), a size no engine step has (buckets 1, 8, 16, ...: the
  small buckets that made it one were measured slower, performance.md). MoE layers' shared experts take the kernel at
  these sizes too (DeepSeek-V2-Lite batch 1 on the H200: TPOT 3.18 vs 3.95 ms with them in XLA,
  ab_shared_fused_deepseek-v2-lite_h200).
- qkv_rope_max_tokens: q/k norm + RoPE + the K/V write as one kernel up to here: at decode they are ~8 XLA kernels a
  layer of ~1.3 us launch latency each; prefill-sized steps keep XLA's fusions, which stream large inputs well.
- norm_qkv_max_tokens: the input RMSNorm, the q|k|v projection and the above as one kernel
  (pallas_kernels/dense/norm_qkv_rope.py) where the layer's q|k|v weight is fused (one device).
- prefetch_o: the norm_qkv_rope kernel's idle SMs read this fraction of the layer's o weight into L2 while it runs.
  Qwen3-4B decode steps: 20% saves 11-21 us a step at batch 1 and 36-51 at batch 8 (o 9.5 -> 8.2 us a layer, the
  q|k|v kernel 16.0 -> 17.1); the whole weight made o 6.6 us but the q|k|v kernel 35 us (local_step_prefetch_o*.json).
  A launch with no idle SMs prefetches nothing (FP8 Qwen3-8B: 8 K splits of its 48 heads, 384 programs).
- moe_front_max_tokens: a MoE block's RMSNorm + router + routing as one kernel (moe_router.moe_norm_route) up to
  here. Qwen3-30B-A3B decode steps: 3.60-3.63 vs 3.89 ms at batch 1, 4.19-4.28 vs 4.31 at 8; slower at 16 (5.23 vs
  4.83: one K split there) and 32 (local_step_front*_qwen3-30b-a3b_h100.json). DeepSeek-V2-Lite's softmax routing too
  (float32 logits): TPOT 2.81 vs 3.31 ms at batch 1 (H200, ab_front_kernel_deepseek-v2-lite_h200.json).
- mosaic_min_query_len: sequences with at least this many new tokens take the Mosaic GPU prefill kernel: a full tile
  (2 warpgroups x 64 query rows); shorter ones waste most of its rows. mosaic_min_step_tokens: steps of fewer tokens
  never launch it (decode batches, small chunks: its tile table and launch, ~0.1 ms a step over 36 layers, buy
  nothing).
- mosaic_moe_min_rows_per_expert: steps routing at least this many rows per expert run the experts on the Mosaic
  GPU grouped GEMM (482 TFLOP/s at 4096 tokens x top-8 against 251 for the Triton kernels; moe_mgpu_h100.json).
- fp8_skinny_o: one-token o projections with a block-FP8 weight take the skinny GEMM (which reads FP8) whatever the
  weight's size; off: only those under pad_vector_dots' size, as bf16 (the others dequantize, then XLA's GEMM).
  Unmeasured default: the alternative reads the FP8 bytes and writes and reads a bf16 copy unless XLA fuses it.
- fp8_max_tokens: steps of up to this many tokens with block-FP8 weights run the MLP (and MoE shared experts) on the
  fused kernel and o and other [out, in] projections (a draft head's, lm_heads) on the skinny GEMM (both read FP8)
  whatever pallas_mlp_tokens says; past it every dense projection runs on the Mosaic GPU e4m3 GEMM
  (pallas_kernels/dense/fp8_gemm_mgpu.py) where its 128 x 128 blocks fit (Qwen3-8B at 4096 tokens, H200: 1022-1155
  TFLOP/s against 601-742 for dequantizing each weight for XLA's bf16 GEMM; dense_fp8_prefill_sweep_h200.json), the
  jnp path (dequantize, XLA's GEMMs) elsewhere (at batch 8 on the H100 that path made Qwen3-8B's TPOT 14.4 ms against
  bf16's 6.3).
  (FP8 routed experts take the Triton grouped GEMMs, and in steps past mosaic_moe_min_rows_per_expert the grouped
  e4m3 GEMM, pallas_kernels/moe/moe_fp8_mgpu.py.) The kernels meet an FP8 tile with the
  activations quantized to e4m3 per row and 128 columns (pallas_kernels/dense/fp8_tiles.py): Qwen3-8B TPOT 5.66 vs
  6.41 ms at batch 1 against tiles converted to bf16 in registers (fp8mode_*_h200.json).
- one_shot_all_reduce_bytes: a sharded step's reductions of up to this many bytes a device run as our one-shot
  all-reduce over NVLink peer memory (pallas_kernels/all_reduce.py) instead of XLA's NCCL all-reduce; 0: always
  XLA's; None (the default): the kernel's whole range (1 MB) where each process drives one GPU, 16 KB where one
  process drives several. One process per GPU: Qwen3-8B tp=2 at batch 16 (128 KB a reduction) 4.03 vs 4.71 ms
  (latency_qwen3-8b_tp2_2proc_h200x2_ar*.json), Qwen3-235B-A22B ep=4 at batch 8 (64 KB) 20.70 vs 20.99 ms
  (latency_qwen3-235b-a22b_ep4_4proc_h200x4_ar*.json). One process: Qwen3-8B tp=2 on two H200s TPOT 4.24 vs
  4.98 ms at batch 1 (8 KB; one GPU 4.32), but 4.55 vs 4.41 at batch 16 (latency_qwen3-8b_tp2*_h200x2_one_shot.json).
  one_shot_all_gather_bytes: the same for the logits' all-gather (a device's float32 [T, vocab / tp]; 304 KB for
  Qwen3-8B at tp=2 and batch 1), which leaves a batch-1 step no XLA collective: TPOT 5.75 vs 7.62 ms on a noisier
  pair of H200s in one call (latency_qwen3-8b_tp2_gather*_h200x2.json).
- pad_vector_dots: XLA rewrites a one-row dot with a matrix under 10M elements into a multiply + reduce that streams
  at ~0.8 TB/s instead of ~3; `ModelOps.project` gives such dots a padding row, which keeps them GEMMs.
- verify_max_query_len: speculative decoding's verify steps (every sequence at most Q = 1 + k new tokens) run attention
  on the paged decode kernel with Q query rows per sequence (its rows a sequence's tokens x a kv head's query heads)
  where Q is at most this; longer drafts (and 0: always) the ragged prefill kernel. Unmeasured default (until measured:
  bench_local_step --query-len 1 5, run_gpu_spec.sh).
- mla_ragged_kernel: DeepSeek's MLA steps other than one-token decode (prefill chunks, mixed and verify steps) run the
  ragged MLA kernels (pallas_kernels/attention/mla_prefill.py); off: the jnp reference (the A/B's other side).
  mla_expand_min_query_len: in those steps a sequence with at least this many new tokens attends to its own new tokens
  in the expanded form (K/V decompressed by kv_b_proj, 640 FLOPs a query, key and head for V2/V3) and to the context
  before them in the absorbed form (2176, no decompression); shorter ones absorbed only; 0: never expanded. Unmeasured
  default (until measured: run_gpu_deepseek.sh mla): the FLOP break-even of decompressing a new token (2 x 512 x 256 a
  head) against the absorbed form's extra 1536 a key is ~170 keys, less with the absorbed tiles' slower dots.
- xla_dot_merger: XLA's dot merger in large (prefill) steps. Off: it merged the MLP's x @ w_gate and x @ w_up by
  concatenating the two weights anew in every layer of every prefill step (60 us a layer for Qwen3.5-4B).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

BACKENDS = ("auto", "reference", "pallas", "pallas-triton")  # pallas-triton: no Mosaic GPU kernel
EVICTION_POLICIES = ("evict_last", "normal")
# Kernels whose launch parameters `KernelPolicy.launch` may set (keyword arguments of their public functions).
LAUNCH_KERNELS = ("fused_mlp", "paged_decode_attention", "mla_decode_attention", "norm_qkv_rope", "moe_route",
                  "moe_norm_route")
# The environment switches `from_env` reads (measurements): variable -> field.
ENV_FIELDS = {
    "JINFER_PALLAS_MLP_TOKENS": "pallas_mlp_tokens",
    "JINFER_NORM_QKV_TOKENS": "norm_qkv_max_tokens",
    "JINFER_MOE_FRONT_TOKENS": "moe_front_max_tokens",
    "JINFER_PREFETCH_O": "prefetch_o",
    "JINFER_PREFETCH_EVICTION": "prefetch_eviction",
    "JINFER_XLA_DOT_MERGER": "xla_dot_merger",
    "JINFER_FP8_SKINNY_O": "fp8_skinny_o",
    "JINFER_FP8_MAX_TOKENS": "fp8_max_tokens",
    "JINFER_ONE_SHOT_ALL_REDUCE_BYTES": "one_shot_all_reduce_bytes",
    "JINFER_ONE_SHOT_ALL_GATHER_BYTES": "one_shot_all_gather_bytes",
    "JINFER_VERIFY_MAX_QUERY_LEN": "verify_max_query_len",
    "JINFER_MLA_RAGGED_KERNEL": "mla_ragged_kernel",
    "JINFER_MLA_EXPAND_MIN_QUERY_LEN": "mla_expand_min_query_len",
}

LaunchArgs = tuple[tuple[str, tuple[tuple[str, int | bool | None], ...]], ...]


@dataclass(frozen=True)
class KernelPolicy:
    attention_backend: str = "auto"  # one of BACKENDS; "auto": Pallas on GPU, the jnp reference elsewhere
    interpret: bool | None = None  # Pallas interpreter; None: where there is no GPU
    pallas_mlp_tokens: tuple[int, ...] = (1,)  # step sizes that run the fused Pallas MLP (any iterable; sorted)
    qkv_rope_max_tokens: int = 256
    norm_qkv_max_tokens: int = 64
    norm_qkv_k_splits: int | None = None  # None: the kernel's default_k_splits
    prefetch_o: float = 0.2  # fraction of the o weight read into L2 (0: off)
    prefetch_eviction: str = "evict_last"  # the prefetch loads' L2 eviction policy (EVICTION_POLICIES)
    moe_front_max_tokens: int = 8
    mosaic_min_query_len: int = 128
    mosaic_min_step_tokens: int = 512
    mosaic_moe_min_rows_per_expert: int = 128
    pad_vector_dots: bool = True
    xla_dot_merger: bool = False
    fp8_skinny_o: bool = True
    fp8_max_tokens: int = 16
    one_shot_all_reduce_bytes: int | None = None  # None: by the layout (`all_reduce_limit`)
    one_shot_all_gather_bytes: int = 1 << 20
    verify_max_query_len: int = 8
    mla_ragged_kernel: bool = True
    mla_expand_min_query_len: int = 64
    # Launch-parameter overrides per kernel (measurements): {kernel: {keyword: value}}, kept as sorted tuples.
    launch: LaunchArgs = ()

    def __post_init__(self):
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r} must be one of {BACKENDS}")
        if self.interpret not in (None, True, False):
            raise ValueError(f"interpret={self.interpret!r} must be None, True or False")
        tokens = self.pallas_mlp_tokens
        if isinstance(tokens, str | bytes) or not all(_is_int(t) and t >= 1 for t in tokens):
            raise ValueError(f"pallas_mlp_tokens={tokens!r} must be token counts >= 1")
        object.__setattr__(self, "pallas_mlp_tokens", tuple(sorted(set(tokens))))
        for name in ("qkv_rope_max_tokens", "norm_qkv_max_tokens", "moe_front_max_tokens", "mosaic_min_query_len",
                     "mosaic_min_step_tokens", "mosaic_moe_min_rows_per_expert", "fp8_max_tokens",
                     "one_shot_all_reduce_bytes", "one_shot_all_gather_bytes", "verify_max_query_len",
                     "mla_expand_min_query_len"):
            v = getattr(self, name)
            if v is None and name == "one_shot_all_reduce_bytes":
                continue
            if not _is_int(v) or v < 0:
                raise ValueError(f"{name}={v!r} must be an integer >= 0")
        if self.norm_qkv_k_splits is not None and (not _is_int(self.norm_qkv_k_splits) or self.norm_qkv_k_splits < 1):
            raise ValueError(f"norm_qkv_k_splits={self.norm_qkv_k_splits!r} must be None or an integer >= 1")
        if not isinstance(self.prefetch_o, int | float) or isinstance(self.prefetch_o, bool) \
                or not 0 <= self.prefetch_o <= 1:
            raise ValueError(f"prefetch_o={self.prefetch_o!r} must be a fraction in [0, 1]")
        if self.prefetch_eviction not in EVICTION_POLICIES:
            raise ValueError(f"prefetch_eviction={self.prefetch_eviction!r} must be one of {EVICTION_POLICIES}")
        for name in ("pad_vector_dots", "xla_dot_merger", "fp8_skinny_o", "mla_ragged_kernel"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a bool")
        object.__setattr__(self, "launch", _launch_tuple(self.launch))

    def all_reduce_limit(self, devices_per_process: int) -> int:
        """`one_shot_all_reduce_bytes`, or where None the measured default for a process driving this many GPUs."""
        if self.one_shot_all_reduce_bytes is not None:
            return self.one_shot_all_reduce_bytes
        return 16384 if devices_per_process > 1 else 1 << 20  # (1 MB: pallas_kernels.all_reduce.MAX_BYTES)

    def launch_args(self, kernel: str) -> dict:
        """The launch keyword arguments the policy sets for `kernel` (one of LAUNCH_KERNELS; {} for none)."""
        if kernel not in LAUNCH_KERNELS:
            raise ValueError(f"kernel={kernel!r} must be one of {LAUNCH_KERNELS}")
        return dict(dict(self.launch).get(kernel, ()))

    def with_launch(self, kernel: str, **args) -> KernelPolicy:
        """This policy with `args` added to `kernel`'s launch overrides."""
        launch = {k: dict(v) for k, v in self.launch}
        launch[kernel] = launch.get(kernel, {}) | args
        return dataclasses.replace(self, launch=launch)

    def large_step_xla_options(self) -> dict[str, object]:
        """XLA compiler options for the executables of large (prefill) steps that the policy decides."""
        return {} if self.xla_dot_merger else {"xla_gpu_dot_merger_threshold_mb": 0}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **fields) -> KernelPolicy:
        """The policy the `JINFER_*` measurement switches (ENV_FIELDS) set, on top of `fields`. For the CLI and the
        benchmarks only: nothing below them reads the environment.

        JINFER_PALLAS_MLP_TOKENS="1,8" (a list of token counts, "" none); JINFER_XLA_DOT_MERGER=1 (XLA's default),
        JINFER_FP8_SKINNY_O / JINFER_MLA_RAGGED_KERNEL=0 / 1; the others take the
        field's value."""
        environ = os.environ if environ is None else environ
        for var, name in ENV_FIELDS.items():
            text = environ.get(var)
            if text is None:
                continue
            try:
                if name == "pallas_mlp_tokens":
                    value = tuple(int(t) for t in text.split(",") if t)
                elif name in ("xla_dot_merger", "fp8_skinny_o", "mla_ragged_kernel"):
                    value = text == "1"
                elif name == "prefetch_o":
                    value = float(text)
                elif name == "prefetch_eviction":
                    value = text
                else:
                    value = int(text)
            except ValueError:
                raise ValueError(f"{var}={text!r} is not a valid {name}") from None
            fields[name] = value
        return cls(**fields)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _launch_tuple(launch) -> LaunchArgs:
    """`launch` ({kernel: {keyword: value}} or its tuple form) as sorted tuples, checked."""
    items = launch.items() if isinstance(launch, Mapping) else launch
    out = []
    for kernel, args in items:
        if kernel not in LAUNCH_KERNELS:
            raise ValueError(f"launch: kernel {kernel!r} must be one of {LAUNCH_KERNELS}")
        pairs = args.items() if isinstance(args, Mapping) else args
        checked = []
        for key, value in pairs:
            if not isinstance(key, str) or not (value is None or isinstance(value, int)):
                raise ValueError(f"launch[{kernel!r}]: {key!r}={value!r} must be a keyword and an int, bool or None")
            checked.append((key, value))
        out.append((kernel, tuple(sorted(checked))))
    return tuple(sorted(out))

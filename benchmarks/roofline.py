"""Roofline floors for a model shape: bytes a decode step must read, FLOPs a prefill needs, and the
floor times from this machine's bandwidth and matmul rate, both measured in the same run.

    python -m benchmarks.roofline --shape qwen3-4b --batch 1 --context 1024 --prompt-len 1024
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import environment, write_result
from jinfer.config.model import NAMED_SHAPES, ModelConfig


def _best_of(fn, *args, iters=10) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t)
    return best


def measure_bandwidth(nbytes: int = 1 << 31) -> float:
    """Bytes moved (read + written) per second by a device copy of an nbytes array."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a * 1.0001)
    return 2 * nbytes / _best_of(copy, x)


_TORCH_COPY = """
import json, torch
n = 1 << 31
a = torch.empty(n // 2, dtype=torch.bfloat16, device="cuda"); b = torch.empty_like(a)
e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
best = float("inf")
for _ in range(12):
    e0.record(); b.copy_(a); e1.record(); torch.cuda.synchronize()
    best = min(best, e0.elapsed_time(e1) / 1e3)
print(json.dumps({"copy_bytes_per_s": 2 * n / best}))
"""


def measure_torch_copy() -> dict:
    """torch's device copy rate, in a subprocess (where torch and a CUDA device are present). Call it before
    this process's JAX takes the GPU's memory (an engine's pool holds 95% of it)."""
    try:
        proc = subprocess.run([sys.executable, "-c", _TORCH_COPY], capture_output=True, text=True, timeout=120)
        return {"torch_Bps": json.loads(proc.stdout.strip().splitlines()[-1])["copy_bytes_per_s"]}
    except Exception as e:  # no torch, no CUDA for it
        return {"torch_error": f"{type(e).__name__}: {str(e)[:200]}"}


def measure_copy_bandwidth(torch_copy: dict | None = None) -> dict:
    """The device's copy rate (bytes read + written per second) from the best copy at hand: torch's
    `copy_` (`measure_torch_copy`, ~3.0 TB/s on an H100 where a JAX elementwise op reaches 2.5-2.9), and
    JAX's. Rooflines divide by the larger."""
    out = {"jax_Bps": measure_bandwidth(1 << 26 if jax.default_backend() == "cpu" else 1 << 31)}
    if torch_copy is None and jax.default_backend() == "gpu":
        torch_copy = measure_torch_copy()
    out.update(torch_copy or {})
    out["best_Bps"] = max(v for k, v in out.items() if k.endswith("_Bps"))
    return out


def measure_matmul(n: int = 8192, dtype=jnp.bfloat16) -> float:
    a = jnp.ones((n, n), dtype)
    mm = jax.jit(lambda x, y: x @ y)
    return 2 * n**3 / _best_of(mm, a, a)


def weight_bytes(cfg: ModelConfig, dtype_bytes: int = 2) -> int:
    return cfg.num_params() * dtype_bytes


def experts_hit(cfg: ModelConfig, tokens: int) -> float:
    """Expected distinct experts per MoE layer that `tokens` tokens route to, each picking top-k of E
    uniformly (k at one token, every expert for large batches)."""
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    return e * (1 - (1 - k / e) ** tokens) if e else 0.0


def touched_weight_bytes(cfg: ModelConfig, tokens: int, dtype_bytes: int = 2) -> float:
    """Weights a step over `tokens` tokens reads: all of them for a dense model; for MoE only the experts
    hit (expected, uniform routing). The embedding table is not read in full (only `tokens` rows), but a
    tied lm_head reads it whole."""
    embed = cfg.vocab_size * cfg.hidden_size * dtype_bytes
    total = weight_bytes(cfg, dtype_bytes) - (0 if cfg.tie_word_embeddings else embed)
    if cfg.num_experts:
        per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * dtype_bytes
        moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
        total -= moe_layers * (cfg.num_experts - experts_hit(cfg, tokens)) * per_expert
    if cfg.quantization is not None:  # block-FP8 linear weights: a byte each and a float32 scale per block
        dense, expert = fp8_params(cfg)
        saved = dtype_bytes - 1 - 4 / math.prod(cfg.quantization.block)
        total -= (dense + (experts_hit(cfg, tokens) * expert if cfg.num_experts else 0.0)) * saved
    return total


def fp8_params(cfg: ModelConfig) -> tuple[float, float]:
    """Parameters a block-FP8 model stores in FP8 (jinfer/models/spec.py `quantize_specs`): outside the routed
    experts, and those of one routed expert summed over the layers."""
    from jinfer.models.registry import weight_specs

    dense = expert = 0.0
    for spec in weight_specs(cfg).values():
        if spec.fp8_block is not None:
            n = math.prod(spec.shape)
            if len(spec.shape) == 3:  # [experts, in, out]
                expert += n / spec.shape[0]
            else:
                dense += n
    return dense, expert


def state_bytes(cfg: ModelConfig, dtype_bytes: int = 2) -> int:
    """One sequence's fixed-size state over the linear-attention layers (0 for other models)."""
    from jinfer.models.registry import state_specs

    return sum(math.prod(s.shape) * (4 if s.dtype == "float32" else dtype_bytes)
               for specs in state_specs(cfg).values() for s in specs)


def decode_bytes(cfg: ModelConfig, batch: int, context: int, dtype_bytes: int = 2, kv_bytes: int | None = None) -> dict:
    """Minimum HBM traffic of one decode step: the weights it touches once (for MoE the experts its
    `batch` tokens route to), each sequence's K/V once (attention layers; `kv_bytes` per value, default
    dtype_bytes: 1 for an FP8 cache) and, for linear-attention layers, each sequence's state read and written once."""
    weights = touched_weight_bytes(cfg, batch, dtype_bytes)
    per_token = cfg.latent_dim if cfg.kv_lora_rank else 2 * cfg.num_kv_heads * cfg.head_dim  # MLA: one latent row
    kv = batch * context * len(cfg.attention_layers) * per_token * (dtype_bytes if kv_bytes is None else kv_bytes)
    states = 2 * batch * state_bytes(cfg, dtype_bytes)
    return {"weights": weights, "kv": kv, "states": states, "total": weights + kv + states}


def busiest_device_experts(cfg: ModelConfig, tokens: int, devices: int, seed: int = 0) -> float:
    """Expected distinct experts hit, per MoE layer, on the device that gets the most of them, when `tokens`
    tokens each route to top-k of E uniformly and the experts lie whole on `devices` devices (expert
    parallel, E / devices each, in order). Simulated: the step waits on that device."""
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    rng = np.random.default_rng(seed)
    samples = max(64, min(2000, 8_000_000 // (tokens * e)))
    picks = rng.random((samples, tokens, e)).argpartition(k, axis=-1)[..., :k].reshape(samples, -1)
    hit = np.zeros((samples, e), bool)
    hit[np.arange(samples)[:, None], picks] = True
    return float(hit.reshape(samples, devices, e // devices).sum(-1).max(-1).mean())


def decode_bytes_per_device(cfg: ModelConfig, batch: int, context: int, tp: int, expert_parallel: bool = False,
                            dtype_bytes: int = 2, kv_bytes: int | None = None) -> dict:
    """What the busiest of `tp` devices reads in one decode step under jinfer's layout (jinfer/parallel/mesh.py):
    q / o, dense MLPs and the lm_head split tp ways; kv heads split, or one per device past num_kv_heads
    devices (their weights and cache then stored on several); the router on every device; each hit expert's
    columns split tp ways, or (expert parallel) whole experts on their device, counted on the device the
    most hit experts land on (`busiest_device_experts`); `kv_bytes` per K/V value (default dtype_bytes). At tp=1
    it is `decode_bytes`."""
    from jinfer.parallel.mesh import kv_heads_total

    if tp == 1:
        return decode_bytes(cfg, batch, context, dtype_bytes, kv_bytes)
    if cfg.num_layers != len(cfg.attention_layers) or cfg.kv_lora_rank:
        raise ValueError(f"{cfg.architecture}: per-device bytes are for attention-only models without latent KV")
    h, kv_d = cfg.hidden_size, kv_heads_total(cfg, tp) // tp * cfg.head_dim  # kv columns on one device
    attn = 2 * h * cfg.q_size // tp + 2 * h * kv_d + 2 * h + (2 * cfg.head_dim if cfg.qk_norm else 0)
    if cfg.attention_bias:
        attn += cfg.q_size // tp + 2 * kv_d
    per_expert = 3 * h * cfg.moe_intermediate_size
    if not cfg.num_experts:
        experts = 0.0
    elif expert_parallel and tp > 1:
        experts = busiest_device_experts(cfg, batch, tp) * per_expert
    else:
        experts = experts_hit(cfg, batch) * per_expert / tp
    mlp = sum(h * cfg.num_experts + experts if cfg.is_moe_layer(i) else 3 * h * cfg.intermediate_size / tp
              for i in range(cfg.num_layers))
    weights = (cfg.num_layers * attn + mlp + cfg.vocab_size * h / tp + h) * dtype_bytes
    kv = batch * context * cfg.num_layers * 2 * kv_d * (dtype_bytes if kv_bytes is None else kv_bytes)
    return {"weights": weights, "kv": kv, "total": weights + kv}


def prefill_flops(cfg: ModelConfig, tokens: int) -> dict:
    """Matmul FLOPs of a causal prefill of `tokens` tokens (one sequence; MoE: the k experts of each token)."""
    embed = cfg.vocab_size * cfg.hidden_size
    dense = 2 * tokens * (cfg.num_params(active=True) - (embed if not cfg.tie_word_embeddings else 0))
    # QK^T and PV, causal: half of the full L x L square.
    attn = 2 * 2 * len(cfg.attention_layers) * cfg.num_heads * cfg.head_dim * tokens * tokens // 2
    # gated delta rule per token and value head: k^T S, the rank-1 update and q^T S (the chunked form does
    # about as much on the tensor cores)
    linear = (cfg.num_layers - len(cfg.attention_layers)) * tokens * 6 * cfg.linear_num_value_heads \
        * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    return {"dense": dense, "attention": attn, "linear_attention": linear, "total": dense + attn + linear}


def floors(cfg: ModelConfig, batch: int, context: int, prompt_len: int, bw: float, flops: float) -> dict:
    """Decode step floor (bytes / bw) and prefill floors: FLOPs / matmul rate, and the bytes its weights
    take to read once (an MoE prefill touches every expert: the byte floor can be the higher one)."""
    db = decode_bytes(cfg, batch, context)
    pf = prefill_flops(cfg, prompt_len)
    pb = touched_weight_bytes(cfg, prompt_len)
    flop_floor, byte_floor = pf["total"] / flops * 1e3, pb / bw * 1e3
    return {"decode_bytes": db, "prefill_flops": pf, "prefill_weight_bytes": pb,
            "decode_floor_ms": db["total"] / bw * 1e3, "prefill_flop_floor_ms": flop_floor,
            "prefill_byte_floor_ms": byte_floor, "prefill_floor_ms": max(flop_floor, byte_floor)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-4b", choices=sorted(NAMED_SHAPES))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--out")
    args = ap.parse_args()
    cfg = NAMED_SHAPES[args.shape]
    small = jax.default_backend() == "cpu"
    copy = measure_copy_bandwidth(measure_torch_copy())  # torch first, before JAX allocates
    bw = copy["best_Bps"]
    mm = measure_matmul(1024 if small else 8192)
    result = {"benchmark": "roofline", **environment(), "shape": args.shape, "batch_size": args.batch,
              "context": args.context, "prompt_len": args.prompt_len, "measured_bandwidth_Bps": bw,
              "copy_bandwidth": copy, "measured_matmul_flops": mm,
              **floors(cfg, args.batch, args.context, args.prompt_len, bw, mm)}
    write_result(result, args.out)
    print(f"roofline {args.shape}: decode floor {result['decode_floor_ms']:.2f} ms "
          f"({result['decode_bytes']['total'] / 1e9:.2f} GB at {bw / 1e12:.2f} TB/s), "
          f"prefill floor {result['prefill_floor_ms']:.2f} ms at {mm / 1e12:.0f} TFLOP/s")


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()

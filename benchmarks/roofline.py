"""Roofline floors for a model shape: bytes a decode step must read, FLOPs a prefill needs, and the
floor times from this machine's bandwidth and matmul rate, both measured in the same run.

    python -m benchmarks.roofline --shape qwen3-4b --batch 1 --context 1024 --prompt-len 1024
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import environment, write_result
from jinfer.config import NAMED_SHAPES, ModelConfig


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


def measure_matmul(n: int = 8192, dtype=jnp.bfloat16) -> float:
    a = jnp.ones((n, n), dtype)
    mm = jax.jit(lambda x, y: x @ y)
    return 2 * n**3 / _best_of(mm, a, a)


def weight_bytes(cfg: ModelConfig, dtype_bytes: int = 2) -> int:
    return cfg.num_params() * dtype_bytes


def decode_bytes(cfg: ModelConfig, batch: int, context: int, dtype_bytes: int = 2) -> dict:
    """Minimum HBM traffic of one decode step: every weight once, plus each sequence's K/V once.

    The embedding table is not read in full (only `batch` rows), but a tied lm_head reads it whole.
    """
    embed = cfg.vocab_size * cfg.hidden_size * dtype_bytes
    weights = weight_bytes(cfg, dtype_bytes) - (0 if cfg.tie_word_embeddings else embed)
    kv = batch * context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * dtype_bytes
    return {"weights": weights, "kv": kv, "total": weights + kv}


def prefill_flops(cfg: ModelConfig, tokens: int) -> dict:
    """Matmul FLOPs of a causal prefill of `tokens` tokens (one sequence)."""
    embed = cfg.vocab_size * cfg.hidden_size
    dense = 2 * tokens * (cfg.num_params() - (embed if not cfg.tie_word_embeddings else 0))
    # QK^T and PV, causal: half of the full L x L square.
    attn = 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens * tokens // 2
    return {"dense": dense, "attention": attn, "total": dense + attn}


def floors(cfg: ModelConfig, batch: int, context: int, prompt_len: int, bw: float, flops: float) -> dict:
    db = decode_bytes(cfg, batch, context)
    pf = prefill_flops(cfg, prompt_len)
    return {"decode_bytes": db, "prefill_flops": pf, "decode_floor_ms": db["total"] / bw * 1e3,
            "prefill_floor_ms": pf["total"] / flops * 1e3}


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
    bw = measure_bandwidth(1 << 26 if small else 1 << 31)
    mm = measure_matmul(1024 if small else 8192)
    result = {"benchmark": "roofline", **environment(), "shape": args.shape, "batch_size": args.batch,
              "context": args.context, "prompt_len": args.prompt_len, "measured_bandwidth_Bps": bw,
              "measured_matmul_flops": mm, **floors(cfg, args.batch, args.context, args.prompt_len, bw, mm)}
    write_result(result, args.out)
    print(f"roofline {args.shape}: decode floor {result['decode_floor_ms']:.2f} ms "
          f"({result['decode_bytes']['total'] / 1e9:.2f} GB at {bw / 1e12:.2f} TB/s), "
          f"prefill floor {result['prefill_floor_ms']:.2f} ms at {mm / 1e12:.0f} TFLOP/s")


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()

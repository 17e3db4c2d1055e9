"""Quick timings of the attention kernels (the full comparison is benchmarks/bench_kernels.py).

    python -m benchmarks.kernels.bench_attention decode        # paged decode attention, 64 x 2k context
    python -m benchmarks.kernels.bench_attention prefill       # ragged prefill (Triton), one causal 4k prompt
    python -m benchmarks.kernels.bench_attention prefill_mgpu  # the same on the Mosaic GPU kernel

On CPU: tiny shapes in the interpreters, to check the script.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from benchmarks.kernels import run_subcommand
from pallas_kernels.attention.paged_attention import paged_decode_attention
from pallas_kernels.attention.prefill_attention import ragged_prefill_attention
from pallas_kernels.attention.prefill_attention_mgpu import ragged_prefill_attention_mgpu


def bench_decode(argv: list[str] | None = None) -> None:
    """Paged decode attention: batch 64 x 2048 tokens of context, Qwen3-4B's heads."""
    import time

    batch, ctx, heads, kv_heads, dim, page = 64, 2048, 32, 8, 128, 16
    interpret = jax.default_backend() != "gpu"
    if interpret:
        batch, ctx = 2, 256
    pages = batch * ctx // page
    key = jax.random.key(0)
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (batch, heads, dim), jnp.bfloat16)
    k = jax.random.normal(kk, (pages, page, kv_heads, dim), jnp.bfloat16)
    v = jax.random.normal(kv, (pages, page, kv_heads, dim), jnp.bfloat16)
    table = jax.random.permutation(key, pages).reshape(batch, ctx // page).astype(jnp.int32)
    lens = jnp.full((batch,), ctx, jnp.int32)
    fn = functools.partial(paged_decode_attention, interpret=interpret)
    fn(q, k, v, table, lens).block_until_ready()
    n = 3 if interpret else 50
    t0 = time.perf_counter()
    for _ in range(n):
        out = fn(q, k, v, table, lens)
    out.block_until_ready()
    dt = (time.perf_counter() - t0) / n
    gb = 2 * k.size * k.dtype.itemsize / 1e9
    print(f"paged_decode_attention B={batch} ctx={ctx}: {dt * 1e6:.1f} us, {gb / dt / 1e3:.2f} TB/s")


def time_causal_prefill(fn, name: str, interpret: bool) -> None:
    """Print the time and TFLOP/s of `fn(q, k, v, query_start, seq_lens, page_table)` on one causal
    prompt (4096 tokens, Qwen3-4B heads; 128 under the interpreter). Shared by the modules' main()."""
    import time

    n, heads, kv_heads, dim, page = (128 if interpret else 4096), 32, 8, 128, 16
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (n, heads, dim), jnp.bfloat16)
    k = jax.random.normal(kk, (n // page, page, kv_heads, dim), jnp.bfloat16)
    v = jax.random.normal(kv, (n // page, page, kv_heads, dim), jnp.bfloat16)
    args = (q, k, v, jnp.array([0, n], jnp.int32), jnp.array([n], jnp.int32),
            jnp.arange(n // page, dtype=jnp.int32)[None])
    fn(*args).block_until_ready()
    reps = 2 if interpret else 20
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    out.block_until_ready()
    dt = (time.perf_counter() - t0) / reps
    flops = 4 * n * n / 2 * heads * dim
    print(f"{name} causal {n}: {dt * 1e6:.1f} us, {flops / dt / 1e12:.1f} TFLOP/s")


def bench_prefill(argv: list[str] | None = None) -> None:
    """Quick causal-prefill timing; the full comparison is benchmarks/bench_kernels.py."""
    interpret = jax.default_backend() != "gpu"
    time_causal_prefill(functools.partial(ragged_prefill_attention, interpret=interpret),
                        "ragged_prefill_attention", interpret)


def bench_prefill_mgpu(argv: list[str] | None = None) -> None:
    """Quick causal-prefill timing of the Mosaic GPU kernel."""
    interpret = jax.default_backend() != "gpu"
    time_causal_prefill(functools.partial(ragged_prefill_attention_mgpu, interpret=interpret),
                        "ragged_prefill_attention_mgpu", interpret)


BENCHMARKS = {"decode": bench_decode, "prefill": bench_prefill, "prefill_mgpu": bench_prefill_mgpu}

def main(argv: list[str] | None = None) -> None:
    run_subcommand(BENCHMARKS, __spec__.name, __doc__, argv)


if __name__ == "__main__":
    main()

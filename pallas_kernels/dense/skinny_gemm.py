"""Skinny GEMM `x @ w` for decode-sized token counts (x `[T <= 32, K]`, w `[K, N]`): weight streaming.

At decode a projection is a matrix-vector product: the time is the weight's bytes over the bandwidth
the kernel reaches. XLA runs these as cuBLAS / Triton GEMMs tiled for large M, at 2.0-2.1 TB/s on the
H100 for Qwen3-4B's q|k|v and o (benchmarks/results/profile_latency_b1_qwen3-4b_h100_fused.trace.json.gz),
against ~3.0 TB/s the memory copies. Here one program owns (column block, K split): it walks its
`[K / k_splits, block_n]` slab of w in `block_k`-row tiles (Triton pipelines `num_stages` of them in
flight), multiplies the token tile (padded to 16 rows in registers, never in HBM) in, and stores the
real rows of its fp32 partial `[k_splits, T, N]`; XLA sums the splits (and fuses what follows: a
residual add, the cast). Splitting K puts enough programs in flight when N is narrow. `skinny_gemm_residual` sums
the splits and adds the residual in each column block's last program instead (pallas_kernels/split_k.py; even with
XLA's GEMM + add for Qwen3-4B's o at batch 1, so off by default: ops.FUSED_TAILS).

GPU backend: the Pallas Triton lowering (see `pallas_kernels/__init__.py`).
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.dense.fused_mlp import pow2_divisor
from pallas_kernels.split_k import check_counters, finish_last, residual_add

MAX_TOKENS = 32


# ----------------------------------------------------------------------------------------------
# Kernel body
# ----------------------------------------------------------------------------------------------
def _gemm_kernel(x_ref, w_ref, *refs, block_t: int, block_k: int, k_per_split: int, k_splits: int,
                 fused_tail: bool, interpret: bool):
    # x_ref [T, K] (whole: the real rows are loaded masked); w_ref [K, block_n]: this program's column
    # block, all K rows (the split picks its range); o_ref [k_splits, T, N] fp32 (whole). Fused tail: the
    # residual [T, N] and counters in, (residual + x @ w) [T, N] and the counters out, o_ref the partials.
    # One split with a residual (no counters): residual [T, N] in, residual + x @ w out (the program's own columns).
    if fused_tail:
        r_ref, _cnt_in, y_ref, cnt_ref, o_ref = refs
    elif len(refs) == 2:
        r_ref, y_ref = refs
    else:
        (o_ref,) = refs
    tokens = x_ref.shape[0]
    block_n = w_ref.shape[1]
    n, s = pl.program_id(0), pl.program_id(1)
    real = jnp.arange(block_t, dtype=jnp.int32) < tokens  # [block_t]
    rows = pl.ds(0, block_t)

    def body(kk, acc):  # acc [block_t, block_n] fp32
        ks = pl.ds(s * k_per_split + kk * block_k, block_k)
        xk = plgpu.load(x_ref.at[rows, ks], mask=jnp.broadcast_to(real[:, None], (block_t, block_k)), other=0)
        return acc + plgpu.dot(xk, w_ref[ks, :])

    acc = jax.lax.fori_loop(0, k_per_split // block_k, body, jnp.zeros((block_t, block_n), jnp.float32))
    cols = pl.ds(n * block_n, block_n)
    mask = jnp.broadcast_to(real[:, None], (block_t, block_n))

    def epilogue(total):
        residual = plgpu.load(r_ref.at[rows, cols], mask=mask, other=0)
        plgpu.store(y_ref.at[rows, cols], residual_add(residual, total), mask=mask)

    if len(refs) == 2:
        epilogue(acc)
        return
    if not fused_tail:
        plgpu.store(o_ref.at[s, rows, cols], acc, mask=mask)
        return

    finish_last(o_ref, cnt_ref, n, s, k_splits, lambda s_: (s_, rows, cols), acc, mask, epilogue, interpret)


# ----------------------------------------------------------------------------------------------
# Wrapper
# ----------------------------------------------------------------------------------------------
def _gemm_call(x, w, *, block_n, block_k, k_splits, num_warps, num_stages, interpret, residual=None, counters=None):
    tokens, k = x.shape
    n = w.shape[1]
    block_t = max(16, 1 << (tokens - 1).bit_length())
    fused_tail = counters is not None
    kernel = functools.partial(_gemm_kernel, block_t=block_t, block_k=block_k, k_per_split=k // k_splits,
                               k_splits=k_splits, fused_tail=fused_tail, interpret=interpret)
    whole = pl.no_block_spec
    partials = jax.ShapeDtypeStruct((k_splits, tokens, n), jnp.float32)
    if residual is not None and not fused_tail:  # one split: the residual added in the program's epilogue
        out_shape, extra, aliases = jax.ShapeDtypeStruct(residual.shape, residual.dtype), [residual], {}
    elif fused_tail:
        out_shape = [jax.ShapeDtypeStruct(residual.shape, residual.dtype),
                     jax.ShapeDtypeStruct(counters.shape, jnp.int32), partials]
        extra, aliases = [residual, counters], {3: 1}
    else:
        out_shape, extra, aliases = partials, [], {}
    out = pl.pallas_call(
        kernel,
        grid=(n // block_n, k_splits),
        in_specs=[whole, pl.BlockSpec((k, block_n), lambda i, s: (0, i)), *([whole] * len(extra))],
        out_specs=[whole] * 3 if fused_tail else whole,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"skinny_gemm_n{block_n}_k{block_k}_s{k_splits}" + ("_res" if residual is not None else ""),
    )(x, w, *extra)
    if fused_tail:
        return out[0], out[1]
    if residual is not None:
        return out
    return out[0] if k_splits == 1 else out.sum(axis=0)


def default_config(k: int, n: int) -> dict:
    """Launch parameters (block_n, block_k, k_splits, num_warps, num_stages) for a [K, N] weight."""
    block_n = pow2_divisor(n, 64)  # (K and N are multiples of 16: tiles of 16 at least)
    block_k = pow2_divisor(k, 128)
    # enough programs for ~2 waves of 132 SMs; each split keeps >= 8 tiles to pipeline
    k_splits = 1
    while (n // block_n) * k_splits < 264 and k % (k_splits * 2 * block_k) == 0 and k // (k_splits * 2) >= 8 * block_k:
        k_splits *= 2
    return {"block_n": block_n, "block_k": block_k, "k_splits": k_splits, "num_warps": 4, "num_stages": 4}


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "k_splits", "num_warps", "num_stages",
                                             "interpret"))
def skinny_gemm(x: jax.Array, w: jax.Array, *, block_n: int | None = None, block_k: int | None = None,
                k_splits: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                interpret: bool = False) -> jax.Array:
    """`x @ w` in float32 for a few token rows.

    Args:
      x: `[T, K]`, 1 <= T <= 32.
      w: `[K, N]`, same dtype; K and N multiples of 16.
      block_n, block_k, k_splits, num_warps, num_stages: launch parameters; None: `default_config`.
        block_n must divide N, k_splits * block_k must divide K.
      interpret: run the Pallas interpreter (CPU tests).

    Returns:
      `[T, N]` float32 (the caller adds, casts or reduces across devices).
    """
    launch = _launch(x, w, block_n, block_k, k_splits, num_warps, num_stages)
    return _gemm_call(x, w, **launch, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "k_splits", "num_warps", "num_stages",
                                             "interpret"))
def skinny_gemm_residual(x: jax.Array, w: jax.Array, residual: jax.Array, counters: jax.Array, *,
                         block_n: int | None = None, block_k: int | None = None, k_splits: int | None = None,
                         num_warps: int | None = None, num_stages: int | None = None, interpret: bool = False
                         ) -> tuple[jax.Array, jax.Array]:
    """`(residual + x @ w, counters)`: `skinny_gemm` with its split-K sum and the residual add inside the kernel
    (the last program of each column block finishes it, `pallas_kernels/split_k.py`), e.g. a decode step's o
    projection and the residual stream around attention, in one launch.

    residual: `[T, N]` (the output's dtype); counters: int32 `[>= N / block_n]`, zero on entry
    (`ModelOps.step_counters`), returned zero (aliased).
    """
    launch = _launch(x, w, block_n, block_k, k_splits, num_warps, num_stages)
    _check_residual(x, w, residual)
    blocks = w.shape[1] // launch["block_n"]
    check_counters(counters, blocks)
    return _gemm_call(x, w, **launch, interpret=interpret, residual=residual, counters=counters)


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "num_warps", "num_stages", "interpret"))
def gemv_residual(x: jax.Array, w: jax.Array, residual: jax.Array, *, block_n: int = 32, block_k: int | None = None,
                  num_warps: int | None = None, num_stages: int | None = None, interpret: bool = False) -> jax.Array:
    """`residual + x @ w` with no split-K: each program owns `block_n` output columns over the whole K range and adds
    the residual as it stores them (no partials, no counters, no XLA add after it). Narrow column blocks put the
    programs in flight that split-K would otherwise provide: N / block_n of them."""
    launch = _launch(x, w, block_n, block_k, 1, num_warps, num_stages)
    _check_residual(x, w, residual)
    return _gemm_call(x, w, **launch, interpret=interpret, residual=residual)


def _check_residual(x: jax.Array, w: jax.Array, residual: jax.Array) -> None:
    if residual.shape != (x.shape[0], w.shape[1]):
        raise ValueError(f"residual must be [T, N] = {(x.shape[0], w.shape[1])}, got {residual.shape}")


def _launch(x, w, block_n, block_k, k_splits, num_warps, num_stages) -> dict:
    """The checked launch parameters (None: `default_config`)."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"x must be [T, K] and w [K, N]: {x.shape=} {w.shape=}")
    tokens, k = x.shape
    n = w.shape[1]
    if not 1 <= tokens <= MAX_TOKENS:
        raise ValueError(f"skinny_gemm takes 1..{MAX_TOKENS} token rows, got {tokens=}")
    if k % 16 or n % 16:
        raise ValueError(f"K and N must be multiples of 16: {w.shape=}")
    cfg = default_config(k, n)
    block_n = block_n or cfg["block_n"]
    block_k = block_k or cfg["block_k"]
    k_splits = k_splits or cfg["k_splits"]
    if n % block_n:
        raise ValueError(f"block_n={block_n} must divide N={n}")
    if k % (k_splits * block_k):
        raise ValueError(f"k_splits * block_k = {k_splits} * {block_k} must divide K={k}")
    return {"block_n": block_n, "block_k": block_k, "k_splits": k_splits,
            "num_warps": num_warps or cfg["num_warps"], "num_stages": num_stages or cfg["num_stages"]}


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------
@jax.jit
def skinny_gemm_reference(x: jax.Array, w: jax.Array) -> jax.Array:
    """What XLA does on its own (the batch-1 row padded to two, as `ops.project` does)."""
    if x.shape[0] == 1:
        return jnp.dot(jnp.pad(x, ((0, 1), (0, 0))), w, preferred_element_type=jnp.float32)[:1]
    return jnp.dot(x, w, preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------------------------
# Benchmark: Qwen3-4B's decode projections, XLA against a sweep of launch parameters
# ----------------------------------------------------------------------------------------------
LAUNCH = ("block_n", "block_k", "k_splits", "num_warps", "num_stages")
SHAPES = {"qkv": (2560, 6144), "o": (4096, 2560), "gate_up": (2560, 19456), "down": (9728, 2560),
          "lm_head": (2560, 151936)}


def _time_us(fn, x, ws, reps: int = 10) -> float:
    """Device time of one call: one executable applies `fn` to each of the distinct weights `ws` (more
    bytes than L2 holds, and no per-call dispatch in the figure), median over `reps` runs."""
    import time

    import numpy as np

    chain = jax.jit(lambda x, ws: [fn(x, w) for w in ws])
    jax.block_until_ready(chain(x, ws))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(chain(x, ws))
        times.append((time.perf_counter() - t0) / len(ws) * 1e6)
    return float(np.median(times))


def sweep(tokens_list=(1, 8), shapes=("qkv", "o", "down", "gate_up")) -> list[dict]:
    import itertools

    interpret = jax.default_backend() != "gpu"
    rows = []
    key = jax.random.key(0)
    for name in shapes:
        k, n = SHAPES[name]
        if interpret:
            k, n = 256, 512
        copies = 1 if interpret else max(4, -(-400_000_000 // (k * n * 2)))  # >= 400 MB of distinct weights
        ws = [jax.random.normal(jax.random.fold_in(key, i), (k, n), jnp.bfloat16) for i in range(copies)]
        swept = None  # the best launch of the full sweep (first token count), tried at the others
        for tokens in tokens_list:
            x = jax.random.normal(key, (tokens, k), jnp.bfloat16)
            nbytes = k * n * 2
            reps = 2 if interpret else 10
            t = _time_us(skinny_gemm_reference, x, ws, reps=reps)
            rows.append({"shape": name, "K": k, "N": n, "tokens": tokens, "impl": "xla", "time_us": t,
                         "tb_per_s": nbytes / t / 1e6})
            print(json.dumps(rows[-1]), flush=True)
            if interpret:
                configs = [None, (64, 64, 2, 4, 3)]
            elif swept is None:
                configs = [None, *itertools.product((32, 64, 128), (128,), (1, 2, 4), (4,), (3, 5))]
            else:
                configs = [None, swept]
            best = None
            for c in configs:
                kw = {} if c is None else dict(zip(LAUNCH, c, strict=True))
                if c is not None and (n % c[0] or k % (c[2] * c[1]) or k // (c[2] * c[1]) < 2):
                    continue
                try:
                    t = _time_us(functools.partial(skinny_gemm, interpret=interpret, **kw), x, ws, reps=reps)
                except Exception as e:  # noqa: BLE001 (a config Triton cannot compile: shared memory)
                    rows.append({"shape": name, "tokens": tokens, "impl": "pallas", **kw, "error": str(e)[:200]})
                    continue
                row = {"shape": name, "K": k, "N": n, "tokens": tokens, "impl": "pallas" if kw else "pallas(default)",
                       **kw, "time_us": t, "tb_per_s": nbytes / t / 1e6}
                rows.append(row)
                if c is not None and (best is None or t < best["time_us"]):
                    best = row
                if c is None:
                    print(json.dumps(row), flush=True)
            print("best", json.dumps(best), flush=True)
            if swept is None and best is not None:
                swept = tuple(best[f] for f in LAUNCH)
    return rows


if __name__ == "__main__":
    import sys

    out = sys.argv[1] if len(sys.argv) > 1 else None
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "results": sweep()}
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)

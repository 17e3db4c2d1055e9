"""Fused SwiGLU MLP: `(silu(x @ w_gate) * (x @ w_up)) @ w_down` without the intermediate in HBM.

One program owns (token tile, intermediate block): it computes the gate and up projections of its
`block_i` intermediate columns in fp32, forms `silu(gate) * up` in registers, and multiplies it
straight into `w_down`'s matching rows. The down projection sums over the intermediate dimension,
which is split across programs, so each program writes its `[block_t, hidden]` contribution as an
fp32 partial `[splits, T, hidden]` and XLA sums the `I / block_i` partials (deterministic). That
costs `splits * T * hidden * 4` bytes of traffic, so the kernel can only pay off for decode-sized
token counts. The token tile is padded to 16 rows in registers only: x's rows are loaded masked and
only the real rows of a partial are stored (a batch-1 step padded in HBM wrote and summed 16x the
partials it needed, 12 MB per Qwen3-4B layer against 149 MB of weights). The runner picks it per
token count from the measured table (benchmarks/results/kernels_*.json). (fp32 atomic adds into one `[T,
hidden]` buffer instead of
partials measured 1.6-10x slower on the H100; see kernels_h100_sweep_v0.json.) `fused_swiglu_mlp_block` sums the
partials and adds the residual in the kernel instead (each column tile's last program; pallas_kernels/split_k.py):
measured slower at batch 1, so the model keeps XLA's sum (ops.FUSED_TAILS).

GPU backend: the Pallas Triton lowering (see `pallas_kernels/__init__.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.split_k import check_counters, finish_last, residual_add


# ----------------------------------------------------------------------------------------------
# The RMSNorm prologue of a decode-sized tile (shared with norm_qkv_rope.py)
# ----------------------------------------------------------------------------------------------
def tile_rows(x_ref, t, block_t: int):
    """Token tile t of x [tokens, hidden]: (its rows, which are real [block_t], `x_cols(cols, width)` loading
    [block_t, width] of x with the rows past `tokens` read as 0)."""
    rows = pl.ds(t * block_t, block_t)
    real = (t * block_t + jnp.arange(block_t, dtype=jnp.int32)) < x_ref.shape[0]  # [block_t]

    def x_cols(cols, width):
        return plgpu.load(x_ref.at[rows, cols], mask=jnp.broadcast_to(real[:, None], (block_t, width)), other=0)

    return rows, real, x_cols


def rms_inverse(x_cols, hidden: int, block_t: int, block_k: int, eps: float, unroll: bool = True) -> jax.Array:
    """1 / RMS of the tile's rows [block_t] (every program recomputes it: x is tiny next to the weights). Unrolled:
    straight-line code, the row's loads all in flight at once (one L2 round trip)."""
    def sumsq(kk, acc):
        xk = x_cols(pl.ds(kk * block_k, block_k), block_k).astype(jnp.float32)
        return acc + jnp.sum(xk * xk, axis=1)
    ss = jnp.zeros((block_t,), jnp.float32)
    if unroll:
        for kk in range(hidden // block_k):
            ss = sumsq(kk, ss)
    else:
        ss = jax.lax.fori_loop(0, hidden // block_k, sumsq, ss)
    return jax.lax.rsqrt(ss / hidden + eps)


def rms_normed(xk: jax.Array, inv: jax.Array, weight: jax.Array) -> jax.Array:
    """HF RMSNorm rounding: the normalized value in x's dtype, times the weight in that dtype."""
    return (xk.astype(jnp.float32) * inv[:, None]).astype(xk.dtype) * weight[None, :]


# ----------------------------------------------------------------------------------------------
# Kernel body
# ----------------------------------------------------------------------------------------------
def _mlp_kernel(
    *refs,
    block_t: int,
    block_k: int,
    block_n: int,
    has_norm: bool,
    eps: float,
    unroll_norm: bool,
    splits: int = 0,
    fused_tail: bool = False,
    interpret: bool = False,
):
    if fused_tail:  # (x + the block) out [T, hidden], the counters and the partials [splits, T, hidden] fp32
        x_ref, n_ref, wg_ref, wu_ref, wd_ref, _cnt_in, y_ref, cnt_ref, o_ref = refs
    elif has_norm:
        x_ref, n_ref, wg_ref, wu_ref, wd_ref, o_ref = refs
    else:
        (x_ref, wg_ref, wu_ref, wd_ref, o_ref), n_ref = refs, None
    # x_ref [tokens, hidden] (whole; this tile's rows loaded masked); n_ref [hidden]: RMSNorm weight
    # applied to x first (optional); wg_ref/wu_ref [hidden, block_i]: this program's gate/up columns;
    # wd_ref [block_i, hidden]: the matching down-projection rows; o_ref [splits, tokens, hidden] fp32
    # (whole): this intermediate block's partial goes to o_ref[i, tile rows], real rows only.
    hidden = x_ref.shape[1]
    block_i = wg_ref.shape[1]
    t, i = pl.program_id(0), pl.program_id(1)
    rows, real, x_cols = tile_rows(x_ref, t, block_t)
    if has_norm:
        inv = rms_inverse(x_cols, hidden, block_t, block_k, eps, unroll_norm)  # [block_t]

    steps = hidden // block_k

    def up_body(kk, carry):
        g, u = carry  # [block_t, block_i] fp32 each
        cols = pl.ds(kk * block_k, block_k)
        xk = x_cols(cols, block_k)  # [block_t, block_k] (loading it a step ahead measured no faster)
        if has_norm:
            xk = rms_normed(xk, inv, n_ref[cols])
        g = g + plgpu.dot(xk, wg_ref[cols, :])
        u = u + plgpu.dot(xk, wu_ref[cols, :])
        return g, u

    zeros = jnp.zeros((block_t, block_i), jnp.float32)
    g, u = jax.lax.fori_loop(0, steps, up_body, (zeros, zeros))
    h = (g * jax.nn.sigmoid(g) * u).astype(wd_ref.dtype)  # [block_t, block_i], never leaves the SM

    out_mask = jnp.broadcast_to(real[:, None], (block_t, block_n))
    n_blocks = hidden // block_n

    def down_body(n, _):
        if fused_tail:  # each program starts at its own column block: the tiles' last arrivals spread over SMs
            n = (n + i) % n_blocks
        cols = pl.ds(n * block_n, block_n)
        y = plgpu.dot(h, wd_ref[:, cols])  # [block_t, block_n] fp32
        if not fused_tail:
            plgpu.store(o_ref.at[i, rows, cols], y, mask=out_mask)
            return 0

        def epilogue(total):
            plgpu.store(y_ref.at[rows, cols], residual_add(x_cols(cols, block_n), total), mask=out_mask)

        finish_last(o_ref, cnt_ref, n, i, splits, lambda s: (s, rows, cols), y, out_mask, epilogue,
                    interpret)
        return 0

    jax.lax.fori_loop(0, n_blocks, down_body, 0)


# ----------------------------------------------------------------------------------------------
# Wrapper: grid and block specs
# ----------------------------------------------------------------------------------------------
def pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two <= cap dividing n."""
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


def default_block_i(inter: int) -> int:
    """Intermediate columns per program: 128, the H100 sweep's best at Qwen3-4B's width."""
    return pow2_divisor(inter, 128)


def _mlp_call(x, w_gate, w_up, w_down, norm_weight, *, eps, block_t, block_i, num_warps, num_stages,
              unroll_norm, interpret, counters=None):
    tokens, hidden = x.shape
    inter = w_gate.shape[1]
    if block_t is None:
        block_t = min(64, max(16, 1 << (tokens - 1).bit_length()))
    if block_i is None:
        block_i = default_block_i(inter)
    if num_warps is None:  # H100 sweep: 8 warps / 3 stages for decode tiles; bigger tiles run out of smem
        num_warps = 8 if block_t <= 16 else 4
    if num_stages is None:
        num_stages = 3 if block_t <= 16 else 2
    block_k = pow2_divisor(hidden, 128)
    block_n = pow2_divisor(hidden, 256)
    t_tiles, splits = pl.cdiv(tokens, block_t), inter // block_i
    has_norm = norm_weight is not None
    fused_tail = counters is not None
    kernel = functools.partial(_mlp_kernel, block_t=block_t, block_k=block_k, block_n=block_n, has_norm=has_norm,
                               eps=eps, unroll_norm=unroll_norm, splits=splits, fused_tail=fused_tail,
                               interpret=interpret)
    norm_spec = [pl.BlockSpec((hidden,), lambda t, i: (0,))] if has_norm else []
    whole = pl.no_block_spec  # x and the partials: the tile's rows are picked (masked) in the kernel
    partials = jax.ShapeDtypeStruct((splits, tokens, hidden), jnp.float32)
    if fused_tail:
        if t_tiles != 1:
            raise ValueError(f"the fused residual tail takes one token tile: {tokens=} > {block_t=}")
        check_counters(counters, hidden // block_n)
        out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(counters.shape, jnp.int32),
                     partials]
        extra, aliases = [counters], {len(norm_spec) + 4: 1}
    else:
        out_shape, extra, aliases = partials, [], {}
    out = pl.pallas_call(
        kernel,
        grid=(t_tiles, splits),
        in_specs=[
            whole,
            *norm_spec,
            pl.BlockSpec((hidden, block_i), lambda t, i: (0, i)),
            pl.BlockSpec((hidden, block_i), lambda t, i: (0, i)),
            pl.BlockSpec((block_i, hidden), lambda t, i: (i, 0)),
            *([whole] * len(extra)),
        ],
        out_specs=[whole] * 3 if fused_tail else whole,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"fused_swiglu_mlp_t{block_t}_i{block_i}" + ("_norm" if has_norm else "") + ("_res" if fused_tail else ""),
    )(x, *([norm_weight] if has_norm else []), w_gate, w_up, w_down, *extra)
    if fused_tail:
        return out[0], out[1]
    return out.sum(axis=0).astype(x.dtype)  # [tokens, hidden]


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("eps", "block_t", "block_i", "num_warps", "num_stages", "unroll_norm",
                                             "interpret"))
def fused_swiglu_mlp(
    x: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    norm_weight: jax.Array | None = None,
    *,
    eps: float = 1e-6,
    block_t: int | None = None,
    block_i: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    unroll_norm: bool = True,
    interpret: bool = False,
) -> jax.Array:
    """SwiGLU MLP `(silu(x @ w_gate) * (x @ w_up)) @ w_down` with the intermediate kept on-chip.

    Args:
      x: `[tokens, hidden]`.
      w_gate, w_up: `[hidden, intermediate]`.
      w_down: `[intermediate, hidden]`.
      norm_weight: `[hidden]`: apply RMSNorm (HF rounding) to x first, inside the kernel; None: no norm.
      eps: RMSNorm epsilon.
      block_t: tokens per tile (power of two >= 16); default min(64, next_pow2(tokens)).
      block_i: intermediate columns per program (power of two dividing intermediate); default 128.
      num_warps, num_stages: Triton launch parameters; None picks (8, 3) for block_t 16, else (4, 2).
      unroll_norm: the norm's sum of squares as straight-line code (all of the row's loads in flight at once)
        rather than a loop of hidden / 128 dependent round trips (51.6 vs 55.2 us per Qwen3.5-4B layer at
        T = 1 on the H100, decode_mlp_variants_h100.json).
      interpret: run the Pallas interpreter (CPU tests).

    Returns:
      `[tokens, hidden]` in x's dtype (fp32 accumulation).
    """
    _check_args(x, w_gate, w_up, w_down, norm_weight, block_t, block_i)
    return _mlp_call(x, w_gate, w_up, w_down, norm_weight, eps=eps, block_t=block_t, block_i=block_i,
                     num_warps=num_warps, num_stages=num_stages, unroll_norm=unroll_norm, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("eps", "block_i", "num_warps", "num_stages", "interpret"))
def fused_swiglu_mlp_block(x: jax.Array, norm_weight: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                           w_down: jax.Array, counters: jax.Array, *, eps: float = 1e-6, block_i: int | None = None,
                           num_warps: int | None = None, num_stages: int | None = None, interpret: bool = False
                           ) -> tuple[jax.Array, jax.Array]:
    """A decoder's whole MLP block for a decode step of <= 64 tokens: `(x + mlp(rms_norm(x)), counters)`.

    `fused_swiglu_mlp` with its split-K sum and the residual add inside the kernel (`pallas_kernels/split_k.py`):
    the last program to store its partial of a `block_n`-column tile of the output sums the tile's `I / block_i`
    partials in split order and adds x; each program walks the column tiles starting at its own, so the tiles'
    last arrivals land on different SMs. No XLA sum and add kernels after it.

    counters: int32 `[>= hidden / block_n]`, zero on entry (`ModelOps.step_counters`); returned zero (aliased).
    """
    _check_args(x, w_gate, w_up, w_down, norm_weight, None, block_i)
    if norm_weight is None:
        raise ValueError("fused_swiglu_mlp_block needs the block's norm_weight")
    return _mlp_call(x, w_gate, w_up, w_down, norm_weight, eps=eps, block_t=None, block_i=block_i,
                     num_warps=num_warps, num_stages=num_stages, unroll_norm=True, interpret=interpret,
                     counters=counters)


def _check_args(x, w_gate, w_up, w_down, norm_weight, block_t, block_i):
    if x.ndim != 2:
        raise ValueError(f"x must be [tokens, hidden], got {x.shape=}")
    hidden = x.shape[1]
    if w_gate.ndim != 2 or w_gate.shape[0] != hidden or w_up.shape != w_gate.shape:
        raise ValueError(f"w_gate/w_up must be [hidden, intermediate]: {w_gate.shape=} {w_up.shape=} "
                         f"{x.shape=}")
    if w_down.shape != (w_gate.shape[1], hidden):
        raise ValueError(f"w_down must be [intermediate, hidden]: {w_down.shape=} {w_gate.shape=}")
    if hidden % 16 or w_gate.shape[1] % 16:
        raise ValueError(f"hidden and intermediate must be multiples of 16: {w_gate.shape=}")
    if block_t is not None and (block_t < 16 or block_t & (block_t - 1)):
        raise ValueError(f"block_t must be a power of two >= 16, got {block_t=}")
    if block_i is not None and (block_i & (block_i - 1) or w_gate.shape[1] % block_i):
        raise ValueError(f"block_i must be a power of two dividing intermediate, got {block_i=}")
    if norm_weight is not None and norm_weight.shape != (hidden,):
        raise ValueError(f"norm_weight must be [hidden={hidden}], got {norm_weight.shape}")


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("eps",))
def fused_swiglu_mlp_reference(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                               norm_weight: jax.Array | None = None, *, eps: float = 1e-6) -> jax.Array:
    """Pure-jnp SwiGLU MLP (what XLA fuses on its own); fp32 accumulation, output in x's dtype."""
    if norm_weight is not None:
        xf = x.astype(jnp.float32)
        x = norm_weight * (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    g = jnp.dot(x, w_gate, preferred_element_type=jnp.float32)
    u = jnp.dot(x, w_up, preferred_element_type=jnp.float32)
    h = (jax.nn.silu(g) * u).astype(x.dtype)
    return jnp.dot(h, w_down, preferred_element_type=jnp.float32).astype(x.dtype)


# ----------------------------------------------------------------------------------------------
# Benchmark
# ----------------------------------------------------------------------------------------------
def main() -> None:
    """Quick timing at Qwen3-4B shapes; the full comparison is benchmarks/bench_kernels.py."""
    import time

    hidden, inter = 2560, 9728
    interpret = jax.default_backend() != "gpu"
    if interpret:
        hidden, inter = 256, 512
    key = jax.random.key(0)
    kx, kg, ku, kd = jax.random.split(key, 4)
    wg = jax.random.normal(kg, (hidden, inter), jnp.bfloat16) * hidden**-0.5
    wu = jax.random.normal(ku, (hidden, inter), jnp.bfloat16) * hidden**-0.5
    wd = jax.random.normal(kd, (inter, hidden), jnp.bfloat16) * inter**-0.5
    for tokens in (1, 16, 64):
        x = jax.random.normal(kx, (tokens, hidden), jnp.bfloat16)
        fn = functools.partial(fused_swiglu_mlp, interpret=interpret)
        for name, f in (("pallas", fn), ("xla", fused_swiglu_mlp_reference)):
            f(x, wg, wu, wd).block_until_ready()
            reps = 2 if interpret else 50
            t0 = time.perf_counter()
            for _ in range(reps):
                out = f(x, wg, wu, wd)
            out.block_until_ready()
            print(f"mlp T={tokens} {name}: {(time.perf_counter() - t0) / reps * 1e6:.1f} us")


if __name__ == "__main__":
    main()

"""The MoE block's front end for decode-sized steps: RMSNorm + router projection in one kernel.

    h = rms_norm(x) * norm_weight                 (HF rounding: normalised in fp32, cast, times the weight)
    logits = round_to_x_dtype(h @ router)         (fp32 accumulation; HF's F.linear output dtype)

At batch 1 XLA runs this as ~5 kernels per layer (the norm's reduction and multiply, the batch-1 dot's
padding row, the dot, the logits' conversion to fp32 for the routing kernel: ~7.5 us of launches and
tails per Qwen3-30B-A3B layer on the H100, `profile_latency_b1_qwen3-30b-a3b_h100_*.trace.json.gz`). Here
one program per block of `block_e` experts recomputes the row norms (x is a few KB next to the router's
512 KB), streams its router columns in `block_k` chunks through a tensor-core dot (rows padded to 16 in
registers only: they are loaded masked), and writes its logits as fp32 (the values rounded through x's
dtype, as the reference path gives them to `moe_route`); program 0 also writes h for the expert GEMMs.

GPU backend: the Pallas Triton lowering (see `pallas_kernels/__init__.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Largest step this kernel takes (rows held in registers; larger steps keep XLA's fusions and GEMM).
MAX_TOKENS = 64


def _pow2_divisor(n: int, cap: int) -> int:
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


def _router_kernel(x_ref, n_ref, w_ref, h_ref, l_ref, *, block_t, block_k, eps):
    # x_ref [T, H] (whole; rows >= T read as 0); n_ref [H]; w_ref [H, block_e]: this program's router columns;
    # h_ref [T, H] (whole, written by program 0); l_ref [T, E] fp32 (whole): this program's block_e columns.
    tokens, hidden = x_ref.shape
    block_e = w_ref.shape[1]
    real = jnp.arange(block_t, dtype=jnp.int32) < tokens  # [block_t]

    def x_cols(k):  # [block_t, block_k]
        cols = pl.ds(k * block_k, block_k)
        return plgpu.load(x_ref.at[pl.ds(0, block_t), cols], mask=jnp.broadcast_to(real[:, None], (block_t, block_k)),
                          other=0)

    ss = jnp.zeros((block_t,), jnp.float32)
    for k in range(hidden // block_k):  # straight-line: the row's loads all in flight at once
        xk = x_cols(k).astype(jnp.float32)
        ss = ss + jnp.sum(xk * xk, axis=1)
    inv = jax.lax.rsqrt(ss / hidden + eps)  # [block_t]
    first = pl.program_id(0) == 0
    # float32 weights (the goldens): exact products, not TF32 (bf16 inputs are exact either way)
    precision = jax.lax.Precision.HIGHEST if x_ref.dtype == jnp.float32 else None

    def body(k, acc):
        cols = pl.ds(k * block_k, block_k)
        hk = (x_cols(k).astype(jnp.float32) * inv[:, None]).astype(x_ref.dtype) * n_ref[cols][None, :]

        @pl.when(first)
        def _():
            plgpu.store(h_ref.at[pl.ds(0, block_t), cols], hk,
                        mask=jnp.broadcast_to(real[:, None], (block_t, block_k)))

        return acc + plgpu.dot(hk, w_ref[cols, :], precision=precision)

    acc = jax.lax.fori_loop(0, hidden // block_k, body, jnp.zeros((block_t, block_e), jnp.float32))
    plgpu.store(l_ref.at[pl.ds(0, block_t), pl.ds(pl.program_id(0) * block_e, block_e)],
                acc.astype(x_ref.dtype).astype(jnp.float32),
                mask=jnp.broadcast_to(real[:, None], (block_t, block_e)))


@functools.partial(jax.jit, static_argnames=("eps", "block_e", "block_k", "num_warps", "num_stages", "interpret"))
def moe_norm_router(x: jax.Array, norm_weight: jax.Array, router: jax.Array, *, eps: float,
                    block_e: int | None = None, block_k: int | None = None, num_warps: int = 4,
                    num_stages: int = 3, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """(h, logits) of a MoE block's input: `h = rms_norm(x) * norm_weight` in x's dtype and the router's
    logits `h @ router` as fp32 holding values rounded to x's dtype (what `moe_route` takes).

    Args:
      x: `[tokens, hidden]`, tokens <= MAX_TOKENS.
      norm_weight: `[hidden]`.
      router: `[hidden, experts]`.
      eps: RMSNorm epsilon.
      block_e: experts per program (power of two dividing experts; default 16: 8 programs for 128 experts).
      block_k: hidden columns per step of the dot (power of two dividing hidden; default 256).
      num_warps, num_stages: Triton launch parameters.
      interpret: run the Pallas interpreter (CPU tests).
    """
    if x.ndim != 2 or norm_weight.shape != (x.shape[1],) or router.ndim != 2 or router.shape[0] != x.shape[1]:
        raise ValueError(f"x must be [tokens, hidden], norm_weight [hidden], router [hidden, experts]: {x.shape=} "
                         f"{norm_weight.shape=} {router.shape=}")
    tokens, hidden = x.shape
    experts = router.shape[1]
    if norm_weight.dtype != x.dtype or router.dtype != x.dtype:
        raise ValueError(f"x, norm_weight and router must share a dtype: {x.dtype}, {norm_weight.dtype}, "
                         f"{router.dtype}")
    if not 1 <= tokens <= MAX_TOKENS:
        raise ValueError(f"tokens={tokens} must be in [1, {MAX_TOKENS}]")
    if hidden % 16 or experts % 8:
        raise ValueError(f"hidden={hidden} must be a multiple of 16 and experts={experts} of 8")
    block_e = block_e or _pow2_divisor(experts, 16)
    block_k = block_k or _pow2_divisor(hidden, 256)
    for name, b, n in (("block_e", block_e, experts), ("block_k", block_k, hidden)):
        if b & (b - 1) or n % b or b < (8 if name == "block_e" else 16):
            raise ValueError(f"{name}={b} must be a power of two dividing {n} (>= {8 if name == 'block_e' else 16})")
    block_t = max(16, 1 << (tokens - 1).bit_length())
    kernel = functools.partial(_router_kernel, block_t=block_t, block_k=block_k, eps=eps)
    whole = pl.no_block_spec
    return pl.pallas_call(
        kernel,
        grid=(experts // block_e,),
        in_specs=[whole, pl.BlockSpec((hidden,), lambda e: (0,)), pl.BlockSpec((hidden, block_e), lambda e: (0, e))],
        out_specs=[whole, whole],
        out_shape=[jax.ShapeDtypeStruct((tokens, hidden), x.dtype),
                   jax.ShapeDtypeStruct((tokens, experts), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"moe_norm_router_t{block_t}_e{block_e}_k{block_k}",
    )(x, norm_weight, router)


def moe_norm_router_reference(x: jax.Array, norm_weight: jax.Array, router: jax.Array, *, eps: float
                              ) -> tuple[jax.Array, jax.Array]:
    """What `ops.moe_block` computes with XLA: HF's RMSNorm, then the router's F.linear in x's dtype."""
    from jinfer.models.layers import rms_norm

    h = rms_norm(x, norm_weight, eps)
    # float32: exact products as the kernel takes them (XLA's default on a GPU is TF32, ~1e-3 relative)
    precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    return h, jnp.dot(h, router, precision=precision,
                      preferred_element_type=jnp.float32).astype(x.dtype).astype(jnp.float32)

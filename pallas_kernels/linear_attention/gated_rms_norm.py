"""Gated RMSNorm (Gated DeltaNet's output norm): per head, weight * rms_norm(x) * silu(gate).

x, gate: [N, D] (rows: tokens x value heads); weight: [D]. HF's `Qwen3_5RMSNormGated` rounding: the
normalised value in x's dtype times the weight, then times silu(gate) in float32, cast back to x's dtype.
One program normalises `block_rows` rows (one read of x and gate, one write): XLA runs the same as a
few fusions with the statistics in between.

GPU backend: the Pallas Triton lowering (see `pallas_kernels/__init__.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _kernel(x_ref, z_ref, w_ref, o_ref, *, eps: float, gate_col: int | None, heads: int, rows: int):
    # x_ref, o_ref [block_rows, D]; w_ref [D]; z_ref [block_rows, D], or with gate_col the whole [T, W] array
    # holding row r's gate (token r // heads, head r % heads) at columns gate_col + (r % heads) D + [0, D)
    x = x_ref[...].astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=1, keepdims=True) + eps)
    h = (w_ref[...][None, :] * x.astype(x_ref.dtype)).astype(jnp.float32)
    if gate_col is None:
        z = z_ref[...]
    else:
        br, d = x_ref.shape
        r = jnp.minimum(pl.program_id(0) * br + jnp.arange(br, dtype=jnp.int32), rows - 1)  # padding: any real row
        cols = gate_col + (r % heads)[:, None] * d + jnp.arange(d, dtype=jnp.int32)[None, :]
        z = z_ref[(r // heads)[:, None], cols]
    z = z.astype(jnp.float32)
    o_ref[...] = (h * z * jax.nn.sigmoid(z)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "gate_col", "block_rows", "interpret"))
def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, *, eps: float, gate_col: int | None = None,
                   block_rows: int = 16, interpret: bool = False) -> jax.Array:
    """weight * rms_norm(x) * silu(gate) over the last axis; x, gate: [..., D] (D a power of two). With gate_col,
    x is [T, H, D] and gate the [T, W] array that holds each token's gates for its H heads at columns
    [gate_col, gate_col + H D) (e.g. the layer's input projection: read in place, not sliced out and copied)."""
    d = x.shape[-1]
    if gate_col is None:
        if gate.shape != x.shape:
            raise ValueError(f"gate must match x: {x.shape=} {gate.shape=}")
    elif x.ndim != 3 or gate.ndim != 2 or gate.shape[0] != x.shape[0] or gate_col + x.shape[1] * d > gate.shape[1]:
        raise ValueError(f"with gate_col, x must be [T, H, D] and gate [T, W >= gate_col + H D]: {x.shape=} "
                         f"{gate.shape=} {gate_col=}")
    if weight.shape != (d,):
        raise ValueError(f"weight must be [D]: {weight.shape=} for {x.shape=}")
    if d & (d - 1):
        raise ValueError(f"the normalised dimension ({d}) must be a power of two")
    n = x.size // d
    rows = pl.cdiv(n, block_rows) * block_rows
    pad = lambda a: jnp.pad(a.reshape(n, d), ((0, rows - n), (0, 0)))  # noqa: E731
    block = pl.BlockSpec((block_rows, d), lambda i: (i, 0))
    heads = x.shape[1] if gate_col is not None else 1
    out = pl.pallas_call(
        functools.partial(_kernel, eps=eps, gate_col=gate_col, heads=heads, rows=n),
        grid=(rows // block_rows,),
        in_specs=[block, block if gate_col is None else pl.no_block_spec, pl.BlockSpec((d,), lambda i: (0,))],
        out_specs=block,
        out_shape=jax.ShapeDtypeStruct((rows, d), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="gated_rms_norm",
    )(pad(x), pad(gate) if gate_col is None else gate, weight.astype(x.dtype))
    return out[:n].reshape(x.shape)


def gated_rms_norm_reference(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    h = weight * xf.astype(x.dtype)
    return (h.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)

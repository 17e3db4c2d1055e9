"""Reading a weight into L2 from programs a kernel's launch would leave idle.

A decode step's small kernels (the norm + q|k|v kernel, the attention of a few sequences) leave SMs and HBM
bandwidth unused, and the o projection after them streams a weight from HBM with a GEMM's ramp-up. Extra programs in
those launches read (a part of) that weight, marked evict-last, so the GEMM finds it in L2. See
`norm_qkv_rope_write(prefetch=...)`. (The same from extra programs of the decode attention kernel, whose launch
at batch 1 leaves HBM mostly idle, was measured slower: the prefetch programs, a few tiles each, are latency-bound
and outlast the attention; `local_step_attn_prefetch_o_qwen3-4b_h100.json`, at b3b0fad.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

EVICTIONS = ("evict_last", "normal")  # the loads' L2 policy: kept over normal lines, or not
WIDTH = 256  # columns of the [rows, WIDTH] view a prefetch program reads a tile of
TILE = 64  # rows of a prefetch tile (32 KB of bf16)


def prefetch_view(a: jax.Array) -> jax.Array | None:
    """`a` as [rows, WIDTH] (a free reshape), or None where its size does not divide. FP8 values are read as their
    bytes (uint8, a free bitcast: Triton's lowering has no masked FP8 load with a fill value)."""
    if a.size % WIDTH:
        return None
    if a.dtype == jnp.float8_e4m3fn:
        a = jax.lax.bitcast_convert_type(a, jnp.uint8)
    return a.reshape(-1, WIDTH)


def prefetch_rows(pf_ref, pf_out, p, programs: int, rows: int, tile: int = TILE, eviction: str = "evict_last"):
    """Program p of `programs` reads its share of pf_ref's first `rows` rows in `tile`-row tiles, marked to stay in
    L2 (`eviction` "evict_last"; "normal": unmarked), and stores their max at pf_out[p] (the loads must feed
    something)."""
    if eviction not in EVICTIONS:
        raise ValueError(f"eviction={eviction!r} must be one of {EVICTIONS}")
    width = pf_ref.shape[1]
    per = pl.cdiv(pl.cdiv(rows, programs), tile) * tile
    idx = jnp.arange(tile, dtype=jnp.int32)

    def body(i, acc):
        first = p * per + i * tile
        mask = jnp.broadcast_to(((first + idx) < rows)[:, None], (tile, width))
        t = plgpu.load(pf_ref.at[pl.ds(first, tile), :], mask=mask, other=0,
                       eviction_policy=None if eviction == "normal" else eviction)
        return jnp.maximum(acc, t.astype(jnp.float32))

    acc = jax.lax.fori_loop(0, per // tile, body, jnp.zeros((tile, width), jnp.float32))
    pf_out[p] = jnp.max(acc)


def prefetch_rows_count(view: jax.Array, fraction: float) -> int:
    """Rows of a prefetch view that `fraction` of it covers (at least one)."""
    return max(1, int(view.shape[0] * fraction))

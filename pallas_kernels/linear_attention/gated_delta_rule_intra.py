"""The intra-chunk part of the chunked gated delta rule: one fused Pallas kernel, and its jnp reference.

Phase 1 of gated_delta_rule_chunked.py (read its doc first): for every chunk of C rows of a
sequence and every value head, everything that does not depend on the state (gc the cumulative log-decay
from the chunk's start, k and q L2-normalised, q also by Dk^-0.5):

    L  = strictly_lower(beta_i k_i.k_j exp(gc_i - gc_j))     W = (I + L)^-1 (beta e^gc K)   [C, Dk]
    P  = lower(q_i.k_j exp(gc_i - gc_j))          [C, C]     U = (I + L)^-1 (beta V)        [C, Dv]
    Qg = Q e^gc   Kd = K e^(gc_last - gc)         [C, Dk]    dl = e^gc_last

`intra_chunk` (plain jnp, float32, all chunks at once; the inverse as a product of (I + (-L)^(2^j))) is the
reference. XLA runs it as a dozen batched ops whose [chunks, Hv, C, C] / [chunks, Hv, C, D] float32
intermediates go through HBM: 0.55 / 5.1 ms per layer at 1k / 16k tokens on the H100 (Qwen3.5-4B's
Hv = 32, Dk = Dv = 128), most of the prefill.

The kernel (`intra_chunk_pallas`, Triton lowering) runs one program per (chunk, value head): it reads the
chunk's rows of q, k, v, g, beta straight from the activations (their dtype, bf16 on the GPU; masked
loads: a chunk's rows are contiguous, a sequence's last chunk has fewer than C), computes in float32
registers and writes each output once, in `out_dtype`. The solve follows flash-linear-attention's
solve_tril: L in 16 x 16 blocks (L_ij = beta_i k_i k_j^T decayed, one dot each), each diagonal block's
unit-lower inverse (by default the product of (I + (-L_ii)^(2^j)): six 16 x 16 dots in exact float32; or by
forward substitution over its rows, a row picked out of a register tile by a masked sum: Triton has no
dynamic register indexing), then block forward substitution straight on the right-hand sides,
X_i = (I + L_ii)^-1 (R_i - sum_{j<i} L_ij X_j): 16-row dots on the tensor cores, no [C, C] inverse is ever
formed (a register tile cannot be cut into blocks; the 16-row blocks are loaded as such). P, Qg, Kd come
from whole [C, D] tiles. The blocks are also the more exact solve: with correlated keys, beta near 1 and
little decay, the reference's 64 x 64 product form sums powers of L that grow like 2^63 and cancel (W off by
~500x its size against a float64 solve), where the kernel stays within 5e-6 (XLA's triangular solve too).

Why not one kernel with the recurrence (per sequence and head)? The recurrence is sequential along a
sequence: inside it, this work would run chunk after chunk on 32 (heads) x Dv / block_v programs, each
redoing it for its value block; apart it runs on chunks x heads programs at once (512 at 1k tokens,
8192 at 16k, all independent) and the recurrence's per-chunk step stays four dots. fla keeps them
apart for the same reason.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.linear_attention.gated_delta_rule_common import L2_EPS, head_shapes, head_views, prepare_qk

BLOCK = 16  # rows of the solve's blocks (the smallest tensor-core dot)
OUTPUTS = ("w", "u", "qg", "kd", "p", "dl")


# ----------------------------------------------------------------------------------------------
# Kernel body
# ----------------------------------------------------------------------------------------------
def _inverse_by_substitution(a):
    """(I + a)^-1 for a strictly lower [n, n] register tile, by forward substitution over its rows: row i of
    the inverse is e_i - sum_{j<i} a_ij inv_j (rows j < i already final; a_ij = 0 for j >= i). Exact
    float32; 2 (n - 1) cross-thread reductions."""
    n = a.shape[0]
    r = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
    c = jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)
    inv = jnp.where(r == c, 1.0, 0.0).astype(jnp.float32)
    for i in range(1, n):
        a_i = jnp.sum(jnp.where(r == i, a, 0.0), axis=0)  # [n]: row i of a
        row = -jnp.sum(a_i[:, None] * inv, axis=0)  # [n]
        inv = jnp.where(r == i, row[None, :] + inv, inv)  # inv's row i was e_i
    return inv


def _inverse_by_products(a):
    """(I + a)^-1 for a strictly lower [n, n] register tile as prod_j (I + (-a)^(2^j)) (a is nilpotent; as
    `unit_lower_inverse`): 2 log2(n) - 2 dots of [n, n] tiles, in full float32 (tiny: FMA, not TF32)."""
    n = a.shape[0]
    dot = functools.partial(jnp.dot, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    r = jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
    c = jax.lax.broadcasted_iota(jnp.int32, (n, n), 1)
    x = -a
    inv = jnp.where(r == c, 1.0, 0.0).astype(jnp.float32) + x
    for _ in range(n.bit_length() - 2):  # x^2, x^4, ..., x^(n/2)
        x = dot(x, x)
        inv = inv + dot(inv, x)
    return inv


DIAG_INVERSES = {"products": _inverse_by_products, "substitution": _inverse_by_substitution}


def _intra_kernel(start_ref, count_ref, q_ref, k_ref, v_ref, g_ref, beta_ref,
                  w_ref, u_ref, qg_ref, kd_ref, p_ref, dl_ref, *, group: int, precision, diag_inverse: str,
                  offsets: tuple[int, int, int], heads: int):
    # start_ref, count_ref [NC]: each chunk's first row and row count (0: unused chunk, not written);
    # q_ref, k_ref [T, Hk, Dk]; v_ref [T, Hv, Dv] (activation dtype; or one packed array, heads read at `offsets`:
    # gated_delta_rule.head_views); g_ref, beta_ref [T, Hv] f32;
    # w_ref, qg_ref, kd_ref [NC, Hv, C, Dk]; u_ref [NC, Hv, C, Dv]; p_ref [NC, Hv, C, C] (out dtype);
    # dl_ref [NC, Hv] f32. The program's `heads` value heads share one key head (heads divides group): what
    # only q and k decide (their loads, norms, Q K^T and the K K^T blocks) is computed once for them.
    c, h0 = pl.program_id(0), pl.program_id(1) * heads
    qh, kh = offsets[0] + h0 // group, offsets[1] + h0 // group
    C, dk, dv = p_ref.shape[-1], q_ref.shape[-1], v_ref.shape[-1]
    nb = C // BLOCK
    start, count = start_ref[c], count_ref[c]
    out_dtype = w_ref.dtype
    dot = functools.partial(jnp.dot, precision=precision, preferred_element_type=jnp.float32)

    def dot_t(a, b):  # a @ b^T
        return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                                   preferred_element_type=jnp.float32)

    def rows(first, n, ref, head, width):  # [n, width] f32 of rows first.. of `ref`'s head; past the chunk: 0
        ok = first + jnp.arange(n, dtype=jnp.int32) < count
        x = plgpu.load(ref.at[pl.ds(start + first, n), head, :], mask=jnp.broadcast_to(ok[:, None], (n, width)),
                       other=0)
        return x.astype(jnp.float32)

    def unit(x):  # L2-normalised rows
        return x * jax.lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + L2_EPS)

    memo: dict = {}

    def once(key, fn):  # key-side values: traced at their first use (the one head's order), shared by the others
        if key not in memo:
            memo[key] = fn()
        return memo[key]

    def head(h, i_c, ok):
        vh = offsets[2] + h
        g = plgpu.load(g_ref.at[pl.ds(start, C), h], mask=ok, other=0).astype(jnp.float32)  # [C]

        def cum(first, n):  # [n] gc of rows first..: sums of g over rows <= each (a masked sum, no scan)
            i = first + jnp.arange(n, dtype=jnp.int32)
            return jnp.sum(jnp.where(i[:, None] >= i_c[None, :], g[None, :], 0.0), axis=1)

        def decay(gi, gj, keep):  # exp(gc_i - gc_j) where keep (there i >= j: the exponent is <= 0), else 0
            return jnp.exp(jnp.where(keep, gi[:, None] - gj[None, :], -jnp.inf))

        # Qg, Kd, P, dl from whole chunk tiles
        gc = cum(0, C)  # [C]
        g_last = jnp.sum(g)
        q = once("q", lambda: unit(rows(0, C, q_ref, qh, dk)) * dk ** -0.5)  # [C, Dk]
        k = once("k", lambda: unit(rows(0, C, k_ref, kh, dk)))
        qg_ref[c, h, :, :] = (q * jnp.exp(gc)[:, None]).astype(out_dtype)
        rest = jnp.sum(jnp.where(i_c[None, :] > i_c[:, None], g[None, :], 0.0), axis=1)  # gc_last - gc, summed as
        kd_ref[c, h, :, :] = (k * jnp.exp(rest)[:, None]).astype(out_dtype)  # such (no cancellation)
        qk = once("qk", lambda: dot_t(q, k))
        p_ref[c, h, :, :] = (qk * decay(gc, gc, i_c[:, None] >= i_c[None, :])).astype(out_dtype)
        dl_ref[c, h] = jnp.exp(g_last)

        # the WY factors: L in 16-row blocks (kept: 10 x [16, 16]), then block forward substitution on each
        # right-hand side in turn, beta e^gc K then beta V (its 16-row blocks reloaded: only one side's X blocks
        # are live at a time, [C, D] f32, not both with the keys)
        i_b = jnp.arange(BLOCK, dtype=jnp.int32)
        strict = i_b[:, None] > i_b[None, :]
        ks, gcs, betas, low, invs = [], [], [], [], []
        for b in range(nb):
            kb = once(("kb", b), lambda b=b: unit(rows(b * BLOCK, BLOCK, k_ref, kh, dk)))  # [16, Dk]
            gb = cum(b * BLOCK, BLOCK)  # [16]
            bb = plgpu.load(beta_ref.at[pl.ds(start + b * BLOCK, BLOCK), h], mask=b * BLOCK + i_b < count,
                            other=0).astype(jnp.float32)
            # L_bj, j < b (its rows all after its columns: exponents <= 0)
            low.append([bb[:, None] * once(("kk", b, j), lambda kb=kb, kj=ks[j]: dot_t(kb, kj))
                        * jnp.exp(gb[:, None] - gcs[j][None, :]) for j in range(b)])
            diag = bb[:, None] * once(("kk", b, b), lambda kb=kb: dot_t(kb, kb)) * decay(gb, gb, strict)  # L_bb
            invs.append(DIAG_INVERSES[diag_inverse](diag))
            ks.append(kb)
            gcs.append(gb)
            betas.append(bb)
        del ks

        def rhs_k(b):  # [16, Dk] beta e^gc k of block b
            return unit(rows(b * BLOCK, BLOCK, k_ref, kh, dk)) * (betas[b] * jnp.exp(gcs[b]))[:, None]

        def rhs_v(b):  # [16, Dv] beta v of block b
            return rows(b * BLOCK, BLOCK, v_ref, vh, dv) * betas[b][:, None]

        for rhs, out_ref in ((rhs_k, w_ref), (rhs_v, u_ref)):
            xs = []
            for b in range(nb):  # X_b = (I + L_bb)^-1 (R_b - sum_{j<b} L_bj X_j)
                x = rhs(b)
                for j in range(b):
                    x = x - dot(low[b][j], xs[j])
                xs.append(dot(invs[b], x))
                out_ref[c, h, pl.ds(b * BLOCK, BLOCK), :] = xs[b].astype(out_dtype)

    @pl.when(count > 0)
    def _():
        i_c = jnp.arange(C, dtype=jnp.int32)
        for i in range(heads):
            head(h0 + i, i_c, i_c < count)


# ----------------------------------------------------------------------------------------------
# Wrapper
# ----------------------------------------------------------------------------------------------
def _intra_call(q, k, v, g, beta, start, count, *, hk, hv, chunk, out_dtype, precision, diag_inverse, num_warps,
                num_stages, offsets, heads, interpret):
    dk, dv = q.shape[-1], v.shape[-1]
    nc = start.shape[0]
    whole = pl.no_block_spec
    big = lambda d: jax.ShapeDtypeStruct((nc, hv, chunk, d), out_dtype)  # noqa: E731
    kernel = functools.partial(_intra_kernel, group=hv // hk, precision=precision, diag_inverse=diag_inverse,
                               offsets=offsets, heads=heads)
    out = pl.pallas_call(
        kernel,
        grid=(nc, hv // heads),
        in_specs=[whole] * 7,
        out_specs=[whole] * 6,
        out_shape=[big(dk), big(dv), big(dk), big(dk), big(chunk), jax.ShapeDtypeStruct((nc, hv), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"gated_delta_rule_intra_c{chunk}",
    )(start, count, q, k, v, g.astype(jnp.float32), beta.astype(jnp.float32))
    return dict(zip(OUTPUTS, out, strict=True))


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("out_dtype", "exact", "diag_inverse", "num_warps", "num_stages",
                                             "packed_k_heads", "heads_per_program", "interpret"))
def intra_chunk_pallas(q, k, v, g, beta, rows, *, out_dtype=None, exact: bool = False, diag_inverse: str = "products",
                       num_warps: int = 4, num_stages: int = 1, packed_k_heads: int | None = None,
                       heads_per_program: int = 1, interpret: bool = False) -> dict[str, jax.Array]:
    """`intra_chunk`'s results from the fused kernel (module doc), for the chunks that hold rows.

    q, k: [T, Hk, Dk]; v: [T, Hv, Dv] (or q|k|v packed in q, k = v = None: gated_delta_rule.head_views); g, beta:
    [T, Hv]; rows: [NC, C] (chunk_layout's: each chunk's rows,
    contiguous, T past its end). Returns {"w", "qg", "kd": [NC, Hv, C, Dk], "u": [NC, Hv, C, Dv], "p":
    [NC, Hv, C, C]} in out_dtype (default: v's dtype, as fla stores W and U) and {"dl": [NC, Hv] float32};
    a chunk without rows is not written (undefined: the recurrence never reads it). exact: dots in full
    float32 (default: TF32 on the GPU's tensor cores). diag_inverse: how the 16 x 16 diagonal blocks of
    (I + L) are inverted ("products": six exact-f32 dots; "substitution": row by row). heads_per_program: value
    heads per program (a divisor of Hv / Hk: the heads of one key head share its loads, norms and key-side
    dots; fewer, longer programs). C a multiple of 16, Dk and Dv >= 16.
    """
    qs, ks, vs = head_shapes(q, k, v, packed_k_heads)
    T, hk, dk = qs.shape
    hv, dv = vs.shape[1], vs.shape[2]
    C = rows.shape[1]
    if C % BLOCK or C < BLOCK:
        raise ValueError(f"chunk={C} must be a multiple of {BLOCK}")
    if min(dk, dv) < 16 or dk & (dk - 1) or dv & (dv - 1):
        raise ValueError(f"key_dim={dk} and value_dim={dv} must be powers of two >= 16")
    if hv % hk or ks.shape != qs.shape or g.shape != (T, hv) or beta.shape != (T, hv) or vs.shape[0] != T:
        raise ValueError(f"q/k must be [T, Hk, Dk], v [T, Hv, Dv], g/beta [T, Hv]: {qs.shape=} {ks.shape=} "
                         f"{vs.shape=} {g.shape=} {beta.shape=}")
    if diag_inverse not in DIAG_INVERSES:
        raise ValueError(f"diag_inverse={diag_inverse!r} must be one of {sorted(DIAG_INVERSES)}")
    if heads_per_program < 1 or (hv // hk) % heads_per_program:
        raise ValueError(f"heads_per_program={heads_per_program} must divide the value heads per key head ({hv // hk})")
    count = jnp.sum(rows < T, axis=1).astype(jnp.int32)  # [NC]
    start = jnp.where(count > 0, rows[:, 0], 0).astype(jnp.int32)
    precision = jax.lax.Precision.HIGHEST if exact else jax.lax.Precision.DEFAULT
    (q, k, v), offsets = head_views(q, k, v, packed_k_heads)
    return _intra_call(q, k, v, g, beta, start, count, hk=hk, hv=hv, chunk=C,
                       out_dtype=jnp.dtype(out_dtype or vs.dtype), precision=precision, diag_inverse=diag_inverse,
                       num_warps=num_warps, num_stages=num_stages, offsets=offsets, heads=heads_per_program,
                       interpret=interpret)


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------
def unit_lower_inverse(a: jax.Array) -> jax.Array:
    """(I + L)^-1 for [..., C, C] unit lower-triangular `a` (C a power of two), as batched matmuls.

    L is nilpotent (L^C = 0), so (I + L)^-1 = sum_k (-L)^k = prod_j (I + (-L)^(2^j)), j < log2 C: 2 log2 C
    matmuls of [C, C] tiles for the tensor cores instead of XLA's batched triangular solve
    (`benchmarks.kernels.bench_linear_attention intra` times both). On the H100 the whole intra-chunk part took
    0.553 / 5.10 ms at 1k / 16k tokens with it and 0.567 / 5.78 ms with the solve
    (gdn_chunked_product_inverse_h100.json): the solve was not where its time goes; its [chunks, heads, 64, 64]
    float32 intermediates in HBM are. Not stable when L's entries approach 1 (correlated keys, beta near 1, little
    decay): the powers grow like 2^C and cancel (test_gated_delta_rule_intra.py); the kernel inverts 16 x 16
    blocks only."""
    C = a.shape[-1]
    hp = jax.lax.Precision.HIGHEST
    x = jnp.eye(C, dtype=a.dtype) - a  # -L
    inv = jnp.eye(C, dtype=a.dtype) + x
    for _ in range(C.bit_length() - 2):  # x^2, x^4, ..., x^(C/2)
        x = jnp.matmul(x, x, precision=hp)
        inv = inv + jnp.matmul(inv, x, precision=hp)
    return inv


def intra_chunk(q, k, v, g, beta, rows, solve: str = "product") -> dict[str, jax.Array]:
    """The state-independent part of every chunk, batched (plain jnp, float32).

    q, k: [T, Hk, Dk] (raw: L2-normalised and scaled here); v: [T, Hv, Dv]; g, beta: [T, Hv];
    rows: [NC, C] (T = a zero row). Returns {"w", "qg", "kd": [NC, Hv, C, Dk], "u": [NC, Hv, C, Dv],
    "p": [NC, Hv, C, C] (lower-triangular incl. the diagonal), "dl": [NC, Hv] exp(gc_last)}.
    """
    hv = v.shape[1]
    qh, kh = prepare_qk(q, k, hv)  # [T, Hv, Dk] f32

    def gather(x):  # [T, Hv, ...] -> [NC, Hv, C, ...], zeros at padding rows
        x = jnp.concatenate([x.astype(jnp.float32), jnp.zeros_like(x[:1], jnp.float32)])
        return jnp.moveaxis(x[rows], 2, 1)

    qc, kc, vc = gather(qh), gather(kh), gather(v)  # [NC, Hv, C, D]
    gc = jnp.cumsum(gather(g), axis=-1)  # [NC, Hv, C]
    bc = gather(beta)
    C = rows.shape[1]
    i = jnp.arange(C)
    lower, strict = i[:, None] >= i[None, :], i[:, None] > i[None, :]
    # exp(gc_i - gc_j) for j <= i only (above the diagonal the difference is positive and may overflow)
    decay = jnp.exp(jnp.where(lower, gc[..., :, None] - gc[..., None, :], -jnp.inf))  # [NC, Hv, C, C]
    hp = jax.lax.Precision.HIGHEST
    kk = jnp.einsum("nhik,nhjk->nhij", kc, kc, precision=hp)
    a = jnp.where(strict, bc[..., :, None] * kk * decay, 0.0) + jnp.eye(C, dtype=jnp.float32)
    rhs = jnp.concatenate([kc * (bc * jnp.exp(gc))[..., None], vc * bc[..., None]], axis=-1)
    if solve == "product":
        x = jnp.matmul(unit_lower_inverse(a), rhs, precision=hp)
    else:  # "trsm": XLA's batched triangular solve
        x = jax.lax.linalg.triangular_solve(a, rhs, left_side=True, lower=True, unit_diagonal=True)
    dk = kc.shape[-1]
    qk = jnp.einsum("nhik,nhjk->nhij", qc, kc, precision=hp)
    return {"w": x[..., :dk], "u": x[..., dk:], "qg": qc * jnp.exp(gc)[..., None],
            "kd": kc * jnp.exp(gc[..., -1:] - gc)[..., None], "p": jnp.where(lower, qk * decay, 0.0),
            "dl": jnp.exp(gc[..., -1])}

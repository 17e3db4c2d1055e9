"""Mixture-of-experts routing: router logits -> top-k experts and weights -> the routed rows grouped
by expert, on the device with no host sync.

The grouped layout (`MoeRouting`) is what the grouped GEMMs (moe_gemm.py, moe_gemm_mgpu.py) read:
the T*k (token, slot) pairs, pair p = t * k + j, sorted by expert (within an expert by token), each
expert's segment padded to a multiple of `block_m` rows, so every block of `block_m` rows belongs to
one expert (vLLM's `moe_align_block_size` layout). The block count is static: at most
cdiv(T*k, block_m) + min(E, T*k) blocks are used (each non-empty expert adds at most one partial
block); the unused ones come last, with expert -1 and 0 rows.

Routing is HF's (Qwen3-MoE, Mixtral): softmax over the experts in float32, top-k (ties to the lower
expert id, as `lax.top_k`), renormalised to sum to 1 when `renormalize`.

Two implementations of the same layout:
- `moe_route`: one Pallas program (Triton lowering) for decode-sized steps. softmax, top-k by k
  rounds of arg-max, per-expert counts, each pair's rank among its expert's pairs (an exclusive
  cumsum over tokens of the [T, E] selection mask: a token picks an expert at most once, so pairs of
  one expert are ordered by token), the block table, and a scatter of the pair ids into their rows.
  At batch 1 XLA's version is ~8 small kernels per layer, which is most of a layer's budget.
- `moe_route_reference`: the same computation in jnp (XLA), used for large steps and as the
  reference. Rows of `sorted_pairs` past a block's `block_rows` are 0 here and unspecified in the
  kernel's output.

Routings that choose their experts otherwise (DeepSeek's group-limited top-k, in XLA) give the chosen
ids and weights to `moe_route_chosen`: the same program from the selection mask on (`layout_body`), and
its jnp form `moe_route_chosen_reference`.

Shared experts stacked after the routed ones (`shared` S: ids E..E+S-1, chosen by every token, in the last S slots
of each token's k + S): their blocks follow the routed experts' blocks, cdiv(T, block_m) each, laid out without
widening the [T, E] selection tiles. It is the layout `moe_route_chosen_reference` gives those ids over E + S
experts (blocks are ordered by expert id); only the static block count differs.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import next_pow2, search_right

# Largest token count routed by the Pallas program; larger steps use the jnp version (the program
# holds [tokens, experts] tiles in registers).
ROUTE_KERNEL_MAX_TOKENS = 256


@jax.tree_util.register_dataclass
@dataclass
class MoeRouting:
    topk_ids: jax.Array  # [T, k] int32: the experts of each token, best first
    topk_weights: jax.Array  # [T, k] float32: their routing weights
    pair_rows: jax.Array  # [T, k] int32: row of pair (t, j) in the expert-sorted layout
    sorted_pairs: jax.Array  # [M] int32: pair id t * k + j of each row (valid rows only, see block_rows)
    block_expert: jax.Array  # [NB] int32: expert of each block of block_m rows; -1: unused block
    block_rows: jax.Array  # [NB] int32: valid rows at the start of each block (0 for unused blocks)

    @property
    def block_m(self) -> int:
        return self.sorted_pairs.shape[0] // self.block_expert.shape[0]

    @property
    def top_k(self) -> int:
        return self.topk_ids.shape[1]


def num_blocks(num_pairs: int, num_experts: int, block_m: int, tokens: int = 0, shared: int = 0) -> int:
    """Static bound on the blocks of the grouped layout: the blocks used number sum_e cdiv(c_e, block_m)
    < R / block_m + n (R routed pairs, n <= min(E, R) experts hit), so with block_m > 1 the last block is never
    used; `shared` experts (every one of the `tokens`) add cdiv(tokens, block_m) blocks each."""
    return pl.cdiv(num_pairs, block_m) + min(num_experts, num_pairs) + shared * pl.cdiv(tokens, block_m)


# ----------------------------------------------------------------------------------------------
# Kernel body
# ----------------------------------------------------------------------------------------------
def _route_kernel(logits_ref, *out_refs, **kw):
    # logits_ref [Tp, Ep] f32 (padding columns -inf, padding rows finite)
    route_body(logits_ref[...], *out_refs, **kw)


def _place_kernel(ids_ref, rows_ref, sorted_ref, bexp_ref, brows_ref, *, tokens, experts, top_k, block_m, shared):
    # ids_ref [T*k] int32: the chosen experts, pair p = t * k + j (gathered: no padded copy; the last `shared` slots
    # are the shared experts, laid out by layout_body itself); the outputs as route_body's
    tp = rows_ref.shape[0]
    t = jnp.minimum(lax.broadcasted_iota(jnp.int32, (tp,), 0), tokens - 1)  # [Tp]: padding rows read the last token
    picked = [ids_ref[t * top_k + j][:, None] for j in range(top_k - shared)]  # routed slots x [Tp, 1]
    e = lax.broadcasted_iota(jnp.int32, (tp, next_pow2(experts)), 1)  # [Tp, Ep]
    chosen = functools.reduce(operator.or_, [e == ij for ij in picked])  # [Tp, Ep]
    layout_body(picked, chosen, rows_ref, sorted_ref, bexp_ref, brows_ref, tokens=tokens, experts=experts,
                top_k=top_k, block_m=block_m, shared=shared)


def route_body(logits, ids_ref, w_ref, rows_ref, sorted_ref, bexp_ref, brows_ref, *, tokens, experts, top_k,
               block_m, renormalize, scaling=1.0, shared=0, shared_weight=None):
    """The routing program's work on its logits [Tp, Ep] f32 (padding columns -inf, padding rows finite), also the
    tail of moe_router.moe_norm_route. ids_ref / w_ref / rows_ref [Tp, Kp] (out); sorted_ref [M] (out, scattered);
    bexp_ref / brows_ref [NB] (out, NB <= NBp, stored masked). Every dim of a value here is a power of two.
    The routed weights are times `scaling`; `shared` experts (ids experts..experts + shared - 1) take the slots after
    the top_k routed ones, each weighted `shared_weight` ([Tp, 1] f32; None: 1)."""
    tp, ep = logits.shape
    kp = ids_ref.shape[1]
    e = lax.broadcasted_iota(jnp.int32, (tp, ep), 1)  # [Tp, Ep]
    slot = lax.broadcasted_iota(jnp.int32, (tp, kp), 1)  # [Tp, Kp]
    m = jnp.max(logits, axis=1, keepdims=True)
    p = jnp.exp(logits - m)
    p = p / jnp.sum(p, axis=1, keepdims=True)  # [Tp, Ep] softmax (padding experts: 0)

    # top-k: k rounds of arg-max (the lowest expert id among equal probabilities, as lax.top_k)
    cur = jnp.where(e < experts, p, -1.0)
    ids = jnp.zeros((tp, kp), jnp.int32)
    ws = jnp.zeros((tp, kp), jnp.float32)
    picked = []
    for j in range(top_k):
        mj = jnp.max(cur, axis=1, keepdims=True)  # [Tp, 1]
        ij = jnp.min(jnp.where(cur == mj, e, ep), axis=1, keepdims=True)  # [Tp, 1]
        ids = jnp.where(slot == j, ij, ids)
        ws = jnp.where(slot == j, mj, ws)
        cur = jnp.where(e == ij, -2.0, cur)
        picked.append(ij)
    if renormalize:
        ws = ws / jnp.sum(ws, axis=1, keepdims=True)
    if scaling != 1.0:
        ws = ws * scaling
    for s_ in range(shared):  # (after the renormalisation: it is over the routed weights only)
        ids = jnp.where(slot == top_k + s_, experts + s_, ids)
        ws = jnp.where(slot == top_k + s_, 1.0 if shared_weight is None else shared_weight, ws)
    ids_ref[...] = ids
    w_ref[...] = ws
    layout_body(picked, cur == -2.0, rows_ref, sorted_ref, bexp_ref, brows_ref, tokens=tokens, experts=experts,
                top_k=top_k + shared, block_m=block_m, shared=shared)


def layout_body(picked, chosen, rows_ref, sorted_ref, bexp_ref, brows_ref, *, tokens, experts, top_k, block_m,
                shared=0):
    """The grouped layout of chosen experts: picked, (top_k - shared) x [Tp, 1] int32 (slot j's routed expert of each
    token); chosen [Tp, Ep] bool (token t picked routed expert e; padding rows' values are masked here); top_k: the
    slots per token, the last `shared` of them the shared experts (experts + s, every token: `route_body`), whose
    cdiv(tokens, block_m) blocks each follow the routed experts' blocks. rows_ref [Tp, Kp] (out); the rest as
    route_body's."""
    tp, ep = chosen.shape
    kp = rows_ref.shape[1]
    nb = bexp_ref.shape[0]
    nbp = next_pow2(nb)
    t = lax.broadcasted_iota(jnp.int32, (tp, ep), 0)  # [Tp, Ep]
    e = lax.broadcasted_iota(jnp.int32, (tp, ep), 1)  # [Tp, Ep]
    slot = lax.broadcasted_iota(jnp.int32, (tp, kp), 1)  # [Tp, Kp]
    sel = (chosen & (t < tokens)).astype(jnp.int32)  # [Tp, Ep]: token t picked expert e

    # grouped layout: rank of token t among expert e's tokens, blocks of each expert, row of each pair
    counts = jnp.sum(sel, axis=0)  # [Ep]
    rank = jnp.cumsum(sel, axis=0) - sel  # [Tp, Ep]
    nblk = (counts + block_m - 1) // block_m  # [Ep]
    blk_end = jnp.cumsum(nblk)  # [Ep] inclusive
    blk_start = blk_end - nblk
    row = blk_start[None, :] * block_m + rank  # [Tp, Ep]
    rows = jnp.zeros((tp, kp), jnp.int32)
    t1 = lax.broadcasted_iota(jnp.int32, (tp, 1), 0)  # [Tp, 1]
    routed_blocks = jnp.sum(nblk)  # the shared experts' blocks start here, per_shared blocks each
    per_shared = pl.cdiv(tokens, block_m)
    shared_rows = [(routed_blocks + s_ * per_shared) * block_m + t1 for s_ in range(shared)]
    for j, ij in enumerate(picked + shared_rows):
        if j < len(picked):
            rj = jnp.sum(jnp.where(e == ij, row, 0), axis=1, keepdims=True)  # [Tp, 1]
        else:
            rj = ij  # a shared expert: token t's row of its blocks
        rows = jnp.where(slot == j, rj, rows)
        ok = t1 < tokens
        # padding tokens aim at the last row, which the layout never uses (see num_blocks)
        dest = jnp.where(ok, rj, sorted_ref.shape[0] - 1)[:, 0]
        plgpu.store(sorted_ref.at[dest], (t1 * top_k + j)[:, 0], mask=ok[:, 0])
    rows_ref[...] = rows

    b1 = lax.broadcasted_iota(jnp.int32, (nbp,), 0)
    used_blocks = routed_blocks + shared * per_shared
    # the shared experts' blocks [routed_blocks, used_blocks) (the general table below masks them, stored here)
    sb = b1 - routed_blocks
    in_shared = (sb >= 0) & (b1 < used_blocks) & (b1 < nb)
    if shared:
        plgpu.store(bexp_ref.at[pl.ds(0, nbp)], experts + sb // per_shared, mask=in_shared)
        plgpu.store(brows_ref.at[pl.ds(0, nbp)], jnp.clip(tokens - sb % per_shared * block_m, 0, block_m),
                    mask=in_shared)
    if tokens <= block_m:
        # every expert's rows fit one block (a token picks an expert once): expert e, when hit, owns block
        # blk_start[e], and the blocks from the used count on are unused. Scattered: [Ep] values, where the general
        # table below takes [NBp, Ep] tiles (at 8 tokens, 128 x 128: most of the program's time).
        hit_e = counts > 0  # [Ep]
        at = jnp.where(hit_e, blk_start, nb - 1)  # masked lanes aim at the spare last block, stored after
        plgpu.store(bexp_ref.at[at], lax.broadcasted_iota(jnp.int32, (ep,), 0), mask=hit_e)
        plgpu.store(brows_ref.at[at], counts, mask=hit_e)
        tail = (b1 >= used_blocks) & (b1 < nb)
        plgpu.store(bexp_ref.at[pl.ds(0, nbp)], jnp.full((nbp,), -1, jnp.int32), mask=tail)
        plgpu.store(brows_ref.at[pl.ds(0, nbp)], jnp.zeros((nbp,), jnp.int32), mask=tail)
        return
    # block table: block b belongs to the first expert whose blocks end after b
    b = lax.broadcasted_iota(jnp.int32, (nbp, ep), 0)  # [NBp, Ep]
    eb = jnp.sum((blk_end[None, :] <= b).astype(jnp.int32), axis=1, keepdims=True)  # [NBp, 1]
    hit = lax.broadcasted_iota(jnp.int32, (nbp, ep), 1) == eb
    cnt_b = jnp.sum(jnp.where(hit, counts[None, :], 0), axis=1, keepdims=True)
    start_b = jnp.sum(jnp.where(hit, blk_start[None, :], 0), axis=1, keepdims=True)
    b1 = b1[:, None]
    used = eb < experts
    keep = (b1[:, 0] < nb) & ~in_shared  # (outputs are exactly [NB]: a padded one cost a copy kernel to slice)
    plgpu.store(bexp_ref.at[pl.ds(0, nbp)], jnp.where(used, eb, -1)[:, 0], mask=keep)
    plgpu.store(brows_ref.at[pl.ds(0, nbp)], jnp.where(used, jnp.clip(cnt_b - (b1 - start_b) * block_m, 0, block_m),
                                                        0)[:, 0], mask=keep)


# ----------------------------------------------------------------------------------------------
# Wrapper
# ----------------------------------------------------------------------------------------------
def route_out_shapes(tokens: int, experts: int, top_k: int, block_m: int, shared: int = 0
                     ) -> list[jax.ShapeDtypeStruct]:
    """`route_body`'s outputs: ids, weights, rows [Tp, Kp] (powers of two; Kp >= top_k routed + shared slots), sorted
    pairs [M], block experts and block rows [NB]."""
    tp, kp = next_pow2(tokens), next_pow2(top_k + shared)
    nb = num_blocks(tokens * top_k, experts, block_m, tokens, shared)
    i32 = jnp.int32
    return [jax.ShapeDtypeStruct((tp, kp), i32), jax.ShapeDtypeStruct((tp, kp), jnp.float32),
            jax.ShapeDtypeStruct((tp, kp), i32), jax.ShapeDtypeStruct((nb * block_m,), i32),
            jax.ShapeDtypeStruct((nb,), i32), jax.ShapeDtypeStruct((nb,), i32)]


def routing_from_outputs(tokens: int, top_k: int, ids, ws, rows, sorted_pairs, bexp, brows) -> MoeRouting:
    """The `MoeRouting` of `route_body`'s outputs (the [Tp, Kp] ones cut to [tokens, top_k])."""
    if ids.shape != (tokens, top_k):
        ids, ws, rows = ids[:tokens, :top_k], ws[:tokens, :top_k], rows[:tokens, :top_k]
    return MoeRouting(ids, ws, rows, sorted_pairs, bexp, brows)


def _route_call(logits, top_k, renormalize, block_m, num_warps, interpret):
    tokens, experts = logits.shape
    tp, ep = next_pow2(tokens), next_pow2(experts)
    x = logits.astype(jnp.float32)
    if (tp, ep) != (tokens, experts):
        x = jnp.pad(x, ((0, tp - tokens), (0, ep - experts)), constant_values=-jnp.inf)
        x = x.at[tokens:].set(0.0)  # padding tokens: finite rows (never used)
    whole = pl.no_block_spec
    kernel = functools.partial(_route_kernel, tokens=tokens, experts=experts, top_k=top_k, block_m=block_m,
                               renormalize=renormalize)
    outs = pl.pallas_call(
        kernel,
        grid=(1,),
        in_specs=[whole],
        out_specs=[whole] * 6,
        out_shape=route_out_shapes(tokens, experts, top_k, block_m),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=f"moe_route_t{tp}_e{ep}_k{top_k}_m{block_m}",
    )(x)
    return routing_from_outputs(tokens, top_k, *outs)


def _place_call(topk_ids, topk_weights, experts, block_m, num_warps, interpret, shared):
    tokens, top_k = topk_ids.shape  # (top_k: the routed slots and the shared ones)
    shapes = route_out_shapes(tokens, experts, top_k - shared, block_m, shared)
    whole = pl.no_block_spec
    kernel = functools.partial(_place_kernel, tokens=tokens, experts=experts, top_k=top_k, block_m=block_m,
                               shared=shared)
    rows, *layout = pl.pallas_call(
        kernel,
        grid=(1,),
        in_specs=[whole],
        out_specs=[whole] * 4,
        out_shape=shapes[2:],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=f"moe_route_chosen_t{next_pow2(tokens)}_e{next_pow2(experts)}_k{top_k}_m{block_m}",
    )(topk_ids.reshape(-1))
    return MoeRouting(topk_ids, topk_weights.astype(jnp.float32), rows[:tokens, :top_k], *layout)


def check_route_args(experts: int, top_k: int, block_m: int) -> None:
    """ValueError unless 1 <= top_k <= experts and block_m is a power of two."""
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k={top_k} must be in [1, experts={experts}]")
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m={block_m} must be a power of two")


def _check_args(logits, top_k, block_m):
    if logits.ndim != 2:
        raise ValueError(f"logits must be [tokens, experts], got {logits.shape=}")
    check_route_args(logits.shape[1], top_k, block_m)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("top_k", "renormalize", "block_m", "num_warps", "interpret"))
def moe_route(logits: jax.Array, *, top_k: int, renormalize: bool = True, block_m: int = 16,
              num_warps: int | None = None, interpret: bool = False) -> MoeRouting:
    """Route tokens to their top-k experts and group the routed rows by expert.

    Args:
      logits: `[tokens, experts]` router logits (any float dtype; softmax runs in float32).
      top_k: experts per token.
      renormalize: divide the top-k weights by their sum (HF `norm_topk_prob`).
      block_m: rows per block of the grouped layout (power of two; the grouped GEMM's M tile).
      num_warps: Triton launch parameter (default by size).
      interpret: run the Pallas interpreter (CPU tests).

    Steps of more than `ROUTE_KERNEL_MAX_TOKENS` tokens use `moe_route_reference` (XLA).
    """
    _check_args(logits, top_k, block_m)
    if logits.shape[0] > ROUTE_KERNEL_MAX_TOKENS:
        return moe_route_reference(logits, top_k=top_k, renormalize=renormalize, block_m=block_m)
    if num_warps is None:
        num_warps = 4 if logits.shape[0] * logits.shape[1] <= 4096 else 8
    return _route_call(logits, top_k, renormalize, block_m, num_warps, interpret)


@functools.partial(jax.jit, static_argnames=("num_experts", "block_m", "shared", "num_warps", "interpret"))
def moe_route_chosen(topk_ids: jax.Array, topk_weights: jax.Array, *, num_experts: int, block_m: int = 16,
                     shared: int = 0, shared_weight: jax.Array | None = None, num_warps: int | None = None,
                     interpret: bool = False) -> MoeRouting:
    """Group the routed rows of experts already chosen (DeepSeek's group-limited routing,
    `jinfer.models.layers.grouped_topk_routing`) by expert: `moe_route`'s layout without its softmax and top-k.

    One Pallas program: `moe_route`'s with the softmax and the top-k rounds replaced by k gathers of the chosen ids
    (`layout_body` is the same code). A kernel rather than jnp, though not measured on its own: the jnp form
    (`moe_route_chosen_reference`) is the chain of small XLA kernels (scatters, cumsum, searchsorted) that
    `moe_route`'s program replaced at batch 1, and this program does a subset of that program's work.

    Args:
      topk_ids: `[tokens, k]` int32 experts in [0, num_experts), distinct within a token.
      topk_weights: `[tokens, k]` their routing weights (kept as they are, in float32).
      num_experts: the router's expert count.
      shared: shared experts stacked after the routed ones (ids num_experts..num_experts + shared - 1), chosen by
        every token: the routing gets them in k more slots, weighted `shared_weight` ([tokens] float32; None: 1).
      block_m, num_warps, interpret: as `moe_route`'s.

    Steps of more than `ROUTE_KERNEL_MAX_TOKENS` tokens use `moe_route_chosen_reference` (XLA).
    """
    if topk_ids.ndim != 2 or topk_weights.shape != topk_ids.shape or topk_ids.dtype != jnp.int32:
        raise ValueError(f"topk_ids must be int32 [tokens, k] and topk_weights the same shape: {topk_ids.shape=} "
                         f"{topk_ids.dtype=} {topk_weights.shape=}")
    check_route_args(num_experts, topk_ids.shape[1], block_m)
    tokens = topk_ids.shape[0]
    if tokens > ROUTE_KERNEL_MAX_TOKENS:
        return moe_route_chosen_reference(topk_ids, topk_weights, num_experts=num_experts, block_m=block_m,
                                          shared=shared, shared_weight=shared_weight)
    if num_warps is None:
        num_warps = 4 if tokens * num_experts <= 4096 else 8
    ids, weights = with_shared(topk_ids, topk_weights, num_experts, shared, shared_weight)
    return _place_call(ids, weights, num_experts, block_m, num_warps, interpret, shared)


def with_shared(topk_ids, topk_weights, num_experts: int, shared: int, shared_weight=None):
    """(ids, weights) [T, k + shared]: the routed ones, then the shared experts num_experts + s, weighted
    `shared_weight` [T] (None: 1)."""
    if not shared:
        return topk_ids, topk_weights
    tokens = topk_ids.shape[0]
    ids = jnp.broadcast_to(num_experts + jnp.arange(shared, dtype=jnp.int32), (tokens, shared))
    w = jnp.ones((tokens, 1), jnp.float32) if shared_weight is None else shared_weight.reshape(tokens, 1)
    return (jnp.concatenate([topk_ids, ids], axis=1),
            jnp.concatenate([topk_weights.astype(jnp.float32), jnp.broadcast_to(w.astype(jnp.float32),
                                                                                (tokens, shared))], axis=1))


def local_experts(routing: MoeRouting, first: jax.Array, count: int) -> tuple[MoeRouting, jax.Array]:
    """The part of a routing that runs on a device holding experts [first, first + count) (expert
    parallelism): other experts' blocks become unused (expert -1, 0 rows; the grouped GEMMs skip them)
    and block experts are renumbered to the device's local ids. Also returns the [T, k] mask of the
    pairs routed here: the other pairs' outputs are not written and must be masked out of the combine
    (`moe_gemm.moe_combine`)."""
    mine = (routing.topk_ids >= first) & (routing.topk_ids < first + count)  # [T, k]
    be = routing.block_expert
    here = (be >= first) & (be < first + count)
    return (MoeRouting(routing.topk_ids, routing.topk_weights, routing.pair_rows, routing.sorted_pairs,
                       jnp.where(here, be - first, -1), jnp.where(here, routing.block_rows, 0)), mine)


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------
def topk_routing(logits: jax.Array, top_k: int, renormalize: bool) -> tuple[jax.Array, jax.Array]:
    """HF's routing: (weights [T, k] float32, expert ids [T, k] int32)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("top_k", "renormalize", "block_m"))
def moe_route_reference(logits: jax.Array, *, top_k: int, renormalize: bool = True, block_m: int = 16
                        ) -> MoeRouting:
    """`moe_route` in jnp; rows of `sorted_pairs` past each block's valid rows are 0."""
    _check_args(logits, top_k, block_m)
    weights, ids = topk_routing(logits, top_k, renormalize)
    return _layout_reference(ids, weights, logits.shape[1], block_m)


@functools.partial(jax.jit, static_argnames=("num_experts", "block_m", "shared"))
def moe_route_chosen_reference(topk_ids: jax.Array, topk_weights: jax.Array, *, num_experts: int, block_m: int = 16,
                               shared: int = 0, shared_weight: jax.Array | None = None) -> MoeRouting:
    """`moe_route_chosen` in jnp (the shared experts laid out as any chosen ones, over num_experts + shared); rows of
    `sorted_pairs` past each block's valid rows are 0."""
    check_route_args(num_experts, topk_ids.shape[1], block_m)
    tokens, top_k = topk_ids.shape
    ids, weights = with_shared(topk_ids, topk_weights.astype(jnp.float32), num_experts, shared, shared_weight)
    return _layout_reference(ids, weights, num_experts + shared, block_m,
                             num_blocks(tokens * top_k, num_experts, block_m, tokens, shared))


def _layout_reference(ids, weights, experts, block_m, nb=None):
    tokens, top_k = ids.shape
    sel = jnp.zeros((tokens, experts), jnp.int32).at[jnp.arange(tokens)[:, None], ids].set(1)  # [T, E]
    counts = sel.sum(axis=0)  # [E]
    rank = jnp.cumsum(sel, axis=0) - sel  # [T, E]: token t's rank among expert e's tokens
    nblk = (counts + block_m - 1) // block_m
    blk_end = jnp.cumsum(nblk)
    blk_start = blk_end - nblk
    pair_rows = jnp.take_along_axis(blk_start[None, :] * block_m + rank, ids, axis=1)  # [T, k]
    nb = nb or num_blocks(tokens * top_k, experts, block_m)
    sorted_pairs = jnp.zeros(nb * block_m, jnp.int32).at[pair_rows.reshape(-1)].set(
        jnp.arange(tokens * top_k, dtype=jnp.int32))
    b = jnp.arange(nb, dtype=jnp.int32)
    eb = search_right(blk_end, b).astype(jnp.int32)  # [NB]
    used = eb < experts
    ebc = jnp.minimum(eb, experts - 1)
    block_rows = jnp.where(used, jnp.clip(counts[ebc] - (b - blk_start[ebc]) * block_m, 0, block_m), 0)
    return MoeRouting(ids, weights, pair_rows.astype(jnp.int32), sorted_pairs, jnp.where(used, eb, -1),
                      block_rows.astype(jnp.int32))

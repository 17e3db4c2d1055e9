"""Grouped GEMM for mixture-of-experts prefill, Mosaic GPU (Hopper: TMA + wgmma).

`out[r] = x[r] @ w[e]` (or SwiGLU's `silu(x[r] @ w[e]) * (x[r] @ w2[e])`) for every row r of the
expert-sorted layout, e the expert of r's block: rows come in blocks of `block_m`, each block
belongs to one expert (`block_expert[b]`, -1 for the unused blocks at the end), so the grouped GEMM
is a batch of [block_m, K] x [K, N] products with a per-block weight index; no block straddles two
experts (unlike `ops/gpu/ragged_dot_mgpu.py`, which has to split tiles at group boundaries).

Design (after JAX's `ops/gpu/hopper_matmul_mgpu.py` and our `prefill_attention_mgpu.py`):

- Work item = output tile (row block b, column tile n) of [block_m, block_n]. Items are numbered
  block-major, column tiles fastest (t = b * N / block_n + n), and dealt round-robin to a persistent
  grid of one CTA per SM (t = round * num_ctas + cta). So the ~num_ctas tiles in flight at any
  time cover a few consecutive blocks: the blocks of one expert read the same weight tiles at about
  the same time (a weight byte comes from HBM about once per expert, then from L2), and the column
  tiles of one block share its x rows in L2. That reuse is not optional: at Qwen3-30B-A3B's ~256
  routed rows per expert, a weight byte serves only 256 flops per byte (the H100's ratio is ~295),
  so 450 TFLOP/s needs ~1.8 TB/s of weights even when each is read once (gate|up: 805 MB of weights
  per call; down: 403 MB plus 168 MB of output at 4096 tokens: near the HBM bound).
- Three warpgroups per CTA. The memory warpgroup (24 registers) streams K steps of
  [block_m, block_k] x rows and [block_k, block_n] weight columns (two weight tiles, gate and up,
  when `w2` is given) with TMA into a ring of `max_steps` SMEM slots, reading each tile's expert as
  a scalar from GMEM (a round ahead). The ring runs on across tiles: while the compute warpgroups
  finish a tile (last wgmmas, epilogue, store), the next tile's first K steps are already landing.
  This matters for the down projection, whose K = 768 is only 12 steps of 64.
- Two compute warpgroups (240 registers) split the tile by rows (`wg_split="m"`: [block_m / 2,
  block_n] each, the default for block_m = 128; one weight tile feeds both, as CUTLASS' cooperative
  schedule) or by columns (`wg_split="n"`: [block_m, block_n / 2] each, needed for block_m = 64 since
  a warpgroup's wgmma takes 64-row multiples). Each K step is one wgmma per accumulator (gate and
  up: two), issued asynchronously; the slot of step k - 1 is released once `wgmma_wait` says its
  products are done, so one step's wgmmas always overlap the wait for the next step's data.
- Epilogue in fp32 registers: SwiGLU `silu(g) * u` when gated (silu through tanh.approx, one MUFU
  op per element: the tensor cores idle during the epilogue), one cast, then an SMEM staging buffer
  per warpgroup and a TMA store. The store of tile i overlaps tile i + 1's K loop; the staging
  buffer is only rewritten once that store has read it.
- Unused blocks (block_expert < 0) cost a scalar read per item: no loads, no wgmma, no store.
- Padding: each expert's rows are padded to block_m, and the tensor cores compute the padding too.
  With uniform routing at 4096 tokens x top-8 (~256 +- 16 rows per expert), 128-row blocks hold
  ~40300 rows for 32768 routed ones (19% waste; 10% at 64-row blocks). The optional `block_rows`
  (valid rows per block, which the routing has: `MoeRouting.block_rows`) lets a warpgroup whose
  64 rows of a block are all padding skip its wgmmas and store (it still steps through the ring's
  barriers): 64-row padding granularity at the 128-row tile's efficiency.

SMEM per CTA: max_steps x (A [block_m, block_k] + one or two B [block_k, block_n]) + the
[block_m, block_n] output staging, within the 227 KB of an H100 SM (checked in the wrapper;
`smem_bytes`). Defaults (`default_config`; reasoned, not yet measured: `bench_moe gemm_mgpu --sweep` measures the
alternatives): gate|up (SwiGLU, N = I = 768) 128 x 128 tiles with a 4-slot ring (224 KB; two
[64, 128] fp32 accumulators per warpgroup = 128 registers per thread); down (N = 2048) 128 x 256
tiles with 3 slots (208 KB; one [64, 256] accumulator per warpgroup, the m64n256k16 wgmma). Both
move 48 KB per K step for 4.2 MFLOP, like CUTLASS' 128 x 256 x 64 tile.

Refs (GMEM): `be_ref [num_blocks] int32`, `br_ref [num_blocks] int32` (block_rows, optional),
`x_ref [M, K]`, `w_refs`: `w [E, K, N]` (and `w2 [E, K, N]`), `out_ref [M, N]`. SMEM:
`a_smem [max_steps, a_parts, block_m / a_parts, block_k]`, per weight
`b_smem [max_steps, b_parts, block_k, block_n / b_parts]` (a_parts = 2 when the warpgroups split
rows, b_parts = 2 when they split columns: each warpgroup indexes its own part on the leading axis,
never a dynamic slice of a tiled axis; the memory warpgroup loads the parts with separate copies),
`o_smem [2, rows per warpgroup, columns per warpgroup]`. All SMEM tiles use the (8, 64) tiling with
the 128-byte swizzle wgmma wants (block_k = 64 bf16 is one swizzle row). Mosaic GPU's TMA
addresses GMEM in whole 8-row tiles: every row offset here is a provable multiple of 64.

Not done (candidates if a profile shows them): a ping-pong schedule (each compute warpgroup its own
tile, one's epilogue under the other's wgmmas: the cooperative schedule leaves the tensor cores
idle for the epilogue, a few % of a 12-step down tile); TMA multicast of a weight tile to a
2-CTA cluster working on two blocks of one expert; skipping the x loads of all-padding halves.

Interpret mode (CPU): jax 0.11.2's Mosaic GPU interpreter runs the same code (both wgmma operands
come from SMEM here anyway; its wgmma is synchronous, so `wgmma_wait` is a no-op there; every
warpgroup observes every phase of the barriers it uses, as it requires). A CPU test lowers the GPU
path for CUDA with `jax.export` at the real shapes: Mosaic GPU's layout inference, TMA legality and
the SMEM budget are checked there, register allocation and timing only on the GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

COMPUTE_WGS = 2
SMEM_BYTES = 227 * 1024  # per CTA on Hopper
_H100_SMS = 132  # CTAs when lowering for CUDA on a machine without a GPU
# fp32 accumulator registers per compute thread: 128 of its 240 (the m64n256 wgmma's, or two m64n128's);
# more leaves too little for addresses and the epilogue (ptxas would spill).
MAX_ACC_REGISTERS = 128


# ----------------------------------------------------------------------------------------------
# Kernel body
# ----------------------------------------------------------------------------------------------
def _kernel(be_ref, br_ref, x_ref, w_refs, out_ref, scoped, *, block_m, block_n, block_k, max_steps, num_ctas,
            num_rounds, wg_split):
    # be_ref [NB] int32 (GMEM), br_ref [NB] int32 or None, x_ref [M, K], w_refs: (w [E, K, N],) or
    # (w_gate, w_up), out_ref [M, N]
    (a_smem, b_smems, o_smem), ready, free = scoped
    # a_smem [S, a_parts, bm / a_parts, bk]; b_smems: per weight [S, b_parts, bk, bn / b_parts];
    # o_smem [COMPUTE_WGS, wg_m, wg_n]; ready / free [S] barriers
    num_blocks = be_ref.shape[0]
    k_steps = x_ref.shape[1] // block_k
    num_n = out_ref.shape[1] // block_n
    num_tiles = num_blocks * num_n
    a_parts = COMPUTE_WGS if wg_split == "m" else 1
    b_parts = COMPUTE_WGS if wg_split == "n" else 1
    a_rows, b_cols = block_m // a_parts, block_n // b_parts  # per TMA copy
    wg_m, wg_n = o_smem.shape[1], o_smem.shape[2]  # one compute warpgroup's share of the tile
    dtype = out_ref.dtype
    gated = len(w_refs) == 2
    wg = lax.axis_index("wg")
    cta = lax.axis_index("ctas")

    def coords(r):
        """The CTA's r-th item: (row block, column tile); items past the last are clamped to it."""
        t = jnp.minimum(r * num_ctas + cta, num_tiles - 1)
        return lax.div(t, jnp.int32(num_n)), lax.rem(t, jnp.int32(num_n))

    def expert_of(r):
        """The expert of the CTA's r-th item, -1 for an unused block or an item past the last. The
        loops read it at the start of the item before (a GMEM scalar load whose latency then stays off
        the critical path) and carry it."""
        b, _ = coords(r)
        return jnp.where(r * num_ctas + cta < num_tiles, be_ref[b], -1)

    def rows_of(r):
        """The valid rows of the CTA's r-th item's block (block_m without block_rows)."""
        return br_ref[coords(r)[0]] if br_ref is not None else jnp.int32(block_m)

    def slot_of(g):
        return lax.rem(g, jnp.int32(max_steps))

    @pl.when(wg < COMPUTE_WGS)
    def _compute_wg():
        plgpu.set_max_registers(240, action="increase")
        a_part = wg if a_parts > 1 else 0
        b_part = wg if b_parts > 1 else 0

        def tile(r, carry):  # g0: K steps of the CTA's earlier items (the ring position)
            g0, expert, rows = carry
            next_block = expert_of(r + 1), rows_of(r + 1)
            b, n = coords(r)
            valid = expert >= 0
            # With block_rows, a warpgroup whose rows of the block are all padding skips its wgmmas and
            # its store (the other one then has the tensor cores to itself).
            mine = valid & (rows > wg * wg_m) if br_ref is not None and a_parts > 1 else valid

            @pl.when(mine)
            def _():
                def k_loop(*acc_refs):
                    def step(k, _):
                        slot = slot_of(g0 + k)
                        plgpu.barrier_wait(ready.at[slot])
                        for acc_ref, b_smem in zip(acc_refs, b_smems):
                            plgpu.wgmma(acc_ref, a_smem.at[slot, a_part], b_smem.at[slot, b_part])
                        plgpu.wgmma_wait(len(acc_refs))  # step k - 1's products are done: free its slot

                        @pl.when(k > 0)
                        def _():
                            plgpu.barrier_arrive(free.at[slot_of(g0 + k - 1)])

                    lax.fori_loop(0, k_steps, step, None)
                    plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(free.at[slot_of(g0 + k_steps - 1)])
                    return tuple(acc_ref[...] for acc_ref in acc_refs)

                accs = pl.run_scoped(k_loop, *[plgpu.ACC((wg_m, wg_n), jnp.float32)] * len(b_smems))
                if gated:
                    g, u = accs  # [wg_m, wg_n] fp32 each
                    # silu(g) * u with sigmoid(g) = (1 + tanh(g / 2)) / 2: one MUFU op per element
                    # (tanh.approx) where exp + reciprocal take two; the tensor cores idle meanwhile.
                    hg = 0.5 * g
                    y = (hg + hg * jnp.tanh(hg)) * u
                else:
                    (y,) = accs
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous item's store has read o_smem
                o_smem.at[wg][...] = y.astype(dtype)
                plgpu.commit_smem()
                row0 = b * block_m + (wg * wg_m if a_parts > 1 else 0)
                col0 = n * block_n + (wg * wg_n if b_parts > 1 else 0)
                plgpu.copy_smem_to_gmem(
                    o_smem.at[wg],
                    out_ref.at[pl.ds(pl.multiple_of(row0, wg_m), wg_m), pl.ds(pl.multiple_of(col0, wg_n), wg_n)])

            if br_ref is not None and a_parts > 1:
                @pl.when(valid & ~mine)
                def _():
                    @pl.loop(0, k_steps)
                    def _(k):  # observe every phase of the ring's barriers, release each slot at once
                        slot = slot_of(g0 + k)
                        plgpu.barrier_wait(ready.at[slot])
                        plgpu.barrier_arrive(free.at[slot])

            return g0 + jnp.where(valid, k_steps, 0), *next_block

        lax.fori_loop(0, num_rounds, tile, (jnp.int32(0), expert_of(0), rows_of(0)))
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WGS)
    def _memory_wg():
        plgpu.set_max_registers(24, action="decrease")  # TMA issue only (2 x 240 + 24 fill the 64K)

        def tile(r, carry):
            g0, expert = carry
            next_expert = expert_of(r + 1)
            b, n = coords(r)
            valid = expert >= 0

            @pl.when(valid)
            def _():
                @pl.loop(0, k_steps)
                def _(k):
                    g = g0 + k  # the CTA's K-step count: ring slot and refill waits run across items
                    slot = slot_of(g)
                    pl.when(g >= max_steps)(lambda: plgpu.barrier_wait(free.at[slot]))
                    ks = pl.ds(pl.multiple_of(k * block_k, block_k), block_k)
                    for p in range(a_parts):
                        rows = pl.ds(pl.multiple_of(b * block_m + p * a_rows, a_rows), a_rows)
                        plgpu.copy_gmem_to_smem(x_ref.at[rows, ks], a_smem.at[slot, p], ready.at[slot])
                    for w_ref, b_smem in zip(w_refs, b_smems):
                        for p in range(b_parts):
                            cols = pl.ds(pl.multiple_of(n * block_n + p * b_cols, b_cols), b_cols)
                            plgpu.copy_gmem_to_smem(w_ref.at[expert, ks, cols], b_smem.at[slot, p], ready.at[slot])

            return g0 + jnp.where(valid, k_steps, 0), next_expert

        total, _ = lax.fori_loop(0, num_rounds, tile, (jnp.int32(0), expert_of(0)))

        @pl.loop(jnp.maximum(total - max_steps, 0), total)
        def _(g):  # the last release of each slot (nothing to refill): every phase is observed
            plgpu.barrier_wait(free.at[slot_of(g)])


# ----------------------------------------------------------------------------------------------
# Wrapper: tiles, SMEM, barriers
# ----------------------------------------------------------------------------------------------
def _num_sms(interpret: bool) -> int:
    """CTAs of the persistent grid: the GPU's SM count (a few under the CPU interpreter; an H100's
    132 when lowering for CUDA on a machine without a GPU, or the abstract device's count)."""
    if interpret:
        return 4
    abstract = jax.sharding.get_abstract_mesh().abstract_device
    if abstract is not None and getattr(abstract, "num_cores", None):
        return abstract.num_cores
    device = jax.devices()[0]
    return device.core_count if device.platform == "gpu" else _H100_SMS


def smem_bytes(block_m: int, block_n: int, block_k: int, max_steps: int, num_weights: int, itemsize: int = 2) -> int:
    """SMEM the kernel allocates: the K-step ring and the output staging (barriers: a few bytes)."""
    ring = max_steps * (block_m * block_k + num_weights * block_k * block_n) * itemsize
    return ring + block_m * block_n * itemsize


def _acc_registers(block_m: int, block_n: int, num_weights: int) -> int:
    """fp32 accumulator registers per thread of a compute warpgroup (128 threads)."""
    return num_weights * block_m * block_n // COMPUTE_WGS // 128


def _fit_steps(block_m: int, block_n: int, block_k: int, num_weights: int, itemsize: int = 2) -> int:
    """The deepest K-step ring (2..6 slots) that fits the SMEM with the output staging."""
    steps = 2
    while steps < 6 and smem_bytes(block_m, block_n, block_k, steps + 1, num_weights, itemsize) <= SMEM_BYTES:
        steps += 1
    return steps


def default_config(n: int, gated: bool, block_m: int = 128) -> dict:
    """block_n, block_k, max_steps, wg_split for N output columns (see the module docstring): tiles
    of 128 x 256 products per K step (the gated 128 x 128 tile runs two weight tiles), i.e. 128 fp32
    accumulator registers per compute thread, and the deepest ring that fits."""
    wg_split = "m" if block_m % 128 == 0 else "n"
    block_n = max(64, min(256, 128 * 256 // (block_m * (2 if gated else 1))))
    while block_n > 64 and n % block_n:
        block_n //= 2
    block_k = 64
    max_steps = _fit_steps(block_m, block_n, block_k, 2 if gated else 1)
    return dict(block_n=block_n, block_k=block_k, max_steps=max_steps, wg_split=wg_split)


def _mgpu_call(x, w_refs_args, block_expert, block_rows, *, block_m, block_n, block_k, max_steps, wg_split, num_ctas,
               interpret):
    m, _ = x.shape
    n = w_refs_args[0].shape[2]
    num_blocks = block_expert.shape[0]
    num_tiles = num_blocks * (n // block_n)
    num_ctas = max(1, min(num_ctas or _num_sms(interpret), num_tiles))
    num_rounds = pl.cdiv(num_tiles, num_ctas)
    dtype = x.dtype
    a_parts = COMPUTE_WGS if wg_split == "m" else 1
    b_parts = COMPUTE_WGS if wg_split == "n" else 1
    wg_m, wg_n = block_m // a_parts, block_n // b_parts
    copies = a_parts + len(w_refs_args) * b_parts  # TMA copies (barrier arrivals) per K step

    def entry(be_ref, *refs):
        if block_rows is not None:
            br_ref, x_ref, *w_refs, out_ref = refs
        else:
            br_ref, (x_ref, *w_refs, out_ref) = None, refs

        def tiled(cols):
            swizzle = plgpu.find_swizzle(cols * jnp.dtype(dtype).itemsize * 8)
            return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))

        smem = (
            plgpu.SMEM((max_steps, a_parts, block_m // a_parts, block_k), dtype, transforms=tiled(block_k)),
            tuple(plgpu.SMEM((max_steps, b_parts, block_k, block_n // b_parts), dtype,
                             transforms=tiled(block_n // b_parts)) for _ in w_refs),
            plgpu.SMEM((COMPUTE_WGS, wg_m, wg_n), dtype, transforms=tiled(wg_n)),
        )
        pl.run_scoped(
            lambda *scoped: _kernel(be_ref, br_ref, x_ref, tuple(w_refs), out_ref, scoped, block_m=block_m,
                                    block_n=block_n, block_k=block_k, max_steps=max_steps, num_ctas=num_ctas,
                                    num_rounds=num_rounds, wg_split=wg_split),
            smem,
            plgpu.Barrier(num_arrivals=copies, num_barriers=max_steps),  # slot filled
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=max_steps),  # slot free
            collective_axes="wg",
        )

    gated = len(w_refs_args) == 2
    return plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((m, n), dtype),
        grid=(num_ctas,),
        grid_names=("ctas",),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name=f"moe_{'gate_up' if gated else 'gemm'}_m{block_m}_n{block_n}_k{block_k}_s{max_steps}_{wg_split}",
    )(block_expert, *(() if block_rows is None else (block_rows,)), x, *w_refs_args)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------
def check_supported(x, w, w2=None, *, block_m: int = 128, block_n: int | None = None,
                    block_k: int | None = None, wg_split: str | None = None) -> str | None:
    """Why this kernel cannot take these shapes (None when it can)."""
    m, k = x.shape
    n = w.shape[-1]
    cfg = default_config(n, w2 is not None, block_m)
    block_n, block_k, wg_split = block_n or cfg["block_n"], block_k or cfg["block_k"], wg_split or cfg["wg_split"]
    if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) or w.dtype != x.dtype:
        return f"dtype x {x.dtype} / w {w.dtype} (bf16 or fp16, the same for both)"
    if block_m % 64 or (wg_split == "m" and block_m % 128):
        return f"block_m {block_m} (a multiple of 64; of 128 when the warpgroups split rows)"
    if m % block_m:
        return f"rows {m} (a multiple of block_m {block_m})"
    if block_k % 64 or k % block_k:
        return f"K {k} (a multiple of block_k {block_k}, itself a multiple of 64)"
    if block_n % 64 or (wg_split == "n" and block_n % 128) or n % block_n:
        return f"N {n} (a multiple of block_n {block_n}, itself a multiple of 64; of 128 when the warpgroups " \
               f"split columns)"
    return None


def _check_args(x, w, block_expert, w2, block_rows, block_m, max_steps, num_ctas, wg_split):
    if x.ndim != 2:
        raise ValueError(f"x must be [rows, K], got {x.shape=}")
    if w.ndim != 3 or w.shape[1] != x.shape[1]:
        raise ValueError(f"w must be [experts, K, N] with K = x.shape[1] = {x.shape[1]}, got {w.shape=}")
    if w2 is not None and (w2.shape != w.shape or w2.dtype != w.dtype):
        raise ValueError(f"w2 must match w ({w.shape} {w.dtype}), got {w2.shape=} {w2.dtype=}")
    if block_m < 64 or block_m % 64:
        raise ValueError(f"block_m must be a multiple of 64, got {block_m=}")
    if block_expert.ndim != 1 or block_expert.shape[0] * block_m != x.shape[0]:
        raise ValueError(f"block_expert must be [rows // block_m] = [{x.shape[0] // block_m}], "
                         f"got {block_expert.shape=} ({x.shape[0]} rows, {block_m=})")
    if block_expert.dtype != jnp.int32:
        raise ValueError(f"block_expert must be int32, got {block_expert.dtype=}")
    if block_rows is not None and (block_rows.shape != block_expert.shape or block_rows.dtype != jnp.int32):
        raise ValueError(f"block_rows must be int32 like block_expert {block_expert.shape}, got {block_rows.shape=} "
                         f"{block_rows.dtype=}")
    if max_steps is not None and max_steps < 2:
        raise ValueError(f"max_steps (K-step ring depth) must be >= 2, got {max_steps=}")
    if num_ctas is not None and num_ctas < 1:
        raise ValueError(f"num_ctas must be >= 1 or None (one per SM), got {num_ctas=}")
    if wg_split not in (None, "m", "n"):
        raise ValueError(f"wg_split must be 'm' (warpgroups split rows) or 'n' (columns), got {wg_split=}")


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "max_steps", "wg_split", "num_ctas",
                                             "interpret"))
def moe_grouped_matmul_mgpu(
    x: jax.Array,
    w: jax.Array,
    block_expert: jax.Array,
    w2: jax.Array | None = None,
    *,
    block_m: int = 128,
    block_rows: jax.Array | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    max_steps: int | None = None,
    wg_split: str | None = None,
    num_ctas: int | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Grouped GEMM over expert-sorted rows: `x[r] @ w[e]`, or `silu(x[r] @ w[e]) * (x[r] @ w2[e])`.

    Args:
      x: `[M, K]` (bf16/fp16) rows sorted by expert, each expert's segment padded to a multiple of
        `block_m`.
      w: `[E, K, N]` per-expert weights, `[in, out]` (the gate weights when `w2` is given).
      block_expert: `[M // block_m]` int32, the expert of each block of `block_m` rows; -1 marks an
        unused block (all of them after the used ones).
      w2: `[E, K, N]` up weights: the output is then SwiGLU's `silu(gate) * up`, computed in fp32.
      block_m: rows per block (the routing's padding unit), a multiple of 64 (128 when the
        warpgroups split rows).
      block_rows: optional `[M // block_m]` int32, the valid (routed) rows of each block, the rest
        being padding (`MoeRouting.block_rows`). With the warpgroups splitting rows, a warpgroup
        whose half of a block is all padding then skips its wgmmas and store: at block_m = 128 the
        padding computed drops to what 64-row blocks would have (about half), at 128-row tiles.
      block_n, block_k: output columns per tile and K per ring step (multiples of 64); default per
        `default_config`.
      max_steps: K-step ring depth (>= 2); default the most that fits the SMEM (at most 6).
      wg_split: "m" (the two compute warpgroups split the tile's rows; default for block_m >= 128)
        or "n" (its columns; default for block_m = 64).
      num_ctas: persistent CTAs; default the GPU's SM count.
      interpret: run the Mosaic GPU interpreter (CPU tests).

    Returns:
      `[M, N]` in x's dtype (fp32 accumulation, one cast); rows of unused blocks (and, with
      `block_rows`, padding rows) are unspecified.
    """
    _check_args(x, w, block_expert, w2, block_rows, block_m, max_steps, num_ctas, wg_split)
    cfg = default_config(w.shape[2], w2 is not None, block_m)
    block_n, block_k = block_n or cfg["block_n"], block_k or cfg["block_k"]
    wg_split = wg_split or cfg["wg_split"]
    if (why := check_supported(x, w, w2, block_m=block_m, block_n=block_n, block_k=block_k,
                               wg_split=wg_split)) is not None:
        raise ValueError(f"moe_grouped_matmul_mgpu does not support {why}")
    weights = (w,) if w2 is None else (w, w2)
    if (regs := _acc_registers(block_m, block_n, len(weights))) > MAX_ACC_REGISTERS:
        raise ValueError(f"{len(weights)} accumulator(s) of a {block_m} x {block_n} tile split by {wg_split=} need "
                         f"{regs} registers per thread (at most {MAX_ACC_REGISTERS}): lower block_n")
    max_steps = max_steps or _fit_steps(block_m, block_n, block_k, len(weights), x.dtype.itemsize)
    need = smem_bytes(block_m, block_n, block_k, max_steps, len(weights), x.dtype.itemsize)
    if need > SMEM_BYTES:
        raise ValueError(f"a K-step ring of {max_steps=} x ({block_m=}, {block_k=}, {len(weights)} x {block_n=}) "
                         f"and the output staging need {need // 1024} KiB of SMEM (at most {SMEM_BYTES // 1024})")
    return _mgpu_call(x, weights, block_expert, block_rows, block_m=block_m, block_n=block_n, block_k=block_k,
                      max_steps=max_steps, wg_split=wg_split, num_ctas=num_ctas, interpret=interpret)


def moe_experts_mgpu(x: jax.Array, routing, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array, *,
                     mine: jax.Array | None = None, interpret: bool = False) -> jax.Array:
    """The whole expert MLP on this kernel: `x` [T, hidden] and a `moe_routing.MoeRouting` -> [T, hidden].

    TMA wants each expert's rows contiguous, so x's rows are gathered into the grouped layout first (XLA),
    and the down projection's rows are gathered back per (token, slot), weighted and summed over the k
    slots (`moe_gemm.moe_combine`). The routing's block size is this kernel's block_m; its `block_rows`
    let all-padding half blocks skip their wgmmas. `mine` [T, k]: the pairs whose experts are here
    (expert parallelism, `moe_routing.local_experts`); the others are left out of the sum.
    """
    from pallas_kernels.moe.moe_gemm import moe_combine

    bm, top_k = routing.block_m, routing.top_k
    m = routing.sorted_pairs.shape[0]
    valid = jnp.arange(m, dtype=jnp.int32) % bm < jnp.repeat(routing.block_rows, bm, total_repeat_length=m)
    xs = x[jnp.where(valid, routing.sorted_pairs // top_k, 0)]  # [M, hidden] expert-sorted rows
    kw = dict(block_m=bm, block_rows=routing.block_rows, interpret=interpret)
    act = moe_grouped_matmul_mgpu(xs, w_gate, routing.block_expert, w_up, **kw)  # [M, I]
    ys = moe_grouped_matmul_mgpu(act, w_down, routing.block_expert, **kw)  # [M, hidden]
    y = ys[routing.pair_rows.reshape(-1)] * routing.topk_weights.reshape(-1, 1).astype(ys.dtype)  # [T*k, hidden]
    return moe_combine(y, top_k, x.dtype, mine)


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("block_m",))
def moe_grouped_matmul_reference(x, w, block_expert, w2=None, *, block_m: int):
    """Per-block jnp: each block of rows times its expert's weights (fp32 accumulation, one cast at
    the end); rows of unused blocks are zeros. Gathers a weight matrix per block: for tests and
    subsets of blocks, not for full-size layouts."""
    nb = block_expert.shape[0]
    xb = x.reshape(nb, block_m, x.shape[1])
    e = jnp.maximum(block_expert, 0)
    y = jnp.einsum("bmk,bkn->bmn", xb, w[e], preferred_element_type=jnp.float32)
    if w2 is not None:
        u = jnp.einsum("bmk,bkn->bmn", xb, w2[e], preferred_element_type=jnp.float32)
        y = jax.nn.silu(y) * u
    y = jnp.where((block_expert >= 0)[:, None, None], y, 0.0)
    return y.reshape(x.shape[0], -1).astype(x.dtype)

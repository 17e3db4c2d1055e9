"""A decode step's o projection and MLP block as one dataflow launch: the persistent-kernel pattern.

Between two kernels of a CUDA graph the GPU drains: the last programs of one finish, the next launch's programs
start, and their first weight loads wait a DRAM latency before anything streams. At batch 1 a Qwen3-4B layer has
seven such boundaries for ~69 us of weight bytes. A persistent kernel keeps streaming across them: the programs
of the next op are already resident, their first weight tiles in flight, while the previous op's last programs
finish. Pallas has no grid-wide barrier, but it has atomics, and that is enough for a dataflow grid where each
program waits only on programs that started before it:

- each program draws a virtual id from an atomic counter when it starts (never its block index: the hardware does
  not promise to start blocks in index order), so every lower id belongs to a program already running, and
  waiting on lower ids cannot deadlock;
- ids [0, P_o) are the o projection's programs: one `o_block_n`-column tile of `residual + attn @ wo` each, the
  whole K range (no split-K to sum), stored as the new residual stream x1, then one atomic increment of the
  phase counter (after a CTA barrier: every thread's stores first);
- ids [P_o, P_o + I / block_i) are the fused MLP's programs (`fused_mlp._mlp_kernel`'s layout: one
  intermediate block each, gate|up then down, fp32 partials): each issues the loads of its first `preload`
  gate|up weight tiles, then spins on the phase counter until every o program has counted in, then reads x1
  past L1 (volatile), norms it and runs the rest. XLA sums the partials and adds x1, as after the fused MLP;
- the last program to finish (a third counter) resets the three counters to zero for the next launch.

With `slot` (a layer's own entry of the step's counters, zeroed once per step) the launch skips both the id
ticket and the reset: ids are the block indices and the phase count is left in the slot. The hardware starts
blocks in index order, and even where it did not, the waiting programs fill fewer SMs than the GPU has
(`max_waiting`: the device's SMs less 12), so the o programs always find SMs: no deadlock either way.

In the Pallas interpreter programs run one after another in grid order: the ids are the grid order and the o
programs have all counted in before the first MLP program starts, so there is no spin (the interpreter cannot
discharge an atomic inside a while loop either).

Counters: the step's (`ModelOps.step_counters`), zero on entry, left zero (`COUNTERS` of them).

Numerics: x1 is XLA's `residual + (attn @ wo).astype(bf16)` (split_k.residual_add), the MLP `fused_mlp`'s.

GPU backend: the Pallas Triton lowering (see `pallas_kernels/__init__.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.dense.fused_mlp import pow2_divisor, rms_inverse, rms_normed, tile_rows
from pallas_kernels.split_k import check_counters, residual_add, take_ticket

MAX_TOKENS = 16  # one 16-row token tile
COUNTERS = 3  # virtual ids, o programs done, programs done
_VID, _O_DONE, _DONE = 0, 1, 2  # (made arrays where used: the interpreter's atomics want array indices)


def max_waiting() -> int:
    """MLP programs a `slot` launch may have: they wait on the o programs, so they must leave SMs free (the device's
    SMs less 12; an H100's 132 where the device does not say)."""
    return (getattr(jax.devices()[0], "core_count", None) or 132) - 12


def _kernel(attn_ref, wo_ref, r_ref, n_ref, wg_ref, wu_ref, wd_ref, _cnt_in, x1_ref, cnt_ref, part_ref, *,
            o_programs: int, mlp_programs: int, block_t: int, o_block_n: int, o_block_k: int, block_k: int,
            block_i: int, block_n: int, preload: int, eps: float, interpret: bool, slot: int | None):
    # attn_ref [T, Ko]; wo_ref [Ko, hidden]; r_ref [T, hidden] the residual; n_ref [hidden] the MLP's norm; wg/wu
    # [hidden, I]; wd [I, hidden]; cnt_ref int32 [>= COUNTERS]; x1_ref [T, hidden] out; part_ref [I / block_i, T,
    # hidden] fp32 out. All whole: a program picks its tiles by its virtual id.
    hidden = r_ref.shape[1]
    f32 = jnp.float32
    rows, real, residual_cols = tile_rows(r_ref, 0, block_t)  # one tile: the whole step

    def row_mask(width):
        return jnp.broadcast_to(real[:, None], (block_t, width))

    phase = jnp.int32(_O_DONE if slot is None else slot)
    if slot is None:
        vid = plgpu.atomic_add(cnt_ref, jnp.int32(_VID), jnp.ones((), jnp.int32))
    else:
        vid = pl.program_id(0)

    @pl.when(vid < o_programs)
    def _o():
        cols = pl.ds(vid * o_block_n, o_block_n)

        def body(kk, acc):
            ks = pl.ds(kk * o_block_k, o_block_k)
            a = plgpu.load(attn_ref.at[rows, ks], mask=row_mask(o_block_k), other=0)
            return acc + plgpu.dot(a, wo_ref[ks, cols])

        acc = jax.lax.fori_loop(0, attn_ref.shape[1] // o_block_k, body, jnp.zeros((block_t, o_block_n), f32))
        plgpu.store(x1_ref.at[rows, cols], residual_add(residual_cols(cols, o_block_n), acc), mask=row_mask(o_block_n))
        take_ticket(cnt_ref, phase, interpret)

    @pl.when(vid >= o_programs)
    def _mlp():
        i = vid - o_programs
        icols = pl.ds(i * block_i, block_i)
        # this program's first weight tiles, in flight while it waits (they do not depend on x1)
        first = [(wg_ref[pl.ds(k * block_k, block_k), icols], wu_ref[pl.ds(k * block_k, block_k), icols])
                 for k in range(preload)]
        ready = jnp.bool_(True)  # (interpreted, every lower id has run to completion: nothing to wait for)
        if not interpret:
            # poll with plain loads past L1 (no read-modify-write traffic on the counter's L2 line), then one
            # acquiring atomic orders this program's reads of x1 after the o programs' stores. The x1 loads' masks
            # take the loop's result: a spin whose result is unused is dead code to JAX (it was removed), and
            # the dependency keeps the compiler from hoisting the loads above it.
            count = cnt_ref.at[phase]
            done = jax.lax.while_loop(lambda done: done < o_programs, lambda _: plgpu.load(count, volatile=True),
                                      jnp.int32(0))
            done = jnp.maximum(done, plgpu.atomic_add(cnt_ref, phase, jnp.zeros((), jnp.int32)))
            ready = done >= o_programs

        def x_cols(cols, width, volatile=False):
            # x1 was written by other programs of this launch; this SM's L1 holds none of it (its first read,
            # the norm's pass, goes past L1), so the K loop's reads may be plain (pipelined) loads
            return plgpu.load(x1_ref.at[rows, cols], mask=row_mask(width) & ready, other=0, volatile=volatile)

        inv = rms_inverse(functools.partial(x_cols, volatile=True), hidden, block_t, block_k, eps)

        def up(kk, g, u, wg, wu):
            cols = pl.ds(kk * block_k, block_k)
            xk = rms_normed(x_cols(cols, block_k), inv, n_ref[cols])
            return g + plgpu.dot(xk, wg), u + plgpu.dot(xk, wu)

        g = u = jnp.zeros((block_t, block_i), f32)
        for k, (wg, wu) in enumerate(first):
            g, u = up(k, g, u, wg, wu)

        def up_body(kk, carry):
            ks = pl.ds(kk * block_k, block_k)
            return up(kk, *carry, wg_ref[ks, icols], wu_ref[ks, icols])

        g, u = jax.lax.fori_loop(preload, hidden // block_k, up_body, (g, u))
        h = (g * jax.nn.sigmoid(g) * u).astype(wd_ref.dtype)  # [block_t, block_i]

        def down_body(n, _):
            cols = pl.ds(n * block_n, block_n)
            plgpu.store(part_ref.at[i, rows, cols], plgpu.dot(h, wd_ref[icols, cols]), mask=row_mask(block_n))
            return 0

        jax.lax.fori_loop(0, hidden // block_n, down_body, 0)

    if slot is not None:
        return
    done = take_ticket(cnt_ref, jnp.int32(_DONE), interpret)

    @pl.when(done == o_programs + mlp_programs - 1)
    def _reset():  # every program has drawn its id and stopped waiting: leave the counters zero
        cnt_ref[_VID] = 0
        cnt_ref[_O_DONE] = 0
        cnt_ref[_DONE] = 0


def check_supported(tokens: int, ko: int, hidden: int, inter: int) -> str | None:
    """Why `o_proj_mlp_block` cannot take these shapes, or None."""
    if not 1 <= tokens <= MAX_TOKENS:
        return f"{tokens} tokens (1..{MAX_TOKENS})"
    for name, size in (("o input", ko), ("hidden", hidden), ("intermediate", inter)):
        if size % 64:
            return f"{name} {size} is not a multiple of 64"
    return None


@functools.partial(jax.jit, static_argnames=("eps", "o_block_n", "o_block_k", "block_i", "preload", "num_warps",
                                             "num_stages", "slot", "interpret"))
def o_proj_mlp_block(attn: jax.Array, wo: jax.Array, residual: jax.Array, norm_weight: jax.Array, w_gate: jax.Array,
                     w_up: jax.Array, w_down: jax.Array, counters: jax.Array, *, eps: float = 1e-6,
                     o_block_n: int = 32, o_block_k: int = 256, block_i: int | None = None, preload: int = 1,
                     num_warps: int = 8, num_stages: int = 3, slot: int | None = None, interpret: bool = False
                     ) -> tuple[jax.Array, jax.Array]:
    """x1 = residual + attn @ wo, then x1 + swiglu_mlp(rms_norm(x1)), in one launch: (out [T, hidden], counters).

    attn [T <= 16, Ko]; wo [Ko, hidden]; residual [T, hidden]; norm_weight [hidden] (the MLP's RMSNorm); w_gate /
    w_up [hidden, I]; w_down [I, hidden]; counters int32 [>= COUNTERS], zero (`ModelOps.step_counters`), returned
    zero (aliased). o_block_n: the o programs' column tile (hidden / o_block_n programs, whole K each); block_i:
    intermediate columns per MLP program (default `fused_mlp.default_block_i`); preload: gate|up K tiles each MLP
    program loads before it waits for x1. slot: this launch's own counter (`counters[slot]` zero, left at the o
    programs' count; see the module doc), or None: counters[:COUNTERS], left zero.
    """
    tokens, ko = attn.shape
    hidden = residual.shape[1]
    inter = w_gate.shape[1]
    why = check_supported(tokens, ko, hidden, inter)
    if why is not None:
        raise ValueError(why)
    if wo.shape != (ko, hidden) or residual.shape != (tokens, hidden) or norm_weight.shape != (hidden,) \
            or w_gate.shape != (hidden, inter) or w_up.shape != w_gate.shape or w_down.shape != (inter, hidden):
        raise ValueError(f"shapes disagree: {attn.shape=} {wo.shape=} {residual.shape=} {norm_weight.shape=} "
                         f"{w_gate.shape=} {w_up.shape=} {w_down.shape=}")
    check_counters(counters, COUNTERS if slot is None else slot + 1)
    block_i = pow2_divisor(inter, 128) if block_i is None else block_i
    block_k = pow2_divisor(hidden, 128)
    block_n = pow2_divisor(hidden, 256)
    o_block_k = min(o_block_k, pow2_divisor(ko, o_block_k))
    if hidden % o_block_n or inter % block_i or hidden // block_k < preload:
        raise ValueError(f"{o_block_n=} must divide hidden {hidden}, {block_i=} intermediate {inter}, "
                         f"{preload=} <= {hidden // block_k} K tiles")
    o_programs, mlp_programs = hidden // o_block_n, inter // block_i
    if slot is not None and not interpret and mlp_programs > max_waiting():
        raise ValueError(f"{mlp_programs} MLP programs > {max_waiting()} (block_i {block_i}): a slot launch's waiting "
                         f"programs must leave SMs to the o programs")
    kernel = functools.partial(_kernel, o_programs=o_programs, mlp_programs=mlp_programs, block_t=16,
                               o_block_n=o_block_n, o_block_k=o_block_k, block_k=block_k, block_i=block_i,
                               block_n=block_n, preload=preload, eps=eps, interpret=interpret, slot=slot)
    whole = pl.no_block_spec
    x1, counters, partials = pl.pallas_call(
        kernel,
        grid=(o_programs + mlp_programs,),
        in_specs=[whole] * 8,
        out_specs=[whole] * 3,
        out_shape=[jax.ShapeDtypeStruct(residual.shape, residual.dtype),
                   jax.ShapeDtypeStruct(counters.shape, jnp.int32),
                   jax.ShapeDtypeStruct((mlp_programs, tokens, hidden), jnp.float32)],
        input_output_aliases={7: 1},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"o_proj_mlp_o{o_block_n}_i{block_i}_p{preload}",
    )(attn, wo, residual, norm_weight, w_gate, w_up, w_down, counters)
    return x1 + partials.sum(axis=0).astype(x1.dtype), counters


def o_proj_mlp_block_reference(attn, wo, residual, norm_weight, w_gate, w_up, w_down, counters=None, *,
                               eps: float = 1e-6):
    """Plain jnp, the model's ops: residual + o, then the MLP block with HF's RMSNorm rounding."""
    from pallas_kernels.dense.fused_mlp import fused_swiglu_mlp_reference

    x1 = residual + jnp.dot(attn, wo, preferred_element_type=jnp.float32).astype(residual.dtype)
    return x1 + fused_swiglu_mlp_reference(x1, w_gate, w_up, w_down, norm_weight, eps=eps), counters

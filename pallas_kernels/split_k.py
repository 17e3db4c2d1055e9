"""Split-K finished inside the kernel: the last program to arrive at a tile sums the partials.

A decode-sized projection splits its K range over programs to put enough of them in flight; the fp32 partials
then need summing, and handing that to XLA costs a kernel (and the residual add that follows, another one) of
~1.5-2 us each per layer at batch 1 on the H100, mostly launch latency. Here each program stores its partial,
takes a ticket from the tile's counter (one atomic add after a barrier: every thread's partial stored first), and
the program that draws the last ticket sums the tile's partials in split order (deterministic, whoever arrives
last) reading past L1 (volatile), resets the counter to zero and runs the epilogue. Used where it measured faster:
norm_qkv_rope.py (a head's K splits) and moe_router.py (the router's K splits, the last program routing). The same
tail in the o projection, the fused MLP and the decode attention's merge measured slower on the H100.

Counters are the step's (`ModelOps.step_counters`): zero on entry, left zero, passed from kernel to kernel so the
stream orders the launches that share them. In the Pallas interpreter programs run one after another: the last
in grid order finishes the tile.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu


def check_counters(counters: jax.Array, need: int) -> None:
    """ValueError naming `counters` unless they are int32 [>= need]."""
    if counters.dtype != jnp.int32 or counters.ndim != 1 or counters.shape[0] < need:
        raise ValueError(f"counters must be int32 [>= {need}], got {counters.dtype} {counters.shape}")


def take_ticket(cnt_ref, counter, interpret: bool) -> jax.Array:
    """This program's arrival number at `cnt_ref[counter]` (0 first), once its partials are stored."""
    if not interpret:  # every thread's partial stored before the (one-thread, acq_rel) counter increment
        plgpu.debug_barrier()
    return plgpu.atomic_add(cnt_ref, counter, jnp.ones((), jnp.int32))


def sum_splits(part_ref, splits: int, index, mask) -> jax.Array:
    """sum over s of `part_ref[index(s)]` (fp32, split order), read past L1; the loads are independent (all in
    flight at once)."""
    total = None
    for s in range(splits):
        part = plgpu.load(part_ref.at[index(jnp.int32(s))], mask=mask, other=0, volatile=True)
        total = part if total is None else total + part
    return total

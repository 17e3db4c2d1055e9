"""One-shot all-reduce over NVLink peer memory: the sum of a small array across the devices of a mesh axis, one
Triton kernel (jax-triton) inside `jax.shard_map`, for a mesh whose GPUs one process drives; the same kernel
all-gathers (the logits' vocab-parallel columns), so a decode step holds no XLA collective at all.

Why. A tensor-parallel decode step at batch 1 reduces two [T, hidden] partial sums a layer (a few KB each). XLA's
NCCL all-reduce costs 16-30 us of device time there, ~1.4 ms of a Qwen3-8B step, and XLA cuts the step's command
buffer at every collective: on two H200s the host spent 5.6 ms a step per GPU launching 36 command buffers and the
collectives between them, against 1.8 ms for the one-GPU step's single command buffer. A custom call that is a
plain kernel is neither: the step stays one command buffer. This is what vLLM's custom all-reduce and the Rust
engines do at small sizes.

How (the push form, double-buffered). A `Workspace` is allocated once per mesh: on every device a receive buffer
[2 parities, devices, MAX_BYTES] and flags [2, PROGRAMS, devices] + a call counter per program, and a table of all
their addresses that every device holds. Call number e of program p on device r: store its slice of x into slot
[e % 2, r] of every device's receive buffer (plain stores over NVLink), fence and barrier the block, then set flag
[e % 2, p, r] to e on every device (a release store at system scope). Wait until the flags [e % 2, p, *] of this
device all read e (acquire), and sum the slots [e % 2, 0..n-1] in device order, in float32: every device computes
the same bits (gathering, it copies each slot to its columns instead). No barrier at the end: a device writes
parity e % 2 again only at call e + 2, after it has seen every device's flag of call e + 1, which each device sets
only after it finished reading call e.

Every device must make the same calls in the same order (SPMD steps do), each with all PROGRAMS programs.
Peer access between the GPUs is enabled by XLA's GPU client for the devices of one process; over several
processes the addresses mean nothing and `ModelOps.reduce` keeps XLA's psum, as it does on CPU (no interpreter:
peer memory exists only between GPUs) and over MAX_BYTES.

(A Mosaic GPU form, `plgpu.remote_ref` with XLA's collective metadata, was built first and measured slower: XLA
exchanged the peer addresses of its buffers at every call, a host rendezvous of 6 ms a step; see
docs/performance.md.)
"""

from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.common import next_pow2

PROGRAMS = 8  # fixed: the flags and counters are per program
MAX_BYTES = 1 << 20  # per device and call; larger reductions take XLA's psum
DTYPES = ("bfloat16", "float16", "float32")
_ACTIVE: list = []  # the workspace tables of the forwards being traced (`use`)
_WORKSPACES: dict = {}  # device ids -> Workspace


def supported(shape: tuple[int, ...], dtype) -> bool:
    """Whether `one_shot_all_reduce` takes an array of this shape and dtype."""
    return jnp.dtype(dtype).name in DTYPES and math.prod(shape) * jnp.dtype(dtype).itemsize <= MAX_BYTES


def workspace(mesh) -> Workspace:
    """The mesh's workspace, allocated at the first call and never freed: executables hold its addresses."""
    key = tuple(d.id for d in mesh.devices.flat)
    if key not in _WORKSPACES:
        _WORKSPACES[key] = Workspace(mesh)
    return _WORKSPACES[key]


class Workspace:
    """(Use `workspace(mesh)`, which keeps it alive.) The receive buffers and flags of one mesh's devices, and the
    table of their addresses (`table`: uint32 [devices, 2 * (2 + 2 * devices)], replicated: row r = (r, its
    counters' address, every device's receive buffer, every device's flags), each value as its low and high 32 bits
    (JAX's arrays are 32-bit unless x64 is on))."""

    def __init__(self, mesh):
        devices = list(mesh.devices.flat)
        n = len(devices)
        self.recv = [jax.device_put(np.zeros(2 * n * MAX_BYTES, np.uint8), d) for d in devices]
        self.flags = [jax.device_put(np.zeros(2 * PROGRAMS * n + PROGRAMS, np.int32), d) for d in devices]
        recv = [a.unsafe_buffer_pointer() for a in self.recv]
        flags = [a.unsafe_buffer_pointer() for a in self.flags]
        rows = np.asarray([[r, flags[r] + 2 * PROGRAMS * n * 4, *recv, *flags] for r in range(n)], np.uint64)
        self.table = jax.device_put(rows.view(np.uint32).reshape(n, -1),  # (little-endian: low word first)
                                    jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


@contextlib.contextmanager
def use(table):
    """While tracing a sharded forward: `one_shot_all_reduce` reads this (traced, replicated) workspace table."""
    _ACTIVE.append(table)
    try:
        yield
    finally:
        _ACTIVE.pop()


def active() -> bool:
    return bool(_ACTIVE)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def address(row, i, ty: tl.constexpr):
        """Entry i of a table row (low, high 32-bit words) as a pointer to ty."""
        lo = tl.load(row + 2 * i).to(tl.uint64)
        hi = tl.load(row + 2 * i + 1).to(tl.uint64)
        return ((hi << 32) | lo).to(tl.int64, bitcast=True).to(tl.pointer_type(ty))

    @triton.jit
    def all_reduce_kernel(x_ptr, table_ptr, rank_ptr, size, out_ptr, WORLD: tl.constexpr, ELEMS: tl.constexpr,
                          SLOT: tl.constexpr, BLOCK: tl.constexpr, GATHER_COLS: tl.constexpr):
        DTYPE = x_ptr.dtype.element_ty
        pid = tl.program_id(0)
        rank = tl.load(rank_ptr)
        row = table_ptr + rank * 2 * (2 + 2 * WORLD)
        counters = address(row, 1, tl.int32)
        epoch = tl.load(counters + pid, volatile=True) + 1
        parity = epoch % 2
        # this program's range of the flattened array, BLOCK elements at a time
        lo = pid * ELEMS
        for start in tl.static_range(0, ELEMS, BLOCK):
            offs = lo + start + tl.arange(0, BLOCK)
            mask = offs < size
            x = tl.load(x_ptr + offs, mask=mask)
            for r in tl.static_range(WORLD):
                recv = address(row, 2 + r, DTYPE)
                tl.store(recv + (parity * WORLD + rank) * SLOT + offs, x, mask=mask)
        # every thread's stores reach the peers before the flag does: a system-scope fence per thread, then the
        # block's barrier, then one thread's release store of each flag
        tl.inline_asm_elementwise("fence.acq_rel.sys; mov.b32 $0, $1;", "=r,r", [pid], dtype=tl.int32,
                                  is_pure=False, pack=1)
        tl.debug_barrier()
        for r in tl.static_range(WORLD):
            flags = address(row, 2 + WORLD + r, tl.int32)
            tl.atomic_xchg(flags + (parity * tl.num_programs(0) + pid) * WORLD + rank, epoch, sem="release",
                           scope="sys")
        mine = address(row, 2 + WORLD + rank, tl.int32)
        for r in tl.static_range(WORLD):
            flag = mine + (parity * tl.num_programs(0) + pid) * WORLD + r
            while tl.atomic_add(flag, 0, sem="acquire", scope="sys") < epoch:
                pass
        tl.debug_barrier()
        recv_mine = address(row, 2 + rank, DTYPE)
        for start in tl.static_range(0, ELEMS, BLOCK):
            offs = lo + start + tl.arange(0, BLOCK)
            mask = offs < size
            if GATHER_COLS:  # x [rows, GATHER_COLS] -> out [rows, WORLD * GATHER_COLS], device r's columns r-th
                dest = offs // GATHER_COLS * (WORLD * GATHER_COLS) + offs % GATHER_COLS
                for r in tl.static_range(WORLD):
                    part = tl.load(recv_mine + (parity * WORLD + r) * SLOT + offs, mask=mask, volatile=True)
                    tl.store(out_ptr + dest + r * GATHER_COLS, part, mask=mask)
            else:
                acc = tl.zeros((BLOCK,), tl.float32)
                for r in tl.static_range(WORLD):
                    acc += tl.load(recv_mine + (parity * WORLD + r) * SLOT + offs, mask=mask, volatile=True) \
                        .to(tl.float32)
                tl.store(out_ptr + offs, acc.to(DTYPE), mask=mask)
        tl.debug_barrier()
        tl.store(counters + pid, epoch)

    return all_reduce_kernel


def one_shot_all_reduce(x: jax.Array, axis_name: str) -> jax.Array:
    """sum over `axis_name` of x, every device's result the same bits; inside shard_map, under `use(table)`."""
    return _call(x, axis_name, gather=False)


def one_shot_all_gather(x: jax.Array, axis_name: str) -> jax.Array:
    """x [rows, cols] of every device along `axis_name`, side by side: [rows, devices * cols] (as
    `jax.lax.all_gather(x, axis_name, axis=1, tiled=True)`); inside shard_map, under `use(table)`."""
    return _call(x, axis_name, gather=True)


def _call(x: jax.Array, axis_name: str, gather: bool) -> jax.Array:
    import jax_triton as jt

    world = jax.lax.axis_size(axis_name)
    if world == 1:
        return x
    if not _ACTIVE:
        raise ValueError("the one-shot collectives need a workspace: trace the forward under all_reduce.use(table)")
    if not supported(x.shape, x.dtype) or (gather and x.ndim != 2):
        raise ValueError(f"x: shape {x.shape} / dtype {x.dtype} is not supported by the one-shot collectives")
    size = x.size
    elems = -(-size // PROGRAMS)
    block = min(next_pow2(elems), 2048)
    elems = -(-elems // block) * block
    rank = jax.lax.axis_index(axis_name).astype(jnp.int32).reshape(1)
    out_shape = (x.shape[0], world * x.shape[1]) if gather else x.shape
    out = jt.triton_call(x.reshape(size), _ACTIVE[-1], rank, size, kernel=_kernel(),
                         out_shape=jax.ShapeDtypeStruct((math.prod(out_shape),), x.dtype), grid=(PROGRAMS,),
                         num_warps=4, WORLD=world, ELEMS=elems, SLOT=MAX_BYTES // jnp.dtype(x.dtype).itemsize,
                         BLOCK=block, GATHER_COLS=x.shape[1] if gather else 0)
    return out.reshape(out_shape)

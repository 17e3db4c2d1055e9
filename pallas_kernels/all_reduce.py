"""One-shot all-reduce over NVLink peer memory: the sum of a small array across the devices of a mesh axis, one
Triton kernel (XLA's own Triton custom call, below) inside `jax.shard_map`; the same kernel all-gathers (the
logits' vocab-parallel columns), so a decode step holds no XLA collective at all.

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
Peer access between the GPUs is enabled by XLA's GPU client for the devices of one process (`Workspace`); over
several processes, one GPU each, the workspace is CUDA IPC memory (jinfer/parallel/peer_memory.py): only the table
differs, row `rank` being all a device reads. `ModelOps.reduce` keeps XLA's psum on CPU (no interpreter: peer
memory exists only between GPUs) and over MAX_BYTES.

(A Mosaic GPU form, `plgpu.remote_ref` with XLA's collective metadata, was built first and measured slower: XLA
exchanged the peer addresses of its buffers at every call, a host rendezvous of 6 ms a step; see
docs/performance.md.)
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from pallas_kernels.common import next_pow2

PROGRAMS = 8  # fixed: the flags and counters are per program
NUM_WARPS = 4
MAX_BYTES = 1 << 20  # per device and call; larger reductions take XLA's psum
DTYPES = ("bfloat16", "float16", "float32")
# The workspace tables of the forwards this thread is tracing (`use`): per thread, as warm-up traces several forwards
# at once (shared, a trace took another thread's table: a leaked tracer, or an executable whose inputs did not match)
_TRACING = threading.local()


def _active() -> list:
    if not hasattr(_TRACING, "tables"):
        _TRACING.tables = []
    return _TRACING.tables
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
    _active().append(table)
    try:
        yield
    finally:
        _active().pop()


def active() -> bool:
    return bool(_active())


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
    def all_reduce_kernel(x_ptr, table_ptr, rank_ptr, out_ptr, size: tl.constexpr, WORLD: tl.constexpr,
                          ELEMS: tl.constexpr, SLOT: tl.constexpr, BLOCK: tl.constexpr, GATHER_COLS: tl.constexpr):
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
    world = jax.lax.axis_size(axis_name)
    if world == 1:
        return x
    if not _active():
        raise ValueError("the one-shot collectives need a workspace: trace the forward under all_reduce.use(table)")
    if not supported(x.shape, x.dtype) or (gather and x.ndim != 2):
        raise ValueError(f"x: shape {x.shape} / dtype {x.dtype} is not supported by the one-shot collectives")
    size = x.size
    elems = -(-size // PROGRAMS)
    block = min(next_pow2(elems), 2048)
    elems = -(-elems // block) * block
    rank = jax.lax.axis_index(axis_name).astype(jnp.int32).reshape(1)
    out_shape = (x.shape[0], world * x.shape[1]) if gather else x.shape
    out = _one_shot_p.bind(x.reshape(size), _active()[-1], rank, dtype=jnp.dtype(x.dtype).name, size=size,
                           out_size=math.prod(out_shape), world=world, elems=elems, block=block,
                           gather_cols=x.shape[1] if gather else 0)
    return out.reshape(out_shape)


# The kernel reaches XLA as its own Triton custom call (`__gpu$xla.gpu.triton`, what Pallas's Triton backend
# emits): XLA compiles the Triton IR into a plain kernel of the executable, which its command buffers (CUDA
# graphs) capture like any fusion. jax-triton's `triton_kernel_call` is a legacy custom call that this XLA no
# longer puts in command buffers: on two H200s the step was cut at every reduction into 37 command buffers per
# GPU, each updated and launched every step (host 5.2 ms a step per GPU; docs/performance.md).
_one_shot_p = jax.extend.core.Primitive("one_shot_collective")


@_one_shot_p.def_abstract_eval
def _one_shot_abstract(x, table, rank, *, dtype, out_size, **_):
    return jax.core.ShapedArray((out_size,), x.dtype)


_TRITON_TYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@functools.cache
def triton_ir(dtype: str, size: int, world: int, elems: int, block: int, gather_cols: int) -> tuple[str, str]:
    """(kernel name, Triton IR text) of one call shape, from Triton's own front end (`triton` is jax-triton's
    dependency, in the `cuda` extras) for the sm_90 target; XLA lowers the IR for the device it runs on."""
    from triton._C.libtriton import ir as triton_ir_lib
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    ty = _TRITON_TYPES[dtype]
    consts = {"size": size, "WORLD": world, "ELEMS": elems, "SLOT": MAX_BYTES // np.dtype(jnp.dtype(dtype)).itemsize,
              "BLOCK": block, "GATHER_COLS": gather_cols}
    signature = {"x_ptr": f"*{ty}", "table_ptr": "*u32", "rank_ptr": "*i32", "out_ptr": f"*{ty}",
                 **{k: "constexpr" for k in consts}}
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(4)}  # XLA's buffers: 16-byte aligned at least
    src = ASTSource(fn=_kernel(), signature=signature, constexprs=consts, attrs=aligned)
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    options = backend.parse_options({"num_warps": NUM_WARPS})
    context = triton_ir_lib.context()
    triton_ir_lib.load_dialects(context)
    backend.load_dialects(context)
    module = src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(),
                         context)
    stages: dict = {}
    backend.add_stages(stages, options, src.language)
    text = str(stages["ttir"](module, {}))  # inlined, canonicalized
    name = f"one_shot_{'gather' if gather_cols else 'reduce'}_{ty}_{size}_w{world}"
    return name, text.replace("@all_reduce_kernel(", f"@{name}(")


def _one_shot_lowering(ctx, x, table, rank, *, dtype, size, out_size, world, elems, block, gather_cols):
    import io

    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir
    from jax._src.lib.triton import dialect as tt_dialect

    name, text = triton_ir(dtype, size, world, elems, block, gather_cols)
    with mlir.JaxIrContext() as context:  # as Pallas's Triton lowering: the IR in a context of its own
        context.append_dialect_registry(mlir.upstream_dialects)
        tt_dialect.register_dialect(context)
        context.load_all_available_dialects()
        buf = io.BytesIO()
        ir.Module.parse(text).operation.write_bytecode(buf)
    config = dict(name=ir.StringAttr.get(name), ir=ir.StringAttr.get(buf.getvalue()), num_stages=mlir.i32_attr(1),
                  num_warps=mlir.i32_attr(NUM_WARPS), grid_x=mlir.i32_attr(PROGRAMS), grid_y=mlir.i32_attr(1),
                  grid_z=mlir.i32_attr(1), debug=ir.BoolAttr.get(False))
    layouts = [list(reversed(range(len(a.shape)))) for a in ctx.avals_in]
    out = ctx.avals_out[0]
    return mlir.custom_call(call_target_name="__gpu$xla.gpu.triton", operands=[x, table, rank],
                            result_types=[ir.RankedTensorType.get(out.shape, mlir.dtype_to_ir_type(out.dtype))],
                            backend_config=config, api_version=4, operand_layouts=layouts,
                            result_layouts=[[0]]).results


def _register():
    from jax._src.interpreters import mlir

    mlir.register_lowering(_one_shot_p, _one_shot_lowering, platform="cuda")


_register()

"""Peer memory across processes: the one-shot all-reduce's workspace (pallas_kernels/all_reduce.py) for a mesh whose
GPUs several processes of one host drive, one GPU each (`--nnodes N`, a `CUDA_VISIBLE_DEVICES` per process).

Within one process XLA's GPU client enables peer access between its devices, and the workspace's buffers are JAX
arrays whose addresses every device can use (`all_reduce.Workspace`). Across processes an address means nothing.
So each process allocates its GPU's receive buffer and flags with the CUDA driver (`cuMemAlloc`: memory CUDA IPC
can export, which XLA's pool allocators do not hand out), publishes their IPC handles in JAX's distributed
key-value store, and opens its peers' (`cuIpcOpenMemHandle`, peer access enabled on first use). The table has
`Workspace.table`'s layout; each process's copy holds only its own device's row, the one its kernel reads (row
`rank`): the "replicated" table differs between processes by design. The memory is never freed (executables hold
its addresses).

All or none: a process that cannot set it up (no CUDA driver, IPC refused between containers, not one GPU of the
mesh) says why in the store, and then every process keeps XLA's collectives, so the group's executables stay the
same everywhere.
"""

from __future__ import annotations

import base64
import ctypes
import logging

import numpy as np

log = logging.getLogger(__name__)

HANDLE_BYTES = 64
LAZY_ENABLE_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
TIMEOUT_MS = 600_000  # a peer still loading its weights is slow, not dead
_TABLES: dict = {}  # mesh device ids -> the table (one exchange per mesh)
_EXCHANGES = [0]  # store keys are unique per exchange


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * HANDLE_BYTES)]


class CudaDriver:
    """The few CUDA driver calls the workspace needs, through ctypes (libcuda.so.1 of the machine's driver)."""

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        u64, ptr = ctypes.c_uint64, ctypes.POINTER
        signatures = {
            "cuInit": [ctypes.c_uint],
            "cuDeviceGet": [ptr(ctypes.c_int), ctypes.c_int],
            "cuDevicePrimaryCtxRetain": [ptr(ctypes.c_void_p), ctypes.c_int],
            "cuCtxSetCurrent": [ctypes.c_void_p],
            "cuCtxSynchronize": [],
            "cuMemAlloc_v2": [ptr(u64), ctypes.c_size_t],
            "cuMemsetD8_v2": [u64, ctypes.c_ubyte, ctypes.c_size_t],
            "cuIpcGetMemHandle": [ptr(_Handle), u64],
            "cuIpcOpenMemHandle_v2": [ptr(u64), _Handle, ctypes.c_uint],
        }
        for name, args in signatures.items():
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = ctypes.c_int
        self.lib = lib
        self._call("cuInit", 0)

    def _call(self, name: str, *args) -> None:
        if (status := getattr(self.lib, name)(*args)) != 0:
            raise OSError(f"{name}: CUDA driver error {status}")

    def use_device(self, ordinal: int) -> None:
        """Make the device's primary context (the one XLA runs in) current in this thread."""
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        self._call("cuDeviceGet", ctypes.byref(dev), ordinal)
        self._call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev.value)
        self._call("cuCtxSetCurrent", ctx)

    def alloc_zeroed(self, nbytes: int) -> int:
        address = ctypes.c_uint64()
        self._call("cuMemAlloc_v2", ctypes.byref(address), nbytes)
        self._call("cuMemsetD8_v2", address.value, 0, nbytes)
        self._call("cuCtxSynchronize")
        return address.value

    def export(self, address: int) -> bytes:
        handle = _Handle()
        self._call("cuIpcGetMemHandle", ctypes.byref(handle), address)
        return ctypes.string_at(ctypes.addressof(handle), HANDLE_BYTES)

    def open(self, handle: bytes) -> int:
        address = ctypes.c_uint64()
        self._call("cuIpcOpenMemHandle_v2", ctypes.byref(address), _Handle.from_buffer_copy(handle),
                   LAZY_ENABLE_PEER_ACCESS)
        return address.value


def exchange_rows(device_procs: list[int], me: int, ordinal: int, client, prefix: str, programs: int,
                  max_bytes: int, driver_factory=CudaDriver) -> np.ndarray | None:
    """This process's copy of the table (uint64 [devices, 2 + 2 * devices]: only its own device's row filled), or
    None when some process of the group could not take part. `device_procs`: the process of each device of the
    mesh, in mesh order; `me`: this process; `ordinal`: its device's CUDA ordinal; `client`: the key-value store
    (`key_value_set`, `blocking_key_value_get`), under `prefix`."""
    n, procs = len(device_procs), sorted(set(device_procs))
    recv_bytes, flag_words = 2 * n * max_bytes, 2 * programs * n + programs
    driver = recv = flags = None
    try:
        if device_procs.count(me) != 1 or any(device_procs.count(p) != 1 for p in procs):
            raise ValueError("the IPC workspace takes meshes of one GPU per process")
        driver = driver_factory()
        driver.use_device(ordinal)
        recv, flags = driver.alloc_zeroed(recv_bytes), driver.alloc_zeroed(4 * flag_words)
        said = base64.b64encode(driver.export(recv) + driver.export(flags)).decode()
    except Exception as e:  # noqa: BLE001 - told to the group, which then keeps XLA's collectives
        said = f"!{type(e).__name__}: {e}"

    def agree(stage: str, mine: str) -> list[str] | None:
        """Every process's word at this stage (in process order), or None if one of them failed ("!why")."""
        client.key_value_set(f"{prefix}/{stage}/{me}", mine)
        words = [client.blocking_key_value_get(f"{prefix}/{stage}/{p}", TIMEOUT_MS) for p in procs]
        if failed := [f"process {p}: {w[1:]}" for p, w in zip(procs, words, strict=True) if w.startswith("!")]:
            log.warning("one-shot all-reduce across processes unavailable (%s): XLA's collectives instead",
                        "; ".join(failed))
            return None
        return words

    if (handles := agree("handles", said)) is None:
        return None
    rank = device_procs.index(me)
    row = [rank, flags + 2 * programs * n * 4]
    try:
        opened = {}
        for p, text in zip(procs, handles, strict=True):
            raw = base64.b64decode(text)
            opened[p] = (recv, flags) if p == me else (driver.open(raw[:HANDLE_BYTES]), driver.open(raw[HANDLE_BYTES:]))
        row += [opened[p][0] for p in device_procs] + [opened[p][1] for p in device_procs]
        opened_ok = "ok"
    except Exception as e:  # noqa: BLE001
        opened_ok = f"!{type(e).__name__}: {e}"
    if agree("opened", opened_ok) is None:
        return None
    rows = np.zeros((n, 2 + 2 * n), np.uint64)
    rows[rank] = row
    return rows


def ipc_table(mesh):
    """The one-shot all-reduce's table for a mesh spanning several processes (one GPU each), or None (the group
    keeps XLA's collectives). Every process of the group calls it for the same meshes in the same order."""
    import jax
    from jax._src import distributed
    from jax.sharding import NamedSharding, PartitionSpec

    from pallas_kernels.all_reduce import MAX_BYTES, PROGRAMS

    devices = list(mesh.devices.flat)
    key = tuple(d.id for d in devices)
    if key in _TABLES:
        return _TABLES[key]
    _EXCHANGES[0] += 1
    mine = [d for d in devices if d.process_index == jax.process_index()]
    rows = exchange_rows([d.process_index for d in devices], jax.process_index(),
                         mine[0].local_hardware_id if len(mine) == 1 else -1, distributed.global_state.client,
                         f"jinfer/peer_memory/{_EXCHANGES[0]}", PROGRAMS, MAX_BYTES)
    table = None
    if rows is not None:
        local = rows.view(np.uint32).reshape(len(devices), -1)  # (little-endian: low word first)
        table = jax.make_array_from_single_device_arrays(local.shape, NamedSharding(mesh, PartitionSpec()),
                                                         [jax.device_put(local, d) for d in mine])
    _TABLES[key] = table
    return table

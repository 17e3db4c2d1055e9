"""The one-shot all-reduce's workspace across processes (jinfer/parallel/peer_memory.py): the exchange of CUDA IPC
handles through a key-value store and the table rows it builds, with two simulated processes (threads), a fake
store and a fake driver. The driver calls and the kernel itself need GPUs (tests/kernels/test_all_reduce.py). Also the
group's other use of the store at start-up: the order of the warm-up compiles."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from jinfer.parallel.peer_memory import HANDLE_BYTES, exchange_rows

PROGRAMS, MAX_BYTES = 8, 1 << 20
OPENED = 1 << 44  # a peer's buffer opened in this process: its address + OPENED (a different mapping)


class Store:
    """JAX's distributed key-value store's two calls, for threads."""

    def __init__(self):
        self.values, self.cond = {}, threading.Condition()

    def key_value_set(self, key, value):
        with self.cond:
            assert key not in self.values, key
            self.values[key] = value
            self.cond.notify_all()

    def blocking_key_value_get(self, key, timeout_ms):
        with self.cond:
            assert self.cond.wait_for(lambda: key in self.values, timeout_ms / 1e3), key
            return self.values[key]


def fake_driver(process, fail_open=False, fail=False):
    class Driver:
        def __init__(self):
            if fail:
                raise OSError("cuInit: CUDA driver error 100")
            self.next = (process + 1) << 32

        def use_device(self, ordinal):
            assert ordinal == 0

        def alloc_zeroed(self, nbytes):
            self.next += 1 << 24
            return self.next

        def export(self, address):
            return address.to_bytes(8, "little") * (HANDLE_BYTES // 8)

        def open(self, handle):
            if fail_open:
                raise OSError("cuIpcOpenMemHandle_v2: CUDA driver error 201")
            return int.from_bytes(handle[:8], "little") + OPENED

    return Driver


def run(n, drivers, device_procs=None):
    store = Store()
    device_procs = list(range(n)) if device_procs is None else device_procs
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda p: exchange_rows(device_procs, p, 0, store, "t", PROGRAMS, MAX_BYTES,
                                                     driver_factory=drivers[p]), range(n)))


def test_each_process_holds_its_row_of_peer_addresses():
    n = 3
    rows = run(n, [fake_driver(p) for p in range(n)])
    recv = [((p + 1) << 32) + (1 << 24) for p in range(n)]  # each process's first allocation, then its flags
    flags = [r + (1 << 24) for r in recv]
    for p, table in enumerate(rows):
        assert table.shape == (n, 2 + 2 * n) and table.dtype == np.uint64
        own = [a if q == p else a + OPENED for q, a in enumerate(recv)]
        own += [a if q == p else a + OPENED for q, a in enumerate(flags)]
        assert table[p].tolist() == [p, flags[p] + 2 * PROGRAMS * n * 4, *own]
        assert not np.delete(table, p, axis=0).any()  # the other rows: never read by this process's kernel


def test_all_or_none():
    """One process that cannot allocate, or open a peer's handle, or holds two GPUs of the mesh: none uses it."""
    assert run(2, [fake_driver(0), fake_driver(1, fail=True)]) == [None, None]
    assert run(2, [fake_driver(0, fail_open=True), fake_driver(1)]) == [None, None]
    assert run(2, [fake_driver(0), fake_driver(1)], device_procs=[0, 1, 1]) == [None, None]



def test_group_compile_turn():
    """A group's warm-up compiles (ModelRunner.warmup's compile_turn): the others start once process 0's are done,
    and not when process 0's failed (they then wait until the group is lost)."""
    from jinfer.parallel.multihost import _COMPILED_KEY, _Member

    store, order = Store(), []
    leader, follower = _Member(2, 0, store), _Member(2, 1, store)

    def follow():
        with follower:
            order.append("follower")

    t = threading.Thread(target=follow)
    t.start()
    t.join(0.2)
    assert t.is_alive() and order == []  # waiting for process 0
    try:
        with leader:
            raise RuntimeError("compile failed")
    except RuntimeError:
        pass
    assert _COMPILED_KEY not in store.values
    with leader:
        order.append("leader")
    t.join(5)
    assert order == ["leader", "follower"]
    for m in (leader, follower):
        m.ctx.term()

"""The host tier's bytes: blocks of pages in host memory, and the copies between them and the HBM KV cache.

`HostKVPool.apply(kv_cache, transfers)` replays one schedule's `KVTransfers` (kv_host_tier.py) on the
device, before the step's forward is launched:
- offloads: per block of at most `BLOCK_PAGES` evicted pages, one jitted gather (each page's K and V, or its
  latent rows, over all layers, `[n, L, A, ps, ...]`, in the cache's dtype: FP8 pages stay FP8, their scales are the
  layers' constants and stay in HBM), queued ahead of the forward that overwrites the pages, so
  (the device runs in order) it reads their old contents. A host slot is then (block, row). The block's copy into host
  memory (JAX's `pinned_host` memory kind where the backend has it) is issued by the `kv-offload` thread,
  one block at a time, each once the one before has landed: device -> host copies share one stream with
  the read-back of every step's sampled tokens, so a batch of them issued at once (2.4 GB for a 16k prefix,
  46 ms of PCIe) held up the next step's first token by as long; one at a time, a read-back waits for at
  most one block (~3.3 ms: a warm 16k hit took 18.6 ms while the copies of the prefill before it were
  going out, 15.0 once they had landed). So the engine paces the copies (`hold`, `read_back`, `release`):
  while it runs requests, blocks go out right after a step's read-back, as many as fit before the next
  read-back is due (one step interval later, the last interval between read-backs, at the measured time
  per copy); when it is idle, back to back; and regardless once `MAX_BACKLOG` blocks wait or no turn came
  for `PACE_TIMEOUT_S`. Until its copy has landed, the block's rows are restored from its HBM copy;
- restores: per block the restored slots live in, one `jax.device_put` of the whole block to the device and
  one jitted scatter of the wanted rows into the donated cache, queued ahead of the forward that reads them;
  the host goes on at once, so the copy overlaps the host's work and the steps already queued.
Whole blocks, not pages, cross PCIe: one 2.4 MB page per copy reached 24-30 GB/s host-to-device on the H100
machine against 48-50 GB/s for 16-page blocks and 51-53 GB/s for 1 GB (benchmarks/results/kv_offload_*.json);
and each block costs a gather and a scatter dispatch of ~1 ms of host time there (64-page blocks: a 16k
restore is 16 of each). The price is
the dead rows of a block: its memory is held until its last slot is reassigned, so when the blocks hold more
than `MAX_HELD_RATIO` times the tier's slots, the sparsest blocks are dropped and their slots forgotten by
the tier (the host tier is a cache: losing an entry costs a recompute, never a wrong token).
XLA's pinned-host allocator grows by pinning new regions (seconds per tens of GB, paid by whichever copy
needs the room: a 16k-token prefill that offloaded took 4.6-8 s instead of 0.42 s); `reserve` grows it to
the tier's size once, in a background thread at start-up, and frees it for the blocks to reuse.
A block's array is dropped when its last slot goes; JAX keeps it alive until a copy reading it has finished,
so reusing a slot never races a copy.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jinfer.cache.host_tier import KVTransfers
from jinfer.cache.spec import indexed_arrays

log = logging.getLogger(__name__)

BLOCK_PAGES = 64  # pages per host block (one PCIe copy each way): 151 MB for Qwen3-4B
COPY_THREADS = 4  # threads issuing a batch's host -> device block copies
MAX_HELD_RATIO = 1.5  # host memory held by blocks, at most this times the tier's slots
HOST_MEMORY_KINDS = ("pinned_host", "unpinned_host")  # in order of preference
MAX_BACKLOG = 8  # blocks waiting for their host copy (staged in HBM) past which the copies stop waiting
PACE_TIMEOUT_S = 0.05  # a copy waits at most this long for a read-back (an engine never told it is idle)


def transfer_buckets() -> tuple[int, ...]:
    return tuple(1 << i for i in range(BLOCK_PAGES.bit_length()))


def host_memory_kind(device) -> str | None:
    """The best host memory kind the device's backend offers (pinned_host on GPU and, in jax 0.11, on CPU)."""
    kinds = {m.kind for m in device.addressable_memories()}
    return next((k for k in HOST_MEMORY_KINDS if k in kinds), None)


def _gather_block(kv_cache, ids):
    """ids i32[n] -> [n, L, A, ps, ...]: each page's arrays over all layers (A = 2: K and V [ps, h, d]; A = 1: a
    latent row [ps, dim]; an FP8 layer's scales are no page's)."""
    return jnp.stack([jnp.stack([a[ids] for a in layer[:indexed_arrays(layer)]], axis=1) for layer in kv_cache],
                     axis=1)


def _scatter_rows(kv_cache, ids, block, rows):
    """Write block[rows[i]] ([L, A, ps, ...]) at page ids[i] of every layer (padding: the null page).

    The ids are distinct but for the padding's null page, which nobody reads: declared unique, so XLA stores
    the pages instead of running an atomic compare-and-swap loop per bf16 element (docs/ARCHITECTURE.md)."""
    x = block[rows]  # [n, L, A, ps, ...]
    return tuple(tuple(a.at[ids].set(x[:, i, j], unique_indices=True) if a.ndim > 1 else a
                       for j, a in enumerate(layer)) for i, layer in enumerate(kv_cache))


@dataclass(eq=False)
class _Block:
    array: Any  # [n, L, A, ps, ...] in host memory (numpy without a host memory kind)
    live: int  # slots pointing at it


class HostKVPool:
    def __init__(self, kv_cache, num_slots: int):
        k0 = kv_cache[0][0]  # [num_pages, ps, h, d] (or a latent [num_pages, ps, dim]): every layer alike
        arrays = indexed_arrays(kv_cache[0])  # (k, v) or (latent,), then FP8's scales
        if any(len(layer) != len(kv_cache[0]) or any(a.shape != k0.shape for a in layer[:arrays])
               for layer in kv_cache):
            raise ValueError("the host tier needs the same paged arrays in every layer")
        self.num_slots = num_slots
        self.page_shape = (len(kv_cache), arrays, *k0.shape[1:])  # [L, A, ps, ...]
        self.page_dtype = k0.dtype
        self.page_bytes = int(np.prod(self.page_shape)) * k0.dtype.itemsize  # over all devices
        sharding = k0.sharding
        spec = tuple(sharding.spec) + (None,) * (k0.ndim - len(sharding.spec))
        self.device_sharding = NamedSharding(sharding.mesh, PartitionSpec(None, None, None, *spec[1:]))
        device = next(iter(sharding.mesh.devices.flat))
        self.platform = device.platform
        self.memory_kind = host_memory_kind(device)
        self.host_sharding = self.device_sharding.with_memory_kind(self.memory_kind) if self.memory_kind else None
        if self.memory_kind is None:
            log.warning("%s offers no host memory kind: the KV host tier keeps numpy copies (synchronous)",
                        device.platform)
        self.slots: list[tuple[_Block, int] | None] = [None] * num_slots
        self.held_pages = 0  # rows of the live blocks (what the host memory holds)
        kv_shardings = jax.tree.map(lambda a: a.sharding, kv_cache)
        # With XLA's command buffers (its default): without them a 16k restore's 16 scatters took 37.0 ms of
        # host time to dispatch instead of 17.6 (kv_offload_qwen3-4b_h100_writeback_nographs.json).
        self._gather = jax.jit(_gather_block, out_shardings=self.device_sharding)
        self._scatter = jax.jit(_scatter_rows, donate_argnames=("kv_cache",), out_shardings=kv_shardings)
        self._reserver: threading.Thread | None = None
        self._copier: ThreadPoolExecutor | None = None
        self._offloads: queue.Queue = queue.Queue()  # (block, its HBM array) awaiting the host copy
        self._offloader: threading.Thread | None = None
        self._pace = threading.Condition()
        self._holding = False  # the engine runs requests: copies wait for their turn after read-backs
        self._last_read_back: float | None = None
        self._deadline = 0.0  # when the next read-back is due (monotonic): copies must land before it
        self._copy_s = 0.004  # time of one block's copy to the host (measured, smoothed)
        self.last_apply: dict = {}  # host time of the last `apply`'s phases (benchmarks read it)

    @property
    def num_used_slots(self) -> int:
        return sum(a is not None for a in self.slots)

    def _offload(self, on_device: jax.Array, live: int) -> _Block:
        """A block of freshly gathered pages: its host copy is the offload thread's (see the module doc)."""
        if self.host_sharding is None:
            return _Block(np.asarray(jax.device_get(on_device)), live)
        block = _Block(on_device, live)  # restores read the HBM copy until the host copy has landed
        if self._offloader is None:  # it holds the pool weakly: a discarded engine's pool is freed, its thread ends
            self._offloader = threading.Thread(target=_offload_worker, args=(weakref.ref(self), self._offloads),
                                               name="kv-offload", daemon=True)
            self._offloader.start()
            weakref.finalize(self, self._offloads.put, None)
        self._offloads.put((block, on_device))
        with self._pace:
            self._pace.notify()  # the backlog may have reached MAX_BACKLOG
        return block

    # ---- pacing of the device -> host copies (module doc): the engine's calls ----------------------

    def hold(self) -> None:
        """The engine runs requests: copies wait for their turn after read-backs."""
        with self._pace:
            if not self._holding:
                self._holding, self._last_read_back, self._deadline = True, None, 0.0

    def read_back(self) -> None:
        """A step was read back: copies may go out until the next read-back is due."""
        with self._pace:
            now = time.monotonic()
            if self._holding and self._last_read_back is not None:
                self._deadline = now + (now - self._last_read_back)
                self._pace.notify()
            self._last_read_back = now

    def release(self) -> None:
        """The engine is idle: copy everything waiting."""
        with self._pace:
            self._holding = False
            self._pace.notify()

    def _turn(self) -> bool:
        return (not self._holding or time.monotonic() + self._copy_s <= self._deadline
                or self._offloads.qsize() >= MAX_BACKLOG)

    def _wait_turn(self) -> None:
        with self._pace:
            self._pace.wait_for(self._turn, timeout=PACE_TIMEOUT_S)

    def _copy_to_host(self, block: _Block, on_device: jax.Array) -> None:
        """The offload thread's work for one block (its turn, then its copy)."""
        if block.array is on_device:
            jax.block_until_ready(on_device)  # its gather, queued behind the steps launched before it
            self._wait_turn()
        if block.array is on_device:  # else dropped meanwhile
            t0 = time.perf_counter()
            on_host = jax.device_put(on_device, self.host_sharding)
            on_host.block_until_ready()
            self._copy_s = 0.5 * self._copy_s + 0.5 * (time.perf_counter() - t0)
            if block.array is on_device:
                block.array = on_host

    def wait_offloads(self) -> None:
        """Block until every queued block's host copy has landed."""
        self._offloads.join()

    def _release(self, slot: int) -> None:
        if (held := self.slots[slot]) is not None:
            self.slots[slot] = None
            held[0].live -= 1
            if held[0].live == 0:
                self.held_pages -= len(held[0].array)
                held[0].array = None

    def apply(self, kv_cache, transfers: KVTransfers) -> tuple[Any, list[int]]:
        """Launch the copies (offloads first, then restores). Returns the new cache (the old one is donated)
        and the slots whose bytes were dropped to bound the host memory (the tier must forget them)."""
        t0 = time.perf_counter()
        for chunk in _chunks(transfers.offloads, BLOCK_PAGES):
            n = _bucket(len(chunk))
            ids = np.zeros(n, np.int32)
            ids[:len(chunk)] = [page for page, _ in chunk]
            block = self._offload(self._gather(kv_cache, ids), len(chunk))
            self.held_pages += n
            for row, (_, slot) in enumerate(chunk):
                self._release(slot)
                self.slots[slot] = (block, row)
        t1 = time.perf_counter()
        by_block: dict[_Block, list[tuple[int, int]]] = {}  # block -> (row, HBM page), in restore order
        for slot, page in transfers.restores:
            block, row = self.slots[slot]
            by_block.setdefault(block, []).append((row, page))
        # The blocks' host -> device copies are issued from a few threads (a device_put from host memory may
        # hold its caller until the copy is done); the scatters follow in order on this thread.
        if len(by_block) > 1:
            if self._copier is None:
                self._copier = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="kv-restore")
            on_device = list(self._copier.map(lambda b: jax.device_put(b.array, self.device_sharding), by_block))
        else:
            on_device = [jax.device_put(b.array, self.device_sharding) for b in by_block]
        t2 = time.perf_counter()
        for (block, wanted), staged in zip(by_block.items(), on_device, strict=True):
            for chunk in _chunks(wanted, len(block.array)):
                ids = np.zeros(len(block.array), np.int32)  # padding rows write row 0 into the null page
                rows = np.zeros(len(block.array), np.int32)
                ids[:len(chunk)], rows[:len(chunk)] = [p for _, p in chunk], [r for r, _ in chunk]
                kv_cache = self._scatter(kv_cache, ids, staged, rows)
        self.last_apply = {"offloads": len(transfers.offloads), "restores": len(transfers.restores),
                           "restore_blocks": len(by_block), "offload_s": t1 - t0, "restore_put_s": t2 - t1,
                           "scatter_s": time.perf_counter() - t2}
        return kv_cache, self._trim()

    def _trim(self) -> list[int]:
        """Drop the sparsest blocks while the blocks hold more than MAX_HELD_RATIO x the slots."""
        if self.held_pages <= MAX_HELD_RATIO * self.num_slots:
            return []
        blocks: dict[_Block, list[int]] = {}
        for slot, held in enumerate(self.slots):
            if held is not None:
                blocks.setdefault(held[0], []).append(slot)
        dropped = []
        for _, slots in sorted(blocks.items(), key=lambda kv: kv[0].live / len(kv[0].array)):
            if self.held_pages <= self.num_slots:
                break
            for slot in slots:
                self._release(slot)
            dropped += slots
        return dropped

    def warmup(self, kv_cache):
        """Compile every block size (gathers and scatters of the null page); returns the new cache. Then
        grow the pinned-host allocator to the tier's size in the background (`reserve`)."""
        for n in transfer_buckets():
            ids = np.zeros(n, np.int32)
            block = self._gather(kv_cache, ids)
            kv_cache = self._scatter(kv_cache, ids, block, ids)
        if self.memory_kind == "pinned_host" and self.platform == "gpu" and self._reserver is None:
            self._reserver = threading.Thread(target=self.reserve, name="kv-host-reserve", daemon=True)
            self._reserver.start()
        return kv_cache

    def join(self) -> None:
        """Wait for the start-up reservation's and the offload thread (before the interpreter exits: see
        core.release_engines; the offloads still queued are dropped)."""
        if self._reserver is not None:
            self._reserver.join()
        if self._offloader is not None:
            while True:
                try:
                    self._offloads.get_nowait()
                    self._offloads.task_done()
                except queue.Empty:
                    break
            self._offloads.put(None)
            self._offloader.join()
            self._offloader = None

    def reserve(self) -> None:
        """Allocate the tier's bytes in host memory once and free them: XLA's pinned-host allocator keeps
        the pinned regions, so later blocks are carved out of them instead of pinning new memory."""
        t0 = time.perf_counter()
        spec = tuple(self.device_sharding.spec) + (None,) * (6 - len(self.device_sharding.spec))
        chunk = jax.device_put(np.zeros((BLOCK_PAGES * 16, *self.page_shape[1:]), self.page_dtype),
                               NamedSharding(self.device_sharding.mesh, PartitionSpec(*spec[1:])))
        held = [jax.device_put(chunk, chunk.sharding.with_memory_kind(self.memory_kind))
                for _ in range(-(-self.num_slots * self.page_shape[0] // len(chunk)))]
        jax.block_until_ready(held)
        log.info("KV host tier: %.1f GiB of %s memory reserved in %.1f s", len(held) * chunk.nbytes / 2**30,
                 self.memory_kind, time.perf_counter() - t0)
        del held


def _offload_worker(pool_ref: weakref.ref, offloads: queue.Queue) -> None:
    """The `kv-offload` thread: each queued (block, its HBM array) copied to host memory, until None (`join`,
    or the pool collected). Holds the pool only while copying, and no block between copies."""
    while True:
        item = offloads.get()
        try:
            pool = pool_ref() if item is not None else None
            if pool is None:
                return
            pool._copy_to_host(*item)
        except Exception:  # noqa: BLE001 - the block keeps its HBM copy (restores read it); the thread goes on
            log.exception("KV host tier: a block's copy to host memory failed")
        finally:
            offloads.task_done()
            item = pool = None


def _bucket(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _chunks(items: list, n: int) -> list[list]:
    return [items[i:i + n] for i in range(0, len(items), n)]


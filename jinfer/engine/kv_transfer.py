"""The host tier's bytes: one array per host slot, and the copies between it and the HBM KV cache.

`HostKVPool.apply(kv_cache, transfers)` replays one schedule's `KVTransfers` (kv_host_tier.py) on the
device, before the step's forward is launched:
- offloads: one jitted gather of the evicted pages (each page's K and V over all layers, `[L, 2, ps, h, d]`)
  and one `jax.device_put` of them into host memory (JAX's `pinned_host` memory kind where the backend has
  it): asynchronous, and queued ahead of the forward that overwrites the pages, so (the device runs in
  order) it reads their old contents;
- restores: one `jax.device_put` of the slots' arrays to the device and one jitted scatter into the donated
  cache, queued ahead of the forward that reads them; the host goes on at once, so the copy overlaps the
  host's work and the steps already queued.
Copies go in chunks of at most `MAX_TRANSFER_PAGES` pages (padded to a power of two: a few small
executables). The host queues the chunks without waiting, so a restore's staged pages may all be in HBM at
once (outside the KV pool's budget: 2.4 GB for 16k tokens of Qwen3-4B). A slot's array is dropped when the slot is
reassigned; JAX keeps it alive until a copy reading it has finished, so reusing a slot never races a copy.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jinfer.engine.kv_host_tier import KVTransfers

log = logging.getLogger(__name__)

MAX_TRANSFER_PAGES = 64
HOST_MEMORY_KINDS = ("pinned_host", "unpinned_host")  # in order of preference


def transfer_buckets() -> tuple[int, ...]:
    return tuple(1 << i for i in range(MAX_TRANSFER_PAGES.bit_length()))


def host_memory_kind(device) -> str | None:
    """The best host memory kind the device's backend offers (pinned_host on GPU and, in jax 0.11, on CPU)."""
    kinds = {m.kind for m in device.addressable_memories()}
    return next((k for k in HOST_MEMORY_KINDS if k in kinds), None)


def _gather_pages(kv_cache, ids, *, n: int):
    """ids i32[n] -> n arrays [L, 2, ps, h, d]: each page's K and V over all layers."""
    x = jnp.stack([jnp.stack([k[ids], v[ids]]) for k, v in kv_cache])  # [L, 2, n, ps, h, d]
    return tuple(x[:, :, i] for i in range(n))


def _scatter_pages(kv_cache, ids, pages):
    """Write n pages ([L, 2, ps, h, d] each) at page ids i32[n] of every layer (padding: the null page)."""
    x = jnp.stack(pages, axis=2)  # [L, 2, n, ps, h, d]
    return tuple((k.at[ids].set(x[i, 0]), v.at[ids].set(x[i, 1])) for i, (k, v) in enumerate(kv_cache))


class HostKVPool:
    def __init__(self, kv_cache, num_slots: int):
        k0 = kv_cache[0][0]  # [num_pages, ps, h, d]: every layer alike (no state layers with a host tier)
        if any(len(layer) != 2 or layer[0].shape != k0.shape for layer in kv_cache):
            raise ValueError("the host tier needs paged KV in every layer")
        self.num_slots = num_slots
        self.page_shape = (len(kv_cache), 2, *k0.shape[1:])  # [L, 2, ps, h, d]
        self.page_dtype = k0.dtype
        self.page_bytes = int(np.prod(self.page_shape)) * k0.dtype.itemsize  # over all devices
        sharding = k0.sharding
        spec = tuple(sharding.spec) + (None,) * (4 - len(sharding.spec))
        self.device_sharding = NamedSharding(sharding.mesh, PartitionSpec(None, None, *spec[1:]))
        device = next(iter(sharding.mesh.devices.flat))
        self.memory_kind = host_memory_kind(device)
        self.host_sharding = self.device_sharding.with_memory_kind(self.memory_kind) if self.memory_kind else None
        if self.memory_kind is None:
            log.warning("%s offers no host memory kind: the KV host tier keeps numpy copies (synchronous)",
                        device.platform)
        self.slots: list[jax.Array | np.ndarray | None] = [None] * num_slots
        kv_shardings = jax.tree.map(lambda a: a.sharding, kv_cache)
        self._gather = jax.jit(_gather_pages, static_argnames=("n",), out_shardings=self.device_sharding)
        self._scatter = jax.jit(_scatter_pages, donate_argnames=("kv_cache",), out_shardings=kv_shardings)
        self._zero = jax.device_put(np.zeros(self.page_shape, self.page_dtype), self.device_sharding)

    @property
    def num_used_slots(self) -> int:
        return sum(a is not None for a in self.slots)

    def _to_host(self, pages: list[jax.Array]) -> list:
        if self.host_sharding is None:
            return [np.asarray(p) for p in jax.device_get(pages)]
        return jax.device_put(pages, self.host_sharding)

    def apply(self, kv_cache, transfers: KVTransfers):
        """Launch the copies (offloads first, then restores); returns the new cache (the old one is donated)."""
        for chunk in _chunks(transfers.offloads):
            n = _bucket(len(chunk))
            ids = np.zeros(n, np.int32)
            ids[:len(chunk)] = [page for page, _ in chunk]
            pages = self._gather(kv_cache, ids, n=n)[:len(chunk)]
            for (_, slot), array in zip(chunk, self._to_host(list(pages)), strict=True):
                self.slots[slot] = array
        for chunk in _chunks(transfers.restores):
            n = _bucket(len(chunk))
            ids = np.zeros(n, np.int32)  # padding rows write zeros into the null page
            ids[:len(chunk)] = [page for _, page in chunk]
            pages = jax.device_put([self.slots[slot] for slot, _ in chunk], self.device_sharding)
            kv_cache = self._scatter(kv_cache, ids, tuple(pages) + (self._zero,) * (n - len(chunk)))
        return kv_cache

    def warmup(self, kv_cache):
        """Compile every chunk size (gathers and scatters of the null page); returns the new cache."""
        for n in transfer_buckets():
            ids = np.zeros(n, np.int32)
            self._gather(kv_cache, ids, n=n)
            kv_cache = self._scatter(kv_cache, ids, (self._zero,) * n)
        return kv_cache


def _bucket(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _chunks(items: list) -> list[list]:
    return [items[i:i + MAX_TRANSFER_PAGES] for i in range(0, len(items), MAX_TRANSFER_PAGES)]


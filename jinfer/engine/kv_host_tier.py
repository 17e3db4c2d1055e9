"""The host tier of the prefix cache: slots of host memory holding pages evicted from HBM (plain Python).

`KVCacheManager` drives it; the runner moves the bytes (`ModelRunner.transfer`). A slot holds one
page's KV over all layers, named by the same chained digest as in HBM, so a lookup walks the prefix
over both tiers. The tier has its own LRU (`_lru`, oldest first) and never holds a digest twice.

Every change a schedule makes is recorded as a transfer, and the runner replays them in one batch
before the step's forward (`take_transfers`):
- offload (HBM page -> slot): an HBM page with cached content was taken for reuse; its bytes go to a
  slot first. The runner launches the copy before anything that overwrites the page, and the device
  runs in order, so the copy reads the old contents. Content already in the tier is not copied again.
- restore (slot -> HBM page): a prefix lookup hit this tier; a fresh HBM page receives the slot's bytes
  before the step that reads them.
The runner applies a batch's offloads first, then its restores. So that this order is always right,
a slot that a batch reads or writes is pinned until the batch is taken: it is not reassigned inside
the batch (a restore never sees a slot rewritten after it was looked up). An offload that finds every
slot pinned is dropped (the content is simply lost, as without the tier).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class KVTransfers:
    """One schedule's copies between the tiers, in the order the runner applies them."""

    offloads: list[tuple[int, int]] = field(default_factory=list)  # (HBM page, host slot)
    restores: list[tuple[int, int]] = field(default_factory=list)  # (host slot, HBM page)

    def __bool__(self) -> bool:
        return bool(self.offloads or self.restores)


class HostTier:
    def __init__(self, num_slots: int):
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots={num_slots!r} must be an integer >= 1")
        self.num_slots = num_slots
        self._lru: OrderedDict[bytes, int] = OrderedDict()  # digest -> slot, least recently used first
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() takes the lowest
        self._pinned: set[int] = set()  # slots the pending batch reads or writes
        self._batch = KVTransfers()
        self.num_offloaded_pages = 0  # pages copied HBM -> host
        self.num_restored_pages = 0  # pages copied host -> HBM
        self.num_dropped_offloads = 0  # evictions not saved: every slot was pinned

    @property
    def num_used_slots(self) -> int:
        return len(self._lru)

    def lookup(self, digest: bytes) -> int | None:
        """The slot holding this content, or None. Changes nothing."""
        return self._lru.get(digest)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._lru

    def pin(self, slot: int) -> None:
        self._pinned.add(slot)

    def offload(self, page: int, digest: bytes) -> None:
        """HBM page `page` holding `digest` is about to be overwritten: keep its content here."""
        if digest in self._lru:  # already here (restored from here, or offloaded before): just fresher now
            self._lru.move_to_end(digest)
            return
        slot = self._free.pop() if self._free else self._evict()
        if slot is None:
            self.num_dropped_offloads += 1
            return
        self._lru[digest] = slot
        self._pinned.add(slot)
        self._batch.offloads.append((page, slot))
        self.num_offloaded_pages += 1

    def _evict(self) -> int | None:
        """Free the least recently used slot that the pending batch does not touch."""
        for digest, slot in self._lru.items():
            if slot not in self._pinned:
                del self._lru[digest]
                return slot
        return None

    def restore(self, digest: bytes, page: int) -> None:
        """Copy the slot holding `digest` into HBM page `page` (before the step that reads it)."""
        slot = self._lru[digest]
        self._lru.move_to_end(digest)
        self._pinned.add(slot)
        self._batch.restores.append((slot, page))
        self.num_restored_pages += 1

    def forget(self, slots: list[int]) -> None:
        """The runner dropped these slots' bytes (their host block was mostly dead: kv_transfer.py): free them."""
        gone = set(slots)
        for digest in [d for d, slot in self._lru.items() if slot in gone]:
            del self._lru[digest]
        self._free.extend(sorted(gone - set(self._free), reverse=True))

    def take_transfers(self) -> KVTransfers | None:
        """The pending batch (None if empty); its slots are unpinned."""
        batch, self._batch = self._batch, KVTransfers()
        self._pinned.clear()
        return batch or None

    def reset(self) -> None:
        """Forget every slot's content (a pending batch is still applied: its copies are harmless)."""
        self._lru.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))

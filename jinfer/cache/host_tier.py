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
Write-back: a cached HBM page whose last user lets go (`KVCacheManager.free`) is queued for an offload
then, not when it is evicted; once `write_back_pages` are waiting, the next batch copies them all. So the
copies leave on the steps that follow a request's end, and an eviction (a prefix restore making room, say)
usually finds the content already here and copies nothing: the restore's batch carries its host -> device
copies only (evicting at restore time put as many device -> host copies in front of them on PCIe: a 16k
restore waited for 1025 offloads). The price is copying pages that never get evicted (PCIe and host memory,
off the critical path); a waiting page taken for reuse is copied by its eviction as before. A write-back
takes a free slot, or else evicts only a slot whose content HBM holds too (`in_hbm`, among the oldest
`WRITE_BACK_SCAN`), and enters the LRU as its oldest entry, until HBM evicts the page (its offload then
finds it here and makes it the freshest). Evicting the only copy of some content, or keeping a second copy
of a page still in HBM fresh, shrank the two tiers' capacity from HBM + host towards the larger of the two:
random access to 6-12 prefixes of 8 pages, 16-64 HBM pages and 16-64 slots, hit rates 0.43-0.70 with
write-back evicting any slot and entering it as the freshest, 0.55-0.82 without write-back, 0.55-0.86 now
(`test_write_back_keeps_the_two_tiers_capacity`). With no such slot the page is left to its eviction-time
offload.
The runner applies a batch's offloads first, then its restores. So that this order is always right,
a slot that a batch reads or writes is pinned until the batch is taken: it is not reassigned inside
the batch (a restore never sees a slot rewritten after it was looked up). An offload that finds every
slot pinned is dropped (the content is simply lost, as without the tier).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice


@dataclass
class KVTransfers:
    """One schedule's copies between the tiers, in the order the runner applies them."""

    offloads: list[tuple[int, int]] = field(default_factory=list)  # (HBM page, host slot)
    restores: list[tuple[int, int]] = field(default_factory=list)  # (host slot, HBM page)

    def __bool__(self) -> bool:
        return bool(self.offloads or self.restores)


WRITE_BACK_PAGES = 64  # freed cached pages waiting for a write-back before the batch copies them (one block)
WRITE_BACK_SCAN = 64  # how many of the least recently used slots a write-back looks at for one it may evict


class HostTier:
    def __init__(self, num_slots: int, write_back_pages: int = WRITE_BACK_PAGES,
                 in_hbm: Callable[[bytes], bool] | None = None):
        """`in_hbm(digest)`: whether HBM holds that content too (a write-back may evict such a slot only)."""
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots={num_slots!r} must be an integer >= 1")
        if not isinstance(write_back_pages, int) or write_back_pages < 0:
            raise ValueError(f"write_back_pages={write_back_pages!r} must be an integer >= 0 (0: no write-back)")
        self.num_slots = num_slots
        self.write_back_pages = write_back_pages
        self._in_hbm = in_hbm
        self._waiting: OrderedDict[int, bytes] = OrderedDict()  # HBM page -> digest: freed, not yet written back
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

    def offload(self, page: int, digest: bytes, write_back: bool = False) -> None:
        """HBM page `page` holding `digest` is about to be overwritten (or, `write_back`, has no user left):
        keep its content here."""
        if digest in self._lru:  # already here (restored from here, or offloaded before): just fresher now
            self._lru.move_to_end(digest)
            return
        slot = self._free.pop() if self._free else self._evict(write_back)
        if slot is None:
            if not write_back:
                self.num_dropped_offloads += 1
            return
        self._lru[digest] = slot
        if write_back:  # a copy of content HBM still holds: first to go until HBM evicts it (then it is fresh)
            self._lru.move_to_end(digest, last=False)
        self._pinned.add(slot)
        self._batch.offloads.append((page, slot))
        self.num_offloaded_pages += 1

    def write_back(self, page: int, digest: bytes) -> None:
        """Cached HBM page `page` (holding `digest`) has no user left: copy it here with the next full batch."""
        if self.write_back_pages and digest not in self._lru:
            self._waiting[page] = digest

    def taken(self, page: int) -> None:
        """HBM page `page` is being reused: forget its pending write-back (its eviction offloads it if needed)."""
        self._waiting.pop(page, None)

    def _evict(self, write_back: bool = False) -> int | None:
        """Free the least recently used slot that the pending batch does not touch; for a write-back, only one
        among the oldest `WRITE_BACK_SCAN` whose content HBM holds too (module doc). None if there is none."""
        if write_back and self._in_hbm is None:
            return None
        candidates = islice(self._lru.items(), WRITE_BACK_SCAN) if write_back else self._lru.items()
        for digest, slot in candidates:
            if slot not in self._pinned and (not write_back or self._in_hbm(digest)):
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

    def take_transfers(self, flush: bool = False) -> KVTransfers | None:
        """The pending batch (None if empty), with the waiting write-backs once there are enough of them
        (or any, with `flush`: an idle engine copies them before the next request needs the room); its
        slots are unpinned."""
        if self._waiting and (flush or len(self._waiting) >= self.write_back_pages):
            for page, digest in self._waiting.items():
                self.offload(page, digest, write_back=True)
            self._waiting.clear()
        batch, self._batch = self._batch, KVTransfers()
        self._pinned.clear()
        return batch or None

    def reset(self) -> None:
        """Forget every slot's content (a pending batch is still applied: its copies are harmless)."""
        self._lru.clear()
        self._waiting.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))

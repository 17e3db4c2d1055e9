"""Paged KV cache allocator with automatic prefix caching (plain Python, host side).

The device KV cache is `[num_pages, page_size, ...]` per layer; this module only hands out page ids.

- Page 0 is reserved as the NULL page: never allocated, so the runner may point padding entries of
  the page table (and, if ever needed, padding slots) at it. Usable pages are 1..num_pages-1 and
  `num_free_pages`/`usage` count only those.
- Each request's page table is `request.page_ids`; a page may be shared by several requests
  (reference counted). A page whose reference count drops to 0 goes to the free queue.
- Prefix caching: a FULL page is named by a 128-bit blake2b digest chained over (parent page's
  digest, the page's token ids), so a digest names a whole prefix. Computed full pages are entered
  in a hash table (`cache_full_pages`); a new request reuses the pages of its longest cached prefix
  (`get_computed_pages`), but never its last token, which must be computed to produce a logit.
- Free queue order (front is taken first): pages holding no cached content are put at the front,
  so they are reused before anything cached; cached pages are appended at the back (LRU), a freed
  request's pages in reverse order so its tail goes before its shared-looking head. Taking a cached
  page from the front evicts it from the hash table.
- State slots (models with linear-attention layers, `num_state_slots` > 0): besides its pages, each
  admitted request holds one slot of the fixed-size per-sequence state pools (`request.state_slot`),
  taken at admission with its first pages and returned by `free` (finish, abort, preemption: a
  preempted request recomputes its state from position 0). Slot 0 is reserved for padding sequences.
  A state summarises a whole prefix and cannot be rebuilt from pages, so such models run without
  prefix caching (the engine turns it off). With speculative decoding (`state_pairs`) each slot s has a second
  slot past the others, and a request's state is in either of the pair (`request.state_slot`; `other_slot`): the
  device pool holds `num_device_state_slots`. A step verifying drafts reads one and writes the other, which becomes
  the request's where every draft was accepted (jinfer/engine/scheduler.py); the first takes the state after the row's
  known tokens, from which a rejection goes on.
- Host tier (`num_host_pages` > 0, `kv_host_tier.py`): a cached page freed by its last user is written
  back to a host slot (in batches), and one taken from the free queue for reuse first has its content
  offloaded if it is not there yet, and a prefix lookup continues into the host tier
  where HBM misses. A host hit appears in `get_computed_pages`' list as `-1 - slot`; `allocate_slots`
  gives it a fresh HBM page (after reviving the HBM hits, so it never evicts one of them), records the
  restore, and enters the page in the HBM hash table at once (the copy is launched before any step
  that reads it). The schedule hands the recorded copies to the runner (`take_transfers`).
- KV events (`events` a list, kv_events.py): a page entering the HBM hash table is a BlockStored (consecutive pages
  of one request in one event), its eviction a BlockRemoved, `reset_prefix_cache` AllBlocksCleared; the engine
  takes them after each step (`take_events`). None (the default): nothing is recorded.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from jinfer.cache.host_tier import HostTier, KVTransfers
from jinfer.cache.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, block_hash
from jinfer.engine.request import Request

NULL_PAGE = 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _page_digest(parent: bytes, token_bytes: bytes) -> bytes:
    return hashlib.blake2b(parent + token_bytes, digest_size=16).digest()


def hash_page(parent: bytes, token_ids: list[int]) -> bytes:
    """128-bit digest of a full page given its parent's digest (b"" for the first page)."""
    return _page_digest(parent, array("q", token_ids).tobytes())


class KVCacheManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True, num_state_slots: int = 0,
                 num_host_pages: int = 0, hit_drop_last_page: bool = False, state_pairs: bool = False):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages} must be >= 2 (page 0 is the reserved null page)")
        if page_size < 1:
            raise ValueError(f"page_size={page_size} must be >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        # An EAGLE-3 head's KV at a page's last position depends on the next page's first token: a hit is one
        # page shorter, that page recomputed (jinfer/spec/eagle.py)
        self.hit_drop_last_page = hit_drop_last_page
        self._ref_cnt = [0] * num_pages
        self._page_hash: list[bytes | None] = [None] * num_pages
        self._hash_to_page: dict[bytes, int] = {}
        # Pages with ref count 0, in reuse order (front first); values unused.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_pages))
        # request_id -> number of leading pages of its table already looked at by cache_full_pages.
        self._num_registered: dict[str, int] = {}
        self.num_query_tokens = 0  # prefix-cache stats, counted once per admission
        self.num_hit_tokens = 0  # hits in HBM
        self.num_host_hit_tokens = 0  # hits in the host tier (restored)
        self.events: list | None = None  # KV events since the last take_events; None: not recorded
        if num_host_pages and not enable_prefix_caching:
            raise ValueError(f"num_host_pages={num_host_pages} needs enable_prefix_caching=True (the host tier holds "
                             "pages evicted from the prefix cache)")
        self.host = HostTier(num_host_pages, in_hbm=self._hash_to_page.__contains__) if num_host_pages else None
        if num_state_slots == 1 or num_state_slots < 0:
            raise ValueError(f"num_state_slots={num_state_slots} must be 0 (no state layers) or >= 2 (slot 0 is "
                             "reserved)")
        if num_state_slots and enable_prefix_caching:
            raise ValueError("enable_prefix_caching=True needs states checkpointed at page boundaries, which "
                             "models with per-sequence state slots do not have")
        self.num_state_slots = num_state_slots
        self.state_pairs = state_pairs and bool(num_state_slots)
        self._free_slots: list[int] = list(range(num_state_slots - 1, 0, -1))  # pop() takes the lowest

    # ---- pool state ----------------------------------------------------------------------------

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        """Pages not referenced by any request (cached ones included: they are evictable)."""
        return len(self._free)

    @property
    def num_cached_pages(self) -> int:
        return len(self._hash_to_page)

    @property
    def usage(self) -> float:
        """Fraction of usable pages referenced by requests."""
        return 1.0 - self.num_free_pages / self.num_usable_pages

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hits in either tier, over prompt tokens looked up."""
        hits = self.num_hit_tokens + self.num_host_hit_tokens
        return hits / self.num_query_tokens if self.num_query_tokens else 0.0

    def ref_count(self, page: int) -> int:
        return self._ref_cnt[page]

    def pages_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.page_size)

    # ---- prefix cache --------------------------------------------------------------------------

    def _update_hashes(self, request: Request, num_pages: int) -> list[bytes]:
        """Extend `request.page_hashes` to cover its first `num_pages` full pages."""
        hashes, ps = request.page_hashes, self.page_size
        start = len(hashes)
        if start >= num_pages:
            return hashes
        # hash_page over all the pages at once: one conversion to bytes, then slices of it (the first token
        # of a 32k-token prompt waits for these 2k digests)
        data = array("q", request.all_token_ids[start * ps:num_pages * ps]).tobytes()
        step = ps * 8
        parent = hashes[-1] if hashes else b""
        for i in range(num_pages - start):
            parent = _page_digest(parent, data[i * step:(i + 1) * step])
            hashes.append(parent)
        return hashes

    def get_computed_pages(self, request: Request) -> tuple[list[int], int]:
        """Pages of the longest cached prefix of a request about to be admitted, and its token count.

        Never covers the request's last token. Changes nothing: pass the pages to `allocate_slots`.
        With a host tier, a page found only there is `-1 - its slot`.
        """
        assert not request.page_ids and request.num_computed_tokens == 0, request.request_id
        if not self.enable_prefix_caching:
            return [], 0
        max_pages = (request.num_tokens - 1) // self.page_size
        pages = []
        for h in self._update_hashes(request, max_pages):
            page = self._hash_to_page.get(h)
            if page is None:
                slot = self.host.lookup(h) if self.host is not None else None
                if slot is None:
                    break
                page = -1 - slot
            pages.append(page)
        if self.hit_drop_last_page:
            pages = pages[:-1]
        return pages, len(pages) * self.page_size

    def cache_full_pages(self, request: Request) -> None:
        """Enter the request's full, computed pages (first num_computed_tokens tokens) in the cache.

        Only known tokens count (not one still pending on the device); a page whose KV a launched step
        is still writing may be entered: any step that reads it runs after that one on the device.
        """
        if not self.enable_prefix_caching:
            return
        known = min(request.num_computed_tokens, request.num_tokens)
        num_full = min(known // self.page_size, len(request.page_ids))
        start = self._num_registered.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._update_hashes(request, num_full)
        stored = []
        for i in range(start, num_full):
            page, h = request.page_ids[i], hashes[i]
            # Skip pages already cached (prefix hits) and content another page already holds (two
            # requests computed the same prefix at once): that page simply stays uncached.
            if self._page_hash[page] is None and h not in self._hash_to_page:
                self._page_hash[page] = h
                self._hash_to_page[h] = page
                stored.append(i)
        self._num_registered[request.request_id] = num_full
        if self.events is not None and stored:
            self._stored_events(request, stored)

    def _stored_events(self, request: Request, indices: list[int]) -> None:
        """BlockStored events for the request's pages at these (ascending) indices: one per consecutive run, its
        parent the page before the run."""
        hashes, ps = request.page_hashes, self.page_size
        first = prev = indices[0]
        for i in [*indices[1:], None]:
            if i is not None and i == prev + 1:
                prev = i
                continue
            parent = block_hash(hashes[first - 1]) if first else None
            self.events.append(BlockStored([block_hash(h) for h in hashes[first:prev + 1]], parent,
                                           request.all_token_ids[first * ps:(prev + 1) * ps], ps, None, MEDIUM_GPU))
            first = prev = i

    def take_events(self) -> list:
        """The KV events recorded since the last call (oldest first); [] when not recording."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    def reset_prefix_cache(self) -> None:
        """Forget all cached content, in both tiers (e.g. after weights change). Pages in use stay allocated."""
        self._hash_to_page.clear()
        self._page_hash = [None] * self.num_pages
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        if self.host is not None:
            self.host.reset()

    def take_transfers(self, flush: bool = False) -> KVTransfers | None:
        """The copies between tiers recorded since the last call (the schedule hands them to the runner);
        `flush`: with every write-back still waiting (kv_host_tier.py)."""
        return self.host.take_transfers(flush) if self.host is not None else None

    # ---- allocation ----------------------------------------------------------------------------

    def _take_free_page(self) -> int:
        page, _ = self._free.popitem(last=False)
        h = self._page_hash[page]
        if h is not None:  # evict its cached content (to the host tier, if there is one)
            if self.host is not None:
                self.host.taken(page)
                self.host.offload(page, h)
            self._page_hash[page] = None
            if self._hash_to_page.get(h) == page:
                del self._hash_to_page[h]
                if self.events is not None:  # consecutive evictions share one event
                    last = self.events[-1] if self.events else None
                    if isinstance(last, BlockRemoved):
                        last.block_hashes.append(block_hash(h))
                    else:
                        self.events.append(BlockRemoved([block_hash(h)], MEDIUM_GPU))
        self._ref_cnt[page] = 1
        return page

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_pages: list[int] | None = None) -> bool:
        """Grow the request's page table to hold `num_new_tokens` more tokens; False if the pool is short.

        At admission pass `computed_pages` from `get_computed_pages` (possibly []): they become the
        head of the page table (the new tokens start after them) and the prefix-cache query is counted.
        On False nothing changed (the caller preempts someone or waits).
        """
        if computed_pages is None:  # a running request: most steps need no new page
            num_tokens = request.num_computed_tokens + num_new_tokens
            num_fresh = -(-num_tokens // self.page_size) - len(request.page_ids)
            if num_fresh <= 0:
                return True
            computed = []
        else:
            assert not request.page_ids and request.num_computed_tokens == 0, request.request_id
            computed = computed_pages
            num_tokens = len(computed) * self.page_size + num_new_tokens
            num_fresh = max(0, self.pages_needed(num_tokens) - len(computed))
        # Cached pages with no users sit in the free queue; reusing them takes them out of it. A host hit
        # (< 0) takes a fresh page.
        num_revived = sum(1 for p in computed if p < 0 or self._ref_cnt[p] == 0)
        if num_fresh + num_revived > self.num_free_pages:
            return False
        if computed_pages is not None and self.num_state_slots:
            if not self._free_slots:
                return False
            request.state_slot = self._free_slots.pop()
        num_restored = 0
        for p in computed:  # HBM hits first: taking pages for the host hits must not evict one of them
            if p < 0:
                self.host.pin(-1 - p)  # nor may their offloads reuse a slot about to be read
                num_restored += 1
                continue
            if self._ref_cnt[p] == 0:
                del self._free[p]
            self._ref_cnt[p] += 1
        if num_restored:
            restored = [i for i, p in enumerate(computed) if p < 0]
            computed = [p if p >= 0 else self._restore(request.page_hashes[i]) for i, p in enumerate(computed)]
            if self.events is not None:  # host hits enter the HBM cache
                self._stored_events(request, restored)
        request.page_ids.extend(computed)
        request.page_ids.extend(self._take_free_page() for _ in range(num_fresh))
        if computed_pages is not None:
            self.num_query_tokens += request.num_tokens
            self.num_hit_tokens += (len(computed) - num_restored) * self.page_size
            self.num_host_hit_tokens += num_restored * self.page_size
            if computed:
                self._num_registered[request.request_id] = len(computed)
        return True

    def fork(self, parent: Request, child: Request, num_tokens: int
             ) -> tuple[tuple[int, int] | None, tuple[int, int] | None] | None:
        """Admit `child` holding `parent`'s first `num_tokens` computed tokens (n > 1 samples of one prompt): the
        parent's full pages among them are shared (reference counted: nobody writes them again), the page holding
        the rest and the state slot (models with one) are fresh. Returns the copies the runner makes before the
        next step, (parent page, child page) or None, (parent slot, child slot) or None; None if the pool is
        short of a page or a slot (nothing changed). Not with a host tier: its restores, launched first, could
        overwrite the parent's page before the copy reads it (a page the parent freed in the same schedule)."""
        assert not child.page_ids and child.num_computed_tokens == 0 and parent.num_computed_tokens >= num_tokens
        assert self.host is None, "forks are not combined with the host tier"
        full, part = divmod(num_tokens, self.page_size)
        if (part and not self.num_free_pages) or (self.num_state_slots and not self._free_slots):
            return None
        shared = parent.page_ids[:full]
        for page in shared:  # held by the parent: not in the free queue
            self._ref_cnt[page] += 1
        child.page_ids = list(shared)
        page_copy = slot_copy = None
        if part:
            child.page_ids.append(self._take_free_page())
            page_copy = (parent.page_ids[full], child.page_ids[-1])
        if self.num_state_slots:
            child.state_slot = self._free_slots.pop()
            slot_copy = (parent.state_slot, child.state_slot)
        return page_copy, slot_copy

    def _restore(self, digest: bytes) -> int:
        """A fresh page receiving `digest`'s content from the host tier, entered in the HBM cache at once."""
        page = self._take_free_page()
        self.host.restore(digest, page)
        self._page_hash[page] = digest
        self._hash_to_page[digest] = page
        return page

    def free(self, request: Request) -> None:
        """Drop the request's references; pages nobody else uses return to the free queue."""
        for page in reversed(request.page_ids):
            self._ref_cnt[page] -= 1
            assert self._ref_cnt[page] >= 0, page
            if self._ref_cnt[page] == 0:
                self._free[page] = None
                if self._page_hash[page] is None:
                    self._free.move_to_end(page, last=False)
                elif self.host is not None:  # copy it to the host tier ahead of its eviction
                    self.host.write_back(page, self._page_hash[page])
        request.page_ids = []  # a new list: a ScheduledRequest may still hold the old one
        self._num_registered.pop(request.request_id, None)
        if request.state_slot:  # (the first slot of its pair, whichever holds its state)
            self._free_slots.append(min(request.state_slot, self.other_slot(request.state_slot)))
            request.state_slot = 0

    def other_slot(self, slot: int) -> int:
        """The other device slot of slot `slot`'s pair (`state_pairs`; module doc)."""
        n = self.num_state_slots - 1
        return slot + n if slot <= n else slot - n

    @property
    def num_device_state_slots(self) -> int:
        """State slots the device pools hold: the slots, and with `state_pairs` a second one of each but slot 0."""
        return 2 * self.num_state_slots - 1 if self.state_pairs else self.num_state_slots

    @property
    def num_free_state_slots(self) -> int:
        return len(self._free_slots)

"""The host tier of the prefix cache (page accounting, LRU, recorded transfers), with exact page ids and slots."""

import pytest

from jinfer.cache.host_tier import HostTier, KVTransfers
from jinfer.cache.manager import KVCacheManager
from jinfer.engine.request import Request

from .test_kv_cache_manager import PS, admit, compute_all, make_req


def finish(kv: KVCacheManager, req: Request) -> None:
    compute_all(kv, req)
    kv.free(req)


def test_eviction_offloads_and_a_host_hit_restores():
    kv = KVCacheManager(num_pages=5, page_size=PS, num_host_pages=8)  # 4 usable pages
    a = make_req("a", range(13))  # 3 full pages + 1 token
    admit(kv, a)
    assert a.page_ids == [1, 2, 3, 4]
    finish(kv, a)  # pages 1-3 cached; 4 (partial) free at the front
    assert kv.take_transfers() is None
    b = make_req("b", range(100, 113))  # needs all 4 pages: evicts a's three cached pages
    admit(kv, b)
    t = kv.take_transfers()
    # taken from the front of the free queue: 4 (uncached), then a's tail first: 3, 2, 1
    assert b.page_ids == [4, 3, 2, 1]
    assert t.offloads == [(3, 0), (2, 1), (1, 2)] and t.restores == []
    assert kv.host.num_used_slots == 3 and kv.num_cached_pages == 0
    finish(kv, b)
    kv.take_transfers()

    a2 = make_req("a2", list(range(12)) + [99])  # a's three pages, found in the host tier only
    pages, cached = kv.get_computed_pages(a2)
    assert pages == [-1 - 2, -1 - 1, -1 - 0] and cached == 12
    assert kv.allocate_slots(a2, 1, pages)
    t = kv.take_transfers()
    # the restores take pages from the free queue (b's uncached page 1 first, then b's tail first),
    # evicting b's cached pages to the host tier
    assert t.restores == [(2, 1), (1, 2), (0, 3)] and a2.page_ids == [1, 2, 3, 4]
    assert t.offloads == [(2, 3), (3, 4), (4, 5)]
    assert kv.num_host_hit_tokens == 12 and kv.num_hit_tokens == 0
    assert kv.prefix_cache_hit_rate == pytest.approx((12) / (13 + 13 + 13))
    # the restored pages are in the HBM cache at once: a sibling (n > 1) shares them
    sib = make_req("sib", a2.prompt_token_ids)
    pages, cached = kv.get_computed_pages(sib)
    assert pages == a2.page_ids[:3] and cached == 12
    assert kv.take_transfers() is None
    kv.free(a2)
    assert kv.num_free_pages == kv.num_usable_pages


def test_freed_cached_pages_are_written_back_before_their_eviction():
    kv = KVCacheManager(num_pages=6, page_size=PS, num_host_pages=8)  # 5 usable pages
    kv.host.write_back_pages = 3
    a = make_req("a", range(9))  # 2 full pages + 1 token
    admit(kv, a)
    finish(kv, a)
    assert kv.take_transfers() is None  # 2 waiting: fewer than a batch
    c = make_req("c", range(50, 59))
    admit(kv, c)
    finish(kv, c)  # 4 waiting now: the next batch copies them all, while they stay cached in HBM
    t = kv.take_transfers()
    assert t.offloads == [(2, 0), (1, 1), (4, 2), (3, 3)] and t.restores == []
    assert kv.num_cached_pages == 4 and kv.get_computed_pages(make_req("a1", range(9)))[0] == [1, 2]
    b = make_req("b", range(100, 117))  # 4 full pages + 1: evicts all four, copying nothing more
    admit(kv, b)
    assert kv.take_transfers() is None and kv.num_cached_pages == 0
    kv.free(b)
    a2 = make_req("a2", list(range(8)) + [7, 7])  # a's pages, found in the host tier
    pages, cached = kv.get_computed_pages(a2)
    assert pages == [-1 - 1, -1 - 0] and cached == 8
    assert kv.allocate_slots(a2, 2, pages)
    t = kv.take_transfers()
    assert [slot for slot, _ in t.restores] == [1, 0] and t.offloads == []
    # a page waiting for its write-back that is taken for reuse is offloaded by its eviction, once
    kv2 = KVCacheManager(num_pages=4, page_size=PS, num_host_pages=8)
    kv2.host.write_back_pages = 8
    d = make_req("d", range(9))
    admit(kv2, d)
    finish(kv2, d)
    admit(kv2, make_req("e", range(70, 79)))  # takes the free page 3, then d's tail (2), then 1
    t = kv2.take_transfers()
    assert t.offloads == [(2, 0), (1, 1)] and not kv2.host._waiting


def test_restore_never_evicts_the_requests_own_hbm_hits():
    kv = KVCacheManager(num_pages=4, page_size=PS, num_host_pages=8)  # 3 usable pages
    a = make_req("a", range(9))  # 2 full pages
    admit(kv, a)
    finish(kv, a)  # cached: page 1 (h0), 2 (h1); page 3 free (front)
    # evict only page 2 (a's tail): c takes 3 then 2
    c = make_req("c", range(200, 205))
    admit(kv, c)
    assert c.page_ids == [3, 2]
    kv.take_transfers()
    kv.free(c)
    # a's prefix: page 1 in HBM (free, cached), page for h1 in the host tier; 2 free pages (3, 2 uncached)
    a2 = make_req("a2", list(range(8)) + [50])
    pages, _ = kv.get_computed_pages(a2)
    assert pages[0] == 1 and pages[1] < 0
    assert kv.allocate_slots(a2, 1, pages)
    assert a2.page_ids[0] == 1 and 1 not in a2.page_ids[1:] and kv.ref_count(1) == 1
    t = kv.take_transfers()
    assert t.offloads == [] and len(t.restores) == 1


def test_allocation_failure_with_host_hits_changes_nothing():
    kv = KVCacheManager(num_pages=5, page_size=PS, num_host_pages=8)
    a = make_req("a", range(13))
    admit(kv, a)
    finish(kv, a)
    hog = make_req("hog", range(100, 113))
    admit(kv, hog)  # a's pages go to the host tier; no free page is left
    kv.take_transfers()
    a2 = make_req("a2", list(range(12)) + [7])
    pages, _ = kv.get_computed_pages(a2)
    assert all(p < 0 for p in pages)
    assert not kv.allocate_slots(a2, 1, pages)
    assert a2.page_ids == [] and kv.take_transfers() is None and kv.num_host_hit_tokens == 0
    kv.free(hog)
    assert kv.num_free_pages == kv.num_usable_pages


def test_host_pool_bound_and_lru():
    tier = HostTier(3)
    for i in range(5):
        tier.offload(10 + i, bytes([i]))
        tier.take_transfers()
    assert tier.num_used_slots == 3 and tier.lookup(bytes([0])) is None and tier.lookup(bytes([1])) is None
    assert {tier.lookup(bytes([i])) for i in (2, 3, 4)} == {0, 1, 2}
    # a hit refreshes: digest 2 survives the next eviction, 3 goes
    tier.restore(bytes([2]), 7)
    tier.take_transfers()
    tier.offload(20, bytes([9]))
    assert tier.lookup(bytes([3])) is None and tier.lookup(bytes([2])) is not None
    assert tier.num_offloaded_pages == 6 and tier.num_restored_pages == 1
    # content already in the tier is not copied again
    tier.take_transfers()
    tier.offload(21, bytes([9]))
    assert tier.take_transfers() is None and tier.num_used_slots == 3


def test_write_back_evicts_only_content_hbm_holds_too():
    # a full tier: a write-back (a copy of a page still in HBM) may not push out content that only the tier
    # holds; it takes the slot of content HBM holds too, or nothing
    in_hbm = {b"dup"}
    tier = HostTier(2, write_back_pages=1, in_hbm=in_hbm.__contains__)
    tier.offload(1, b"only-here")
    tier.offload(2, b"dup")
    tier.take_transfers()
    tier.write_back(3, b"w1")
    t = tier.take_transfers()
    assert t.offloads == [(3, 1)] and tier.lookup(b"dup") is None and tier.lookup(b"only-here") == 0
    in_hbm.add(b"w1")
    tier.write_back(4, b"w2")  # no slot left whose content HBM holds but w1's
    assert tier.take_transfers().offloads == [(4, 1)] and tier.lookup(b"w1") is None
    in_hbm.clear()
    tier.write_back(5, b"w3")  # none: the page is left to its eviction (an offload evicts the LRU as usual)
    assert tier.take_transfers() is None and tier.lookup(b"only-here") == 0 and tier.num_dropped_offloads == 0
    tier.offload(5, b"w3")  # a written-back copy is the oldest entry (until HBM's eviction refreshes it)
    assert tier.take_transfers().offloads == [(5, 1)] and tier.lookup(b"w2") is None
    tier.offload(6, b"only-here")  # HBM evicting content the tier holds: no copy, and it becomes the freshest
    tier.offload(7, b"w4")
    assert tier.take_transfers().offloads == [(7, 1)] and tier.lookup(b"only-here") == 0


def test_write_back_keeps_the_two_tiers_capacity():
    # 6 prefixes of 8 pages, accessed at random, 3x more than HBM (16 pages) or the tier (16 slots) hold: with
    # write-back going idle after each request, the hit rate is at least what eviction-time offloads alone
    # give (0.55; write-back evicting any slot for a copy kept fresh: 0.43)
    import random

    def hit_rate(write_back: int) -> float:
        kv = KVCacheManager(num_pages=17, page_size=PS, num_host_pages=16)
        kv.host.write_back_pages = write_back
        rng = random.Random(0)
        for i in range(600):
            p = rng.randrange(6)
            r = make_req(f"r{i}", list(range(1000 * p, 1000 * p + 8 * PS)) + [7])
            admit(kv, r)
            finish(kv, r)
            kv.take_transfers(flush=True)
        return kv.prefix_cache_hit_rate

    without, with_wb = hit_rate(0), hit_rate(1)
    assert without > 0.5 and with_wb >= without, (without, with_wb)


def test_slots_of_a_pending_batch_are_never_reassigned_within_it():
    tier = HostTier(2)
    tier.offload(1, b"a")
    tier.offload(2, b"b")
    tier.offload(3, b"c")  # both slots pinned by this batch: dropped
    assert tier.num_dropped_offloads == 1 and tier.lookup(b"c") is None
    assert tier.take_transfers() == KVTransfers([(1, 0), (2, 1)], [])
    tier.restore(b"a", 5)  # slot 0 read by this batch
    tier.offload(6, b"d")  # must take slot 1 (b's), not slot 0
    t = tier.take_transfers()
    assert t.restores == [(0, 5)] and t.offloads == [(6, 1)] and tier.lookup(b"a") == 0


def test_preempted_request_with_restored_pages_frees_everything():
    kv = KVCacheManager(num_pages=6, page_size=PS, num_host_pages=4)
    a = make_req("a", range(9))
    admit(kv, a)
    finish(kv, a)
    filler = make_req("f", range(300, 320))  # 5 pages: evicts a's 2 cached pages to the host
    admit(kv, filler)
    kv.take_transfers()
    kv.free(filler)
    a2 = make_req("a2", list(range(8)) + [1, 2])
    admit(kv, a2)
    assert kv.take_transfers().restores and kv.num_host_hit_tokens == 8
    kv.free(a2)  # preemption or abort right after the restore was recorded
    assert kv.num_free_pages == kv.num_usable_pages and kv.num_cached_pages >= 2
    # re-admission hits HBM now (the restored pages stayed cached)
    a3 = make_req("a3", list(range(8)) + [1, 2])
    pages, cached = kv.get_computed_pages(a3)
    assert cached == 8 and all(p > 0 for p in pages)


def test_host_tier_validation_and_reset():
    with pytest.raises(ValueError, match="num_host_pages"):
        KVCacheManager(num_pages=5, page_size=PS, enable_prefix_caching=False, num_host_pages=4)
    with pytest.raises(ValueError, match="num_slots"):
        HostTier(0)
    kv = KVCacheManager(num_pages=5, page_size=PS, num_host_pages=4)
    a = make_req("a", range(13))
    admit(kv, a)
    finish(kv, a)
    admit(kv, make_req("b", range(100, 113)))
    kv.take_transfers()
    assert kv.host.num_used_slots == 3
    kv.reset_prefix_cache()
    assert kv.host.num_used_slots == 0 and kv.get_computed_pages(make_req("c", range(13)))[1] == 0

"""Page allocator and prefix cache, with exact page ids (page 0 is the reserved null page)."""

import pytest

from jinfer.cache.manager import NULL_PAGE, KVCacheManager, hash_page
from jinfer.engine.request import Request

PS = 4  # page size


def make_req(rid: str, tokens) -> Request:
    return Request(rid, list(tokens))


def admit(kv: KVCacheManager, req: Request) -> tuple[list[int], int]:
    """Admission as the scheduler does it: prefix lookup, then allocate the rest of the prompt."""
    pages, num_cached = kv.get_computed_pages(req)
    assert kv.allocate_slots(req, req.num_tokens - num_cached, pages)
    req.num_computed_tokens = num_cached
    return pages, num_cached


def compute_all(kv: KVCacheManager, req: Request) -> None:
    """Pretend the model computed every known token, and cache the full pages."""
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_pages(req)


def test_allocation_order_and_growth():
    kv = KVCacheManager(num_pages=9, page_size=PS)
    assert kv.num_usable_pages == 8 and kv.num_free_pages == 8 and kv.usage == 0.0
    a, b = make_req("a", range(10)), make_req("b", range(100, 105))
    admit(kv, a)
    assert a.page_ids == [1, 2, 3]
    admit(kv, b)
    assert b.page_ids == [4, 5]
    assert kv.num_free_pages == 3 and kv.usage == pytest.approx(5 / 8)
    # Decode steps: tokens 10 and 11 still fit page 3; token 12 needs a fresh page.
    a.num_computed_tokens = 10
    assert kv.allocate_slots(a, 1) and a.page_ids == [1, 2, 3]
    a.num_computed_tokens = 12
    assert kv.allocate_slots(a, 1) and a.page_ids == [1, 2, 3, 6]
    assert NULL_PAGE not in a.page_ids + b.page_ids


def test_allocate_fails_without_side_effects():
    kv = KVCacheManager(num_pages=9, page_size=PS)
    a = make_req("a", range(33))  # 9 pages > 8 usable
    assert not kv.allocate_slots(a, 33, [])
    assert a.page_ids == [] and kv.num_free_pages == 8 and kv.num_query_tokens == 0
    b = make_req("b", range(32))
    assert kv.allocate_slots(b, 32, [])
    assert b.page_ids == list(range(1, 9)) and kv.num_free_pages == 0 and kv.usage == 1.0


def test_prefix_reuse_exact_pages_and_hit_counts():
    kv = KVCacheManager(num_pages=9, page_size=PS)
    a = make_req("a", range(10))
    admit(kv, a)
    compute_all(kv, a)
    assert kv.num_cached_pages == 2  # pages 1 and 2 are full; page 3 holds 2 tokens
    b = make_req("b", [*range(8), 100, 101, 102])
    pages, num_cached = admit(kv, b)
    assert (pages, num_cached) == ([1, 2], 8)
    assert b.page_ids == [1, 2, 4]
    assert [kv.ref_count(p) for p in (1, 2, 3, 4)] == [2, 2, 1, 1]
    assert (kv.num_query_tokens, kv.num_hit_tokens) == (10 + 11, 8)
    assert kv.prefix_cache_hit_rate == pytest.approx(8 / 21)
    # A prefix shared only in its first page.
    c = make_req("c", [0, 1, 2, 3, 9, 9, 9, 9, 9])
    assert kv.get_computed_pages(c) == ([1], 4)


def test_never_the_last_token():
    kv = KVCacheManager(num_pages=9, page_size=PS)
    a = make_req("a", range(8))
    admit(kv, a)
    compute_all(kv, a)
    assert kv.num_cached_pages == 2
    # Same 8 tokens: the last page would cover the last token, so only page 1 is reused.
    assert kv.get_computed_pages(make_req("b", range(8))) == ([1], 4)
    assert kv.get_computed_pages(make_req("c", range(9))) == ([1, 2], 8)
    assert kv.get_computed_pages(make_req("d", range(4))) == ([], 0)
    assert kv.get_computed_pages(make_req("e", range(5))) == ([1], 4)


def test_free_order_and_ref_counts():
    kv = KVCacheManager(num_pages=9, page_size=PS)
    a = make_req("a", range(10))
    admit(kv, a)
    compute_all(kv, a)  # pages 1, 2 cached
    b = make_req("b", [*range(8), 50])
    admit(kv, b)
    assert b.page_ids == [1, 2, 4]
    kv.free(a)
    assert a.page_ids == []
    assert [kv.ref_count(p) for p in (1, 2, 3)] == [1, 1, 0]
    assert kv.num_free_pages == 5
    kv.free(b)
    assert kv.num_free_pages == 8 and kv.usage == 0.0
    # Uncached pages are reused first (4, 3), then never-used ones, then cached ones oldest-first;
    # a request's pages were queued tail first (2 before 1).
    d = make_req("d", range(1000, 1032))
    assert kv.allocate_slots(d, 32, [])
    assert d.page_ids == [4, 3, 5, 6, 7, 8, 2, 1]
    assert kv.num_cached_pages == 0  # taking 2 and 1 evicted them
    assert kv.get_computed_pages(make_req("e", range(10))) == ([], 0)


def test_lru_eviction_under_pressure():
    kv = KVCacheManager(num_pages=9, page_size=PS)
    a, b = make_req("a", range(9)), make_req("b", range(100, 109))
    admit(kv, a)
    assert a.page_ids == [1, 2, 3]
    compute_all(kv, a)
    kv.free(a)  # free queue: 3 4 5 6 7 8 | 2 1
    admit(kv, b)
    assert b.page_ids == [3, 4, 5]
    compute_all(kv, b)
    kv.free(b)  # free queue: 5 6 7 8 | 2 1 4 3
    assert kv.num_cached_pages == 4
    c = make_req("c", range(500, 520))  # 5 fresh pages: the 4 never-cached ones, then evicts page 2
    admit(kv, c)
    assert c.page_ids == [5, 6, 7, 8, 2]
    assert kv.num_cached_pages == 3
    assert kv.get_computed_pages(make_req("a2", range(9))) == ([1], 4)  # a lost its second page
    assert kv.get_computed_pages(make_req("b2", range(100, 109))) == ([3, 4], 8)


def test_reviving_cached_pages_counts_against_free_pages():
    kv = KVCacheManager(num_pages=9, page_size=PS)
    a = make_req("a", range(9))
    admit(kv, a)
    compute_all(kv, a)
    kv.free(a)  # free queue: 3 4 5 6 7 8 | 2 1
    x = make_req("x", range(200, 224))
    admit(kv, x)
    assert x.page_ids == [3, 4, 5, 6, 7, 8]
    # Only cached pages 2 and 1 are free. Reusing 1 and 2 plus a fresh page needs 3: refused.
    b = make_req("b", [*range(8), 42])
    pages, _ = kv.get_computed_pages(b)
    assert pages == [1, 2]
    assert not kv.allocate_slots(b, 1, pages)
    assert b.page_ids == [] and kv.num_free_pages == 2 and kv.ref_count(1) == 0
    # The same 8 tokens: reuses page 1, takes page 2 as a fresh page (evicting it) for tokens 4..7.
    c = make_req("c", range(8))
    assert admit(kv, c) == ([1], 4)
    assert c.page_ids == [1, 2] and kv.num_free_pages == 0
    compute_all(kv, c)
    assert kv.get_computed_pages(make_req("d", range(9))) == ([1, 2], 8)  # c re-cached page 2


def test_duplicate_prefix_computed_concurrently():
    kv = KVCacheManager(num_pages=9, page_size=PS)
    a, b = make_req("a", range(9)), make_req("b", range(9))
    admit(kv, a)
    admit(kv, b)  # nothing cached yet
    assert (a.page_ids, b.page_ids) == ([1, 2, 3], [4, 5, 6])
    compute_all(kv, a)
    compute_all(kv, b)  # same content as a's pages: stays uncached
    assert kv.num_cached_pages == 2
    kv.free(b)
    kv.free(a)
    assert kv.num_cached_pages == 2
    assert kv.get_computed_pages(make_req("c", range(9))) == ([1, 2], 8)


def test_generated_tokens_are_cached_and_incremental_registration():
    kv = KVCacheManager(num_pages=9, page_size=PS)
    a = make_req("a", range(6))
    admit(kv, a)
    compute_all(kv, a)
    assert kv.num_cached_pages == 1
    a.append_output_token(70)
    a.append_output_token(71)  # 8 tokens, 7 computed: page 2 not full of computed tokens yet
    a.num_computed_tokens = 7
    assert kv.allocate_slots(a, 1)
    kv.cache_full_pages(a)
    assert kv.num_cached_pages == 1
    a.num_computed_tokens = 8
    kv.cache_full_pages(a)
    assert kv.num_cached_pages == 2
    assert a.page_hashes[1] == hash_page(hash_page(b"", [0, 1, 2, 3]), [4, 5, 70, 71])
    b = make_req("b", [0, 1, 2, 3, 4, 5, 70, 71, 5])
    assert kv.get_computed_pages(b) == (a.page_ids[:2], 8)


def test_reset_prefix_cache_and_disabled_caching():
    kv = KVCacheManager(num_pages=9, page_size=PS)
    a = make_req("a", range(9))
    admit(kv, a)
    compute_all(kv, a)
    kv.reset_prefix_cache()
    assert kv.num_cached_pages == 0
    assert kv.get_computed_pages(make_req("b", range(9))) == ([], 0)
    kv.free(a)
    assert kv.num_free_pages == 8

    kv = KVCacheManager(num_pages=9, page_size=PS, enable_prefix_caching=False)
    a = make_req("a", range(9))
    admit(kv, a)
    compute_all(kv, a)
    assert kv.num_cached_pages == 0
    kv.free(a)
    assert kv.get_computed_pages(make_req("b", range(9))) == ([], 0)
    b = make_req("b", range(9))
    admit(kv, b)
    assert b.page_ids == [1, 2, 3]  # uncached pages go back to the front, first page first
    assert (kv.num_query_tokens, kv.num_hit_tokens) == (18, 0)


def test_hash_is_chained_and_128_bit():
    h1 = hash_page(b"", [1, 2, 3, 4])
    assert len(h1) == 16
    assert hash_page(b"", [1, 2, 3, 4]) == h1
    assert hash_page(h1, [5, 6, 7, 8]) != hash_page(b"", [5, 6, 7, 8])
    assert hash_page(b"", [1, 2, 3, 5]) != h1
    assert hash_page(b"", [2**31, 0, 0, 0]) != hash_page(b"", [0, 0, 0, 0])
    # the manager's batched hashing (in two goes, as a request grows) gives hash_page's chain
    kv, r = KVCacheManager(num_pages=9, page_size=PS), make_req("r", range(3, 16))
    assert kv.get_computed_pages(r) == ([], 0) and len(r.page_hashes) == 3
    r.append_output_token(99)
    r.append_output_token(7)
    r.append_output_token(8)
    chain = [hash_page(b"", [3, 4, 5, 6])]
    for page in ([7, 8, 9, 10], [11, 12, 13, 14], [15, 99, 7, 8]):
        chain.append(hash_page(chain[-1], page))
    assert kv._update_hashes(r, 4) == chain


def test_invalid_construction():
    with pytest.raises(ValueError, match="num_pages"):
        KVCacheManager(num_pages=1, page_size=4)
    with pytest.raises(ValueError, match="page_size"):
        KVCacheManager(num_pages=4, page_size=0)


def test_state_slots_taken_at_admission_and_returned_by_free():
    """Linear-attention models: one state slot per admitted request (slot 0 reserved), none left -> no
    admission; growing a running request takes no slot; free returns it."""
    kv = KVCacheManager(num_pages=9, page_size=PS, enable_prefix_caching=False, num_state_slots=3)
    a, b, c = make_req("a", range(3)), make_req("b", range(3)), make_req("c", range(3))
    admit(kv, a)
    admit(kv, b)
    assert (a.state_slot, b.state_slot, kv.num_free_state_slots) == (1, 2, 0)
    assert not kv.allocate_slots(c, 3, [])
    assert c.state_slot == 0 and c.page_ids == []  # nothing changed
    a.num_computed_tokens = 3
    assert kv.allocate_slots(a, 4) and a.state_slot == 1
    kv.free(a)
    assert a.state_slot == 0 and kv.num_free_state_slots == 1
    admit(kv, c)
    assert c.state_slot == 1


def test_state_slots_refuse_prefix_caching():
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        KVCacheManager(num_pages=9, page_size=PS, num_state_slots=3)
    with pytest.raises(ValueError, match="num_state_slots"):
        KVCacheManager(num_pages=9, page_size=PS, enable_prefix_caching=False, num_state_slots=1)

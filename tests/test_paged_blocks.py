"""Page bookkeeping of the paged KV cache: reference counts and prefix sharing by chained hashes."""
from __future__ import annotations

import doctest

import pytest
import torch

import remask.caches.paged
from remask.kernels import paged_gather, paged_store
from remask.models.paged import BlockManager  # the old name, still importable


def test_doctest():
    import remask.caches.page_manager

    assert doctest.testmod(remask.caches.paged).failed == 0
    assert doctest.testmod(remask.caches.page_manager).attempted > 0
    assert doctest.testmod(remask.caches.page_manager).failed == 0


def test_shared_system_prompt_is_stored_once():
    bm = BlockManager(num_pages=32, page_size=4)
    system = list(range(50, 62))   # 3 full pages
    tables = [bm.allocate(system + tail) for tail in ([1, 2], [3], [4, 5, 6, 7, 8], [])]
    assert all(t[:3] == tables[0][:3] for t in tables)
    assert [bm.ref_count[p] for p in tables[0][:3]] == [4, 4, 4]
    assert bm.shared_hits == 9
    tails = [t[3:] for t in tables]
    assert len({p for t in tails for p in t}) == sum(len(t) for t in tails)   # private pages differ
    assert bm.num_free == 32 - 3 - 4


def test_divergent_prefix_stops_sharing_and_partial_pages_are_private():
    bm = BlockManager(num_pages=16, page_size=3)
    a = bm.allocate([1, 2, 3, 4, 5, 6, 7])
    b = bm.allocate([1, 2, 3, 9, 5, 6, 7])   # second page differs, third equal but chained hash differs
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]
    c = bm.allocate([1, 2])                   # a partial page is never shared
    assert c[0] not in (a[0], b[0])


def test_free_and_reuse():
    bm = BlockManager(num_pages=4, page_size=2)
    a = bm.allocate([1, 2, 3, 4])
    bm.free(a)
    assert bm.num_free == 4
    again = bm.allocate([1, 2, 3, 4])        # freed pages keep their content until reused
    assert again == a and bm.shared_hits == 2
    bm.free(again)
    other = bm.allocate([7, 8, 9, 10, 11, 12, 13, 14])
    assert sorted(other) == [0, 1, 2, 3]
    with pytest.raises(RuntimeError, match="full"):
        bm.allocate([1])
    with pytest.raises(ValueError, match="not allocated"):
        bm.free([0, 0, 0])


def test_extend_and_slot_mapping_feed_the_store_kernel():
    bm = BlockManager(num_pages=10, page_size=4)
    table = bm.allocate(list(range(6)))
    bm.extend(table, 6 + 7)
    assert len(table) == 4
    slots = bm.slot_mapping(table, torch.arange(13))
    k_cache = torch.zeros(10, 4, 1, 2)
    rows = torch.arange(13, dtype=torch.float32)[:, None, None].expand(13, 1, 2)
    paged_store(rows, rows, k_cache, k_cache.clone(), slots)
    tables = bm.block_tables([table])
    back = paged_gather(k_cache, tables, torch.tensor([13]))
    torch.testing.assert_close(back[0], rows)
    with pytest.raises(ValueError, match="exceed"):
        bm.slot_mapping(table, torch.tensor([16]))


def test_page_manager_counts_what_an_allocation_takes_and_copy_on_write():
    from remask.caches.page_manager import PageManager

    pm = PageManager(num_pages=6, page_size=4)
    system = list(range(8))
    assert pm.pages_needed(system + [50], extra_positions=1) == 3
    a = pm.allocate(system + [50])
    assert pm.last_hits == 0 and pm.pages_needed(system + [60]) == 1      # two pages found, one fresh
    b = pm.allocate(system + [60])
    assert pm.last_hits == 2 and [pm.ref_count[p] for p in b] == [2, 2, 1] and pm.pages_in_use == 4
    new = pm.unshare(b, 1)                                                 # b's second page made private
    assert b[1] == new != a[1] and pm.ref_count[a[1]] == 1 and [pm.ref_count[p] for p in b] == [2, 1, 1]
    assert pm.pages_needed(list(range(100, 112))) == 3 > pm.num_free       # 3 fresh pages, 1 free
    with pytest.raises(RuntimeError, match="full"):
        pm.allocate(list(range(100, 112)))
    assert pm.num_free == 1                                                # a refused allocation takes nothing
    pm.free(a)
    pm.free(b)
    assert pm.pages_in_use == 0 and pm.peak_in_use == 5
    # Freed pages keep their content: the system prompt is found again, the hit leaves the free list.
    c = pm.allocate(system + [70])
    assert pm.last_hits == 2 and c[:2] == a[:2]
    off = PageManager(num_pages=6, page_size=4, enable_prefix_caching=False)
    off.allocate(system)
    assert off.allocate(system) and off.last_hits == 0 and off.pages_in_use == 4

"""The page allocator of a paged KV cache: reference-counted pages and prefix sharing.

It decides which page of the cache tensors (`remask.kernels.paged`, `PagedKVStore`) holds which
positions of which sequence. A full page is identified by a chained hash of (previous page's
hash, its token ids), as in nano-vllm: prompts that agree on their first n full pages share those
pages, reference-counted (a hit is confirmed on the token ids); a partial last page is never shared.
Eviction: a page nobody holds keeps its content and hash until handed out again (least recently
freed first), so a later request with the same prefix can still find it.

    >>> pm = PageManager(num_pages=8, page_size=4)
    >>> system = list(range(8))                        # a shared system prompt of 2 full pages
    >>> a, b = pm.allocate(system + [100, 101]), pm.allocate(system + [200])
    >>> a[:2] == b[:2], a[2] != b[2], pm.ref_count[a[0]], pm.num_free
    (True, True, 2, 4)
"""
from __future__ import annotations

from collections import deque
from typing import Sequence

import torch


class PageManager:
    """Allocates pages for sequences; `allocate` returns a sequence's page table (page ids).
    `enable_prefix_caching=False` never shares a page."""

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages and page_size must be positive, got {num_pages}, {page_size}")
        self.num_pages, self.page_size, self.enable_prefix_caching = num_pages, page_size, enable_prefix_caching
        self.ref_count = [0] * num_pages
        self.free_pages: deque[int] = deque(range(num_pages))
        self.page_hash: list[int | None] = [None] * num_pages
        self.page_tokens: list[tuple[int, ...] | None] = [None] * num_pages
        self.hash_to_page: dict[int, int] = {}
        self.shared_hits = 0   # full pages found already stored (what prefix sharing saved)
        self.lookups = 0       # full pages looked up (the denominator of the hit rate)
        self.last_hits = 0     # pages the last `allocate` found stored (the leading ones of its table)
        self.peak_in_use = 0

    @property
    def num_free(self) -> int:
        return len(self.free_pages)

    @property
    def pages_in_use(self) -> int:
        return self.num_pages - len(self.free_pages)

    def pages_for(self, num_positions: int) -> int:
        return -(-num_positions // self.page_size)

    @staticmethod
    def chain_hash(previous: int | None, tokens: Sequence[int]) -> int:
        return hash((previous, tuple(int(t) for t in tokens)))

    def _take_free(self) -> int:
        if not self.free_pages:
            raise RuntimeError(f"the paged cache is full ({self.num_pages} pages of {self.page_size}); "
                               f"free sequences or allocate more pages")
        page = self.free_pages.popleft()
        old = self.page_hash[page]
        if old is not None and self.hash_to_page.get(old) == page:
            del self.hash_to_page[old]   # the page's old content is about to be overwritten
        self.page_hash[page] = self.page_tokens[page] = None
        self.ref_count[page] = 1
        self.peak_in_use = max(self.peak_in_use, self.pages_in_use)
        return page

    def _lookup(self, token_ids: Sequence[int], seed: int | None, share_last: bool):
        """(hash or None, tokens, stored page or None) of each page `token_ids` fills; after the
        first miss the chain cannot match again."""
        h, sharing = seed, self.enable_prefix_caching
        for i in range(self.pages_for(len(token_ids))):
            chunk = tuple(int(t) for t in token_ids[i * self.page_size:(i + 1) * self.page_size])
            h = self.chain_hash(h, chunk) if len(chunk) == self.page_size or share_last else None
            page = self.hash_to_page.get(h) if sharing and h is not None else None
            sharing = page is not None and self.page_tokens[page] == chunk
            yield h, chunk, page if sharing else None

    def pages_needed(self, token_ids: Sequence[int], extra_positions: int = 0, seed: int | None = None) -> int:
        """Free pages that `allocate(token_ids)` plus `extra_positions` more positions would take."""
        hits = [page for _, _, page in self._lookup(token_ids, seed, False) if page is not None]
        # a hit held by nobody leaves the free list (without being overwritten): it is taken too
        return self.pages_for(len(token_ids) + extra_positions) - len(hits) + sum(self.ref_count[p] == 0 for p in hits)

    def allocate(self, token_ids: Sequence[int], seed: int | None = None, share_last: bool = False) -> list[int]:
        """The page table of a new sequence holding `token_ids`, full pages shared with any stored
        page of the same prefix. `seed` starts the hash chain (`PagedKVCache`: a digest of the whole
        bidirectional row); `share_last` shares the partial last page too (final content only)."""
        if not share_last and self.pages_needed(token_ids, 0, seed) > self.num_free:
            raise RuntimeError(f"the paged cache is full: {len(token_ids)} positions need more than the "
                               f"{self.num_free} free pages of {self.page_size}")   # nothing taken yet
        table: list[int] = []
        self.last_hits = 0
        for h, chunk, page in self._lookup(token_ids, seed, share_last):
            self.lookups += h is not None
            if page is not None:
                if self.ref_count[page] == 0:
                    self.free_pages.remove(page)   # a freed page whose content is still valid
                self.ref_count[page] += 1
                self.shared_hits += 1
                self.last_hits += 1
            else:
                page = self._take_free()
                if h is not None and self.enable_prefix_caching:
                    self.page_hash[page] = h
                    self.page_tokens[page] = chunk
                    self.hash_to_page[h] = page
            table.append(page)
        self.peak_in_use = max(self.peak_in_use, self.pages_in_use)
        return table

    def unshare(self, table: list[int], index: int) -> int:
        """Copy-on-write: give `table[index]` a private page (returned; the caller copies the
        content) and drop this sequence's reference to the shared one."""
        page = self._take_free()
        self.free([table[index]])
        table[index] = page
        return page

    def extend(self, table: list[int], new_length: int) -> None:
        """Append fresh pages to `table` until it covers `new_length` positions (generated tokens)."""
        table.extend(self._take_free() for _ in range(self.pages_for(new_length) - len(table)))

    def free(self, table: Sequence[int]) -> None:
        """Release a sequence's pages (last first); a page is reusable once nobody holds it."""
        for page in reversed(table):
            if self.ref_count[page] <= 0:
                raise ValueError(f"page {page} is not allocated")
            self.ref_count[page] -= 1
            if self.ref_count[page] == 0:
                self.free_pages.append(page)

    def slot_mapping(self, table: Sequence[int], positions: torch.Tensor) -> torch.Tensor:
        """Slots (`page · page_size + offset`) of `positions` of the sequence with `table`."""
        pages = torch.tensor(list(table), dtype=torch.long, device=positions.device)
        index = positions.long() // self.page_size
        if len(table) == 0 or bool((index >= len(table)).any()):
            raise ValueError(f"positions up to {int(positions.max())} exceed the table's "
                             f"{len(table) * self.page_size} positions")
        return pages[index] * self.page_size + positions.long() % self.page_size

    def block_tables(self, tables: Sequence[Sequence[int]], device: torch.device | str = "cpu") -> torch.Tensor:
        """Tables of a batch as one int32 `[B, max_pages]` tensor (padded with page 0, never read
        past `seq_lens`) — the layout the paged-attention kernels read."""
        width = max([1, *map(len, tables)])
        rows = [[*t, *[0] * (width - len(t))] for t in tables]
        return torch.tensor(rows, dtype=torch.int32).reshape(len(tables), width).to(device)


class PagedKVStore:
    """The engine's page store: per-layer key/value pages `[num_pages · page_size, H_kv, D]` of `manager`'s
    pages (autoregressive sequences, block-causal blocks: `BlockKVCache`), allocated at the first write
    (the layer shapes come from the model's own projections), uninitialised: a slot is read only after its
    sequence wrote it (`seq_lens`, `slot_mapping`), so zeroing the whole store would only cost time (on a CPU,
    faulting in every page of it at once)."""

    def __init__(self, manager: PageManager) -> None:
        self.manager = manager
        self.unshared_pages = 0   # shared pages found different and made private
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def layer(self, index: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`like`: this layer's new keys `[n, H_kv, D]`."""
        while len(self.keys) <= index:
            for held in (self.keys, self.values):
                held.append(like.new_empty((self.manager.num_pages * self.manager.page_size, *like.shape[1:])))
        return self.keys[index], self.values[index]

    def write(self, layer: int, table: list[int], start: int, k: torch.Tensor, v: torch.Tensor, shared: int) -> int:
        """Store K/V `[n, H_kv, D]` of positions `start`… into `table`'s pages of `layer`. Its first `shared`
        pages are held with others (found by hash): compared instead, and on the first difference this page
        and every later shared one become private (a page's K/V follow from all before it), the layers below
        (which matched) copied over: copy-on-write. Returns how many leading pages stay shared."""
        stores = self.layer(layer, k)
        ps, end = self.manager.page_size, start + k.shape[0]
        for index in range(start // ps, self.manager.pages_for(end)):
            lo, hi = max(start, index * ps), min(end, (index + 1) * ps)
            fresh = (k[lo - start:hi - start], v[lo - start:hi - start])
            if index < shared:
                offset = (table[index] - index) * ps
                if all(torch.equal(held[offset + lo:offset + hi], part) for held, part in zip(stores, fresh)):
                    continue
                for later in range(index, shared):
                    old, new = table[later], self.manager.unshare(table, later)
                    for pages in self.keys[:layer] + self.values[:layer]:
                        pages[new * ps:(new + 1) * ps] = pages[old * ps:(old + 1) * ps]
                self.unshared_pages += shared - index
                shared = index
            offset = (table[index] - index) * ps
            for held, part in zip(stores, fresh):
                held[offset + lo:offset + hi] = part
        return shared

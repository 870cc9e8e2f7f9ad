"""The page allocator of a paged KV cache: reference-counted pages and prefix sharing.

The cache tensors themselves are `[num_pages, page_size, H_kv, D]` per layer (see
`remask.kernels.paged` and `remask.engine.paged_kv`); this module decides which page holds which
positions of which sequence. It is long-lived: the engine keeps one for its whole life, pages are
taken when a sequence needs them and given back when it finishes, is aborted or preempted.

A full page is identified by a chained hash of (hash of the previous page, its token ids), as in
nano-vllm: two sequences whose prompts agree on their first n full pages get the same n pages,
each stored once with a reference count. A hash hit is confirmed by comparing the token ids. A
partial (last) page is never shared, since its tokens are still to come. A page nobody holds any
more keeps its content (and its hash) until the allocator hands it out again — least recently
freed first — so a later request with the same prefix can still find it: that is the eviction rule.

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

    `enable_prefix_caching=False` never shares a page (every sequence gets fresh ones)."""

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages and page_size must be positive, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
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
        self.page_hash[page] = None
        self.page_tokens[page] = None
        self.ref_count[page] = 1
        self.peak_in_use = max(self.peak_in_use, self.pages_in_use)
        return page

    def _chunks(self, token_ids: Sequence[int], seed: int | None, share_last: bool):
        """(hash or None, tokens) of each page `token_ids` fills."""
        previous = seed
        for i in range(self.pages_for(len(token_ids))):
            chunk = tuple(int(t) for t in token_ids[i * self.page_size:(i + 1) * self.page_size])
            full = len(chunk) == self.page_size or share_last
            h = self.chain_hash(previous, chunk) if full else None
            yield h, chunk
            previous = h

    def _hit(self, h: int | None, chunk: tuple[int, ...]) -> int | None:
        if h is None or not self.enable_prefix_caching:
            return None
        page = self.hash_to_page.get(h)
        return page if page is not None and self.page_tokens[page] == chunk else None

    def can_allocate(self, token_ids: Sequence[int], extra_positions: int = 0, seed: int | None = None) -> bool:
        """Whether `allocate(token_ids)` plus pages for `extra_positions` more would succeed now."""
        return self.pages_needed(token_ids, extra_positions, seed) <= self.num_free

    def pages_needed(self, token_ids: Sequence[int], extra_positions: int = 0, seed: int | None = None) -> int:
        """Free pages that `allocate(token_ids)` plus `extra_positions` more positions would take."""
        fresh, reused_free = 0, 0
        sharing = True
        chunks = list(self._chunks(token_ids, seed, False))
        for h, chunk in chunks:
            page = self._hit(h, chunk) if sharing else None
            if page is None:
                sharing = False
                fresh += 1
            elif self.ref_count[page] == 0:
                reused_free += 1   # held by nobody: leaves the free list without being overwritten
        fresh += self.pages_for(len(token_ids) + extra_positions) - len(chunks)
        return fresh + reused_free

    def allocate(self, token_ids: Sequence[int], seed: int | None = None, share_last: bool = False) -> list[int]:
        """Pages for a new sequence holding `token_ids`: full pages are shared with any stored
        page of the same prefix, the rest are fresh. Returns the page table.

        `seed` starts the hash chain: what, besides the tokens, a page's K/V depend on. None for a
        causal model (a page depends on the tokens up to its end); a bidirectional model's K/V
        depend on the whole sequence, so `PagedKVCache` seeds the chain with a digest of it.
        `share_last`: the last, partial page is shared too — for content that is final (a
        refresh of a bidirectional model's cache), not for a sequence that will still grow."""
        if not share_last and self.pages_needed(token_ids, 0, seed) > self.num_free:
            raise RuntimeError(f"the paged cache is full: {len(token_ids)} positions need more than the "
                               f"{self.num_free} free pages of {self.page_size}")   # nothing taken yet
        table: list[int] = []
        sharing = True
        self.last_hits = 0
        for h, chunk in self._chunks(token_ids, seed, share_last):
            if h is not None:
                self.lookups += 1
            page = self._hit(h, chunk) if sharing else None
            if page is not None:
                if self.ref_count[page] == 0:
                    self.free_pages.remove(page)   # a freed page whose content is still valid
                self.ref_count[page] += 1
                self.shared_hits += 1
                self.last_hits += 1
            else:
                sharing = False   # after the first miss the chain cannot match again
                page = self._take_free()
                if h is not None and self.enable_prefix_caching:
                    self.page_hash[page] = h
                    self.page_tokens[page] = chunk
                    self.hash_to_page[h] = page
            table.append(page)
        self.peak_in_use = max(self.peak_in_use, self.pages_in_use)
        return table

    def num_shared(self, table: Sequence[int]) -> int:
        """How many leading pages of `table` other sequences hold too."""
        count = 0
        for page in table:
            if self.ref_count[page] < 2:
                break
            count += 1
        return count

    def unshare(self, table: list[int], index: int) -> int:
        """Copy-on-write: give `table[index]` a private page (returned; the caller copies the
        content) and drop this sequence's reference to the shared one."""
        old = table[index]
        page = self._take_free()
        self.ref_count[old] -= 1
        if self.ref_count[old] == 0:
            self.free_pages.append(old)
        table[index] = page
        return page

    def extend(self, table: list[int], new_length: int) -> list[int]:
        """Append fresh pages to `table` until it covers `new_length` positions (generated tokens)."""
        while len(table) * self.page_size < new_length:
            table.append(self._take_free())
        return table

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
        width = max((len(t) for t in tables), default=0)
        out = torch.zeros((len(tables), max(width, 1)), dtype=torch.int32)
        for i, t in enumerate(tables):
            out[i, :len(t)] = torch.tensor(list(t), dtype=torch.int32)
        return out.to(device)

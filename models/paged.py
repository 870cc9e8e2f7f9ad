"""Page bookkeeping for a paged KV cache: reference-counted pages and prefix sharing.

The cache tensors themselves are `[num_pages, page_size, H_kv, D]` per layer (see
`remask.kernels.paged`); this module decides which page holds which positions of which sequence.
A full page is identified by a chained hash of (hash of the previous page, its token ids), as in
nano-vllm: two sequences whose prompts agree on their first n full pages get the same n pages,
each stored once with a reference count. A hash hit is confirmed by comparing the token ids.
A partial (last) page is never shared, since its tokens are still to come.

    >>> bm = BlockManager(num_pages=8, page_size=4)
    >>> system = list(range(8))                        # a shared system prompt of 2 full pages
    >>> a, b = bm.allocate(system + [100, 101]), bm.allocate(system + [200])
    >>> a[:2] == b[:2], a[2] != b[2], bm.ref_count[a[0]], bm.num_free
    (True, True, 2, 4)
"""
from __future__ import annotations

from collections import deque
from typing import Sequence

import torch


class BlockManager:
    """Allocates pages for sequences; `allocate` returns a sequence's block table (page ids)."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages and page_size must be positive, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.ref_count = [0] * num_pages
        self.free_pages: deque[int] = deque(range(num_pages))
        self.page_hash: list[int | None] = [None] * num_pages
        self.page_tokens: list[tuple[int, ...] | None] = [None] * num_pages
        self.hash_to_page: dict[int, int] = {}
        self.shared_hits = 0   # full pages found already stored (what prefix sharing saved)

    @property
    def num_free(self) -> int:
        return len(self.free_pages)

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
        return page

    def allocate(self, token_ids: Sequence[int]) -> list[int]:
        """Pages for a new sequence holding `token_ids`: full pages are shared with any stored
        page of the same prefix, the rest are fresh. Returns the block table."""
        needed = -(-len(token_ids) // self.page_size)
        table: list[int] = []
        previous: int | None = None
        sharing = True
        for i in range(needed):
            chunk = tuple(int(t) for t in token_ids[i * self.page_size:(i + 1) * self.page_size])
            full = len(chunk) == self.page_size
            h = self.chain_hash(previous, chunk) if full else None
            page = self.hash_to_page.get(h) if (full and sharing) else None
            if page is not None and self.page_tokens[page] == chunk:
                if self.ref_count[page] == 0:
                    self.free_pages.remove(page)   # a freed page whose content is still valid
                self.ref_count[page] += 1
                self.shared_hits += 1
            else:
                sharing = False   # after the first miss the chain cannot match again
                page = self._take_free()
                if full:
                    self.page_hash[page] = h
                    self.page_tokens[page] = chunk
                    self.hash_to_page[h] = page
            table.append(page)
            previous = h
        return table

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
        past `seq_lens`)."""
        width = max((len(t) for t in tables), default=0)
        out = torch.zeros((len(tables), max(width, 1)), dtype=torch.int32)
        for i, t in enumerate(tables):
            out[i, :len(t)] = torch.tensor(list(t), dtype=torch.int32)
        return out.to(device)

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

from remask.kernels import paged_attention, paged_store
from remask.models.layers import attention


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

    def allocate(self, token_ids: Sequence[int], seed: int | None = None, share_last: bool = False) -> list[int]:
        """Pages for a new sequence holding `token_ids`: full pages are shared with any stored
        page of the same prefix, the rest are fresh. Returns the block table.

        `seed` starts the hash chain: what, besides the tokens, a page's K/V depend on. None for a
        causal model (a page depends on the tokens up to its end); a bidirectional model's K/V
        depend on the whole sequence, so `PagedKVCache` seeds the chain with a digest of it.
        `share_last`: the last, partial page is shared too — for content that is final (a
        refresh of a bidirectional model's cache), not for a sequence that will still grow."""
        needed = -(-len(token_ids) // self.page_size)
        table: list[int] = []
        previous: int | None = seed
        sharing = True
        for i in range(needed):
            chunk = tuple(int(t) for t in token_ids[i * self.page_size:(i + 1) * self.page_size])
            full = len(chunk) == self.page_size or share_last
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


class PagedKVCache:
    """Fast-dLLM's dual cache kept in pages: `use_cache="paged"` (or pass an instance to read its
    memory figures afterwards).

    At each block start the sampler calls `begin_block`; the full forward that follows attends as
    usual and stores, per layer, the K/V (after RoPE) of every position outside the block into
    pages `[num_pages, page_size, H_kv, D]` through a slot mapping (pads and the block: −1, not
    stored). Each later step feeds the block alone: its queries attend over the pages and the
    block's own fresh K/V (`remask.kernels.paged_attention`, no contiguous copy), which is the
    key set the contiguous dual cache attends over, so the tokens are the same.

    Sharing: the pages of a block are allocated by a `BlockManager` whose hash chain is seeded
    with a digest of the row's whole input (tokens, padding, block), because in a bidirectional
    model every position's K/V depend on every token. Rows with the same input — a prompt
    repeated for several samples, `num_return_sequences` — store their K/V once; for a causal
    model the same manager shares any common prefix (nano-vllm's rule).

        >>> cache = PagedKVCache(page_size=4)
        >>> cache.page_size, cache.pages_in_use
        (4, 0)
    """

    def __init__(self, page_size: int = 16, num_pages: int | None = None) -> None:
        if not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        if num_pages is not None and (not isinstance(num_pages, int) or num_pages <= 0):
            raise ValueError(f"num_pages must be a positive int or None (grow as needed), got {num_pages!r}")
        self.page_size = page_size
        self.num_pages = num_pages
        self.manager: BlockManager | None = None
        self.k_pages: list[torch.Tensor] = []
        self.v_pages: list[torch.Tensor] = []
        self.tables: list[list[int]] = []
        self.block_table: torch.Tensor | None = None
        self.seq_lens: torch.Tensor | None = None
        self.slot_mapping: torch.Tensor | None = None
        self.total_len = 0
        self.stored = False
        self.peak_pages = 0
        self.peak_shared_hits = 0

    @property
    def pages_in_use(self) -> int:
        return 0 if self.manager is None else self.manager.num_pages - self.manager.num_free

    @property
    def nbytes(self) -> int:
        """Bytes of the pages in use, all layers, K and V."""
        return sum(self.pages_in_use * t[0].numel() * t.element_size() for t in self.k_pages + self.v_pages)

    def get_seq_length(self, layer: int = 0) -> int:
        return self.total_len if self.stored else 0

    def begin_block(self, x: torch.Tensor, valid: torch.Tensor | None, start: int, end: int) -> None:
        """Lay out pages for a refresh of `x` `[B, T]` (`valid`: `[B, T]` bool, False on left pads)
        whose current block is `[start, end)`; the next forward (over all T positions) fills them."""
        B, T = x.shape
        per_row = -(-T // self.page_size)
        self.manager = BlockManager(self.num_pages or B * per_row, self.page_size)
        if valid is None:
            valid = torch.ones((B, T), dtype=torch.bool, device=x.device)
        context = valid.clone()
        context[:, start:end] = False
        tokens = x.masked_fill(~context, -1).tolist()
        slots = torch.full((B, T), -1, dtype=torch.long)
        written: set[int] = set()
        self.tables = []
        for b in range(B):
            ids = [t for t in tokens[b] if t >= 0]
            seed = hash((tuple(x[b].tolist()), tuple(valid[b].tolist()), start, end))
            table = self.manager.allocate(ids, seed=seed, share_last=True)
            positions = context[b].nonzero().squeeze(1).cpu()
            page_of = torch.tensor(table, dtype=torch.long)[torch.arange(len(ids)) // self.page_size]
            row = page_of * self.page_size + torch.arange(len(ids)) % self.page_size
            fresh = torch.tensor([p not in written for p in page_of.tolist()], dtype=torch.bool)
            slots[b, positions] = torch.where(fresh, row, -1)   # a shared page is written once
            written.update(table)
            self.tables.append(table)
        self.peak_pages = max(self.peak_pages, self.pages_in_use)
        self.peak_shared_hits = max(self.peak_shared_hits, self.manager.shared_hits)
        self.slot_mapping = slots.reshape(-1).to(x.device)
        self.block_table = self.manager.block_tables(self.tables, x.device)
        self.seq_lens = context.sum(dim=1).to(torch.int32)
        self.total_len = T
        self.stored = False

    def _pages_for(self, layer: int, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        need = self.pages_in_use if self.num_pages is None else self.num_pages
        if layer == len(self.k_pages):
            shape = (need, self.page_size, k.shape[1], k.shape[3])
            self.k_pages.append(torch.zeros(shape, dtype=k.dtype, device=k.device))
            self.v_pages.append(torch.zeros(shape, dtype=k.dtype, device=k.device))
        elif self.k_pages[layer].shape[0] < need:   # more distinct pages than the pool has: grow it
            extra = need - self.k_pages[layer].shape[0]
            pad = torch.zeros((extra,) + tuple(self.k_pages[layer].shape[1:]), dtype=k.dtype, device=k.device)
            self.k_pages[layer] = torch.cat([self.k_pages[layer], pad])
            self.v_pages[layer] = torch.cat([self.v_pages[layer], pad.clone()])
        return self.k_pages[layer], self.v_pages[layer]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               mask: torch.Tensor | None) -> torch.Tensor:
        """q `[B, Hq, L, D]`, k/v `[B, H_kv, L, D]` → `[B, Hq, L, D]`. The refresh forward (all
        positions from 0) attends as usual and stores; a block forward attends over the pages."""
        if self.slot_mapping is None:
            raise RuntimeError("PagedKVCache.begin_block must be called before the first forward")
        B, H_kv, L, D = k.shape
        k_pages, v_pages = self._pages_for(layer, k)
        if start == 0 and L == self.total_len:
            paged_store(k.transpose(1, 2).reshape(B * L, H_kv, D), v.transpose(1, 2).reshape(B * L, H_kv, D),
                        k_pages, v_pages, self.slot_mapping)
            self.stored = True
            return attention(q, k, v, mask)
        # Pads and the block are not in the pages: the context needs no mask.
        out = paged_attention(q.transpose(1, 2), k_pages, v_pages, self.block_table, self.seq_lens,
                              k.transpose(1, 2), v.transpose(1, 2))
        return out.transpose(1, 2)

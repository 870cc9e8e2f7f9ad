"""The paged KV cache of the diffusion samplers (`use_cache="paged"`): a block refresh's K/V stored
in pages (allocated by `remask.caches.page_manager.PageManager`), read back by the paged-attention
kernel.
"""
from __future__ import annotations

import torch

from remask.caches.page_manager import PageManager
from remask.kernels import paged_attention, paged_store
from .kv import attention


class PagedKVCache:
    """Fast-dLLM's dual cache kept in pages: `use_cache="paged"` (or an instance, to read its memory
    figures afterwards). After `begin_block`, the full forward stores the K/V of every position
    outside the block into pages `[num_pages, page_size, H_kv, D]`; each later step feeds the block
    alone, attending over the pages and its own fresh K/V (`remask.kernels.paged_attention`): the
    contiguous dual cache's key set, so the same tokens. The hash chain is seeded with a digest of
    the row's whole input (a bidirectional model's K/V depend on every token): identical rows (a
    prompt repeated, `num_return_sequences`) store their K/V once.

        >>> cache = PagedKVCache(page_size=4)
        >>> cache.page_size, cache.pages_in_use
        (4, 0)
    """

    def __init__(self, page_size: int = 16, num_pages: int | None = None) -> None:
        if not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        if num_pages is not None and (not isinstance(num_pages, int) or num_pages <= 0):
            raise ValueError(f"num_pages must be a positive int or None (grow as needed), got {num_pages!r}")
        self.page_size, self.num_pages = page_size, num_pages
        self.manager: PageManager | None = None
        self.k_pages: list[torch.Tensor] = []
        self.v_pages: list[torch.Tensor] = []
        self.block_table: torch.Tensor | None = None
        self.seq_lens: torch.Tensor | None = None
        self.slot_mapping: torch.Tensor | None = None
        self.total_len = self.peak_pages = self.peak_shared_hits = 0
        self.stored = False

    @property
    def pages_in_use(self) -> int:
        return 0 if self.manager is None else self.manager.pages_in_use

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
        self.manager = PageManager(self.num_pages or B * -(-T // self.page_size), self.page_size)
        valid = torch.ones_like(x, dtype=torch.bool) if valid is None else valid
        context = valid.clone()
        context[:, start:end] = False
        tokens = x.masked_fill(~context, -1).tolist()
        slots = torch.full((B, T), -1, dtype=torch.long)
        written: set[int] = set()
        tables: list[list[int]] = []
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
            tables.append(table)
        self.peak_pages = max(self.peak_pages, self.pages_in_use)
        self.peak_shared_hits = max(self.peak_shared_hits, self.manager.shared_hits)
        self.slot_mapping = slots.reshape(-1).to(x.device)
        self.block_table = self.manager.block_tables(tables, x.device)
        self.seq_lens = context.sum(dim=1).to(torch.int32)
        self.total_len = T
        self.stored = False

    def _pages_for(self, layer: int, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        need = self.pages_in_use if self.num_pages is None else self.num_pages
        for pages in (self.k_pages, self.v_pages):
            if layer == len(pages):
                pages.append(k.new_zeros((need, self.page_size, k.shape[1], k.shape[3])))
            elif pages[layer].shape[0] < need:   # more distinct pages than the pool has: grow it
                pad = k.new_zeros((need - len(pages[layer]), *pages[layer].shape[1:]))
                pages[layer] = torch.cat([pages[layer], pad])
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

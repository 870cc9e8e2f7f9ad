"""The exact cache of block-causal models (SDAR) in the engine's page store.

A block-causal model attends causally across blocks, so a finished block's keys and values never
change: they are written once — the prompt's whole blocks at the prefill, then each block when it is
finished (the official `store_kv=True` forward) — and every later forward reads them back. Here
they live in the engine's pages (`remask.engine.page_manager.PageManager`, the store of
`remask.engine.paged_kv.PagedKVStore`), one page table per request:

* `BlockKVCache` is one request's cache. It behaves as the contiguous `DynamicCache` the official
  loop uses: `update` stores the forward's K/V and returns the cached ones followed by them,
  `cached` returns what is stored; both are gathered from the pages, so the attention that follows
  is the very call the contiguous cache makes (the tokens are the same).
* `BlockBatch` is the cache argument of a block's forward: the model's attention runs row by row
  against each row's cache, storing for the rows whose block is finished (`store`), exactly as
  each row's own forward would. A request's one-block forward carries a `BlockBatch` of its own
  rows (its block, or FreeDave's drafts of it); the engine stacks the requests of one step into one
  call (`stepper.run_forwards`, its stacked route: `BlockBatch.pack_key` / `BlockBatch.pack`), each
  at its own block, each with its own cache length.

Prefix sharing: the pages of the prompt's whole blocks are found by the hash of their tokens
(seeded with the block length: the same tokens in blocks of another size give other K/V). The
prefill is still computed — a GEMM may round a row otherwise for another prompt length — and
compared with what the shared page holds, layer by layer; on the first difference the request
takes private pages from there on (copy-on-write), so its tokens never depend on who stored a page.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


class BlockKVCache:
    """One request's cache of finished blocks in pages of `store` (a `PagedKVStore`), the table
    allocated up front for `total_positions` (so a running request never waits for a page).

    `prompt_tokens`: the prompt's whole blocks, looked up for shared pages."""

    def __init__(self, store: Any, prompt_tokens: list[int], total_positions: int, block_length: int) -> None:
        manager = store.manager
        self.store, self.manager = store, manager
        self.table = manager.allocate(prompt_tokens, seed=manager.chain_hash(None, (-1, block_length)))
        self.shared = manager.last_hits           # leading pages stored by another request: to verify
        manager.extend(self.table, total_positions)
        self.lengths: list[int] = []              # stored positions, per layer
        self.unshared = 0                          # shared pages found different and made private
        self.released = False

    @staticmethod
    def pages_needed(manager: Any, prompt_tokens: list[int], total_positions: int, block_length: int) -> int:
        seed = manager.chain_hash(None, (-1, block_length))
        return manager.pages_needed(prompt_tokens, total_positions - len(prompt_tokens), seed)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.lengths[layer_idx] if layer_idx < len(self.lengths) else 0

    def _slots(self, start: int, end: int, device: torch.device) -> torch.Tensor:
        ps = self.manager.page_size
        pos = torch.arange(start, end)
        table = torch.tensor(self.table, dtype=torch.long)
        return (table[pos // ps] * ps + pos % ps).to(device)

    def cached(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The stored keys and values of a layer `[1, H_kv, n, D]`, or None while there are none."""
        n = self.get_seq_length(layer_idx)
        if n == 0:
            return None
        keys, values = self.store.keys[layer_idx], self.store.values[layer_idx]
        slots = self._slots(0, n, keys.device)
        return keys[slots].transpose(0, 1)[None], values[slots].transpose(0, 1)[None]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this forward's K/V `[1, H_kv, n, D]` after the cached ones; return all of them."""
        before = self.cached(layer_idx)
        k_store, v_store = self.store.layer(layer_idx, key)
        while len(self.lengths) <= layer_idx:
            self.lengths.append(0)
        start = self.lengths[layer_idx]
        end = start + key.shape[2]
        if self.manager.pages_for(end) > len(self.table):
            raise RuntimeError(f"the block cache's table covers {len(self.table) * self.manager.page_size} "
                               f"positions; this forward stores up to {end}")
        new_k, new_v = key[0].transpose(0, 1), value[0].transpose(0, 1)      # [n, H_kv, D]
        self._write(layer_idx, start, new_k, new_v, k_store, v_store)
        self.lengths[layer_idx] = end
        if before is None:
            return key, value
        return torch.cat([before[0], key], dim=-2), torch.cat([before[1], value], dim=-2)

    def _write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor, k_store: torch.Tensor,
               v_store: torch.Tensor) -> None:
        ps = self.manager.page_size
        end = start + k.shape[0]
        for index in range(start // ps, self.manager.pages_for(end)):
            lo, hi = max(start, index * ps), min(end, (index + 1) * ps)
            page = self.table[index]
            rows = slice(page * ps + lo - index * ps, page * ps + hi - index * ps)
            if index < self.shared:
                if torch.equal(k_store[rows], k[lo - start:hi - start]) and \
                        torch.equal(v_store[rows], v[lo - start:hi - start]):
                    continue
                # Differs: this page and every later shared one become private (their K/V follow
                # from this one's); the layers below matched, so their content is copied over.
                for later in range(index, self.shared):
                    old = self.table[later]
                    new = self.manager.unshare(self.table, later)
                    for below in range(layer):
                        self.store.keys[below][new * ps:(new + 1) * ps] = self.store.keys[below][old * ps:(old + 1) * ps]
                        self.store.values[below][new * ps:(new + 1) * ps] = \
                            self.store.values[below][old * ps:(old + 1) * ps]
                    self.unshared += 1
                    self.store.unshared_pages += 1
                self.shared = index
                page = self.table[index]
                rows = slice(page * ps + lo - index * ps, page * ps + hi - index * ps)
            k_store[rows] = k[lo - start:hi - start]
            v_store[rows] = v[lo - start:hi - start]

    def release(self) -> None:
        """Give the pages back (a finished or aborted request); idempotent."""
        if not self.released:
            self.manager.free(self.table)
            self.released = True


@dataclass(eq=False)
class BlockBatch:
    """The cache of one forward over several requests' blocks `[B, L]`: row b attends over
    `row_caches[b]` and its own block, and stores its block's K/V when `store[b]`."""

    row_caches: list[Any]
    store: list[bool]

    def attend(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention: Any) -> torch.Tensor:
        """`attention(q, k, v)` (the model's unmasked attention over `[1, H, n, D]` tensors) for
        each row against its cache, as that row's own forward calls it; rows stacked back."""
        outputs = []
        for b, (cache, store) in enumerate(zip(self.row_caches, self.store)):
            k, v = key[b:b + 1], value[b:b + 1]
            if store:
                k, v = cache.update(k, v, layer_idx)
            else:
                cached = _cached(cache, layer_idx)
                if cached is not None:
                    k, v = torch.cat([cached[0], k], dim=-2), torch.cat([cached[1], v], dim=-2)
            outputs.append(attention(query[b:b + 1], k, v))
        return torch.cat(outputs)

    def pack_key(self) -> tuple:
        """Any `BlockBatch`es join in one stacked forward (`stepper.run_forwards`): each row keeps
        its own cache and store flag."""
        return ()

    @classmethod
    def pack(cls, members: list["BlockBatch"], sizes: list[int]) -> "BlockBatch":
        """The cache of one forward over the members' rows stacked in order (`sizes[i]` rows of
        member i): every row attends over its own cache and stores as its member asked."""
        for member, size in zip(members, sizes):
            if len(member.row_caches) != size:
                raise ValueError(f"a BlockBatch of {len(member.row_caches)} rows packed as {size}")
        return cls([cache for m in members for cache in m.row_caches], [store for m in members for store in m.store])


def _cached(cache: Any, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Stored K/V of a layer from a `BlockKVCache` or a transformers `Cache`."""
    if hasattr(cache, "cached"):
        return cache.cached(layer_idx)
    layers = getattr(cache, "layers", None)
    if layers is not None:
        if layer_idx >= len(layers) or getattr(layers[layer_idx], "keys", None) is None:
            return None
        return layers[layer_idx].keys, layers[layer_idx].values
    return cache[layer_idx] if len(cache) > layer_idx else None


class PagedBlocks:
    """What a block decoder needs to keep its requests' finished blocks in the engine's pages
    (SDAR's and LLaDA2's decoders mix it in): `block_length`, `gen_length` and `block_store` (the
    engine's `PagedKVStore`, or None for a contiguous `DynamicCache`) are the decoder's own."""

    block_length: int
    gen_length: int
    block_store: Any = None

    def block_sizes(self, prompt_length: int) -> tuple[int, int]:
        """(positions of the prompt's whole blocks, positions of the whole sequence)."""
        L = self.block_length
        return prompt_length // L * L, (prompt_length + self.gen_length + L - 1) // L * L

    def pages_needed(self, manager: Any, prompt_ids: torch.Tensor) -> int:
        """Free pages a request with this prompt takes in the engine's store (all allocated at start)."""
        prefix, total = self.block_sizes(prompt_ids.shape[1])
        return BlockKVCache.pages_needed(manager, prompt_ids[0, :prefix].tolist(), total, self.block_length)

    def new_cache(self, input_ids: torch.Tensor) -> Any:
        """A new request's cache: pages of the engine's store, or a contiguous `DynamicCache`."""
        if self.block_store is None:
            from transformers.cache_utils import DynamicCache

            return DynamicCache()
        prefix, total = self.block_sizes(input_ids.shape[1])
        return BlockKVCache(self.block_store, input_ids[0, :prefix].tolist(), total, self.block_length)

    def release(self, state: Any) -> None:
        """Give back the state's cache pages (the engine's paged cache), if it has any."""
        release = getattr(state.cache, "release", None)
        if release is not None:
            release()

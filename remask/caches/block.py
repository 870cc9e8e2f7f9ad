"""The exact cache of block-causal models (SDAR, LLaDA2) in the engine's page store.

A block-causal model attends causally across blocks, so a finished block's keys and values never
change: they are written once (the prompt's whole blocks at the prefill, then each finished block:
the official `store_kv=True` forward) and read back by every later forward. Here they live in the
engine's pages (`remask.caches.page_manager.PagedKVStore`), one page table per request (`BlockKVCache`,
behaving as the official loop's contiguous `DynamicCache`: the attention that follows is the very
call the contiguous cache makes); a forward over several requests' blocks carries a `BlockBatch`.

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
    """One request's cache of finished blocks in pages of `store` (a `PagedKVStore`), the table allocated
    up front for `total_positions` (a running request never waits for a page); `prompt_tokens`: the
    prompt's whole blocks, looked up for shared pages."""

    def __init__(self, store: Any, prompt_tokens: list[int], total_positions: int, block_length: int) -> None:
        self.store, self.manager = store, store.manager
        self.table = self.manager.allocate(prompt_tokens, seed=self.manager.chain_hash(None, (-1, block_length)))
        self.shared = self.manager.last_hits      # leading pages stored by another request: to verify
        self.manager.extend(self.table, total_positions)
        self.lengths: dict[int, int] = {}         # layer → its stored positions
        self.released = False

    @staticmethod
    def pages_needed(manager: Any, prompt_tokens: list[int], total_positions: int, block_length: int) -> int:
        return manager.pages_needed(prompt_tokens, total_positions - len(prompt_tokens),
                                    manager.chain_hash(None, (-1, block_length)))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.lengths.get(layer_idx, 0)

    def cached(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The stored keys and values of a layer `[1, H_kv, n, D]`, or None while there are none."""
        n = self.get_seq_length(layer_idx)
        if n == 0:
            return None
        keys, values = self.store.keys[layer_idx], self.store.values[layer_idx]
        slots = self.manager.slot_mapping(self.table, torch.arange(n)).to(keys.device)
        return keys[slots].transpose(0, 1)[None], values[slots].transpose(0, 1)[None]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this forward's K/V `[1, H_kv, n, D]` after the cached ones (`store_block`); return all of them."""
        before = self.cached(layer_idx)
        self.store_block(key, value, layer_idx)
        return _joined(before, key, value)

    def store_block(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> None:
        """Store this forward's K/V `[1, H_kv, n, D]` after the cached ones (the shared prompt pages
        verified: module docstring)."""
        start = self.get_seq_length(layer_idx)
        end = start + key.shape[2]
        if self.manager.pages_for(end) > len(self.table):
            raise RuntimeError(f"the block cache's table covers {len(self.table) * self.manager.page_size} "
                               f"positions; this forward stores up to {end}")
        self.shared = self.store.write(layer_idx, self.table, start, key[0].transpose(0, 1),
                                       value[0].transpose(0, 1), self.shared)
        self.lengths[layer_idx] = end

    def release(self) -> None:
        """Give the pages back (a finished or aborted request); idempotent."""
        if not self.released:
            self.manager.free(self.table)
            self.released = True


class PackedRows:
    """A forward's cache argument of per-row lists (the fields in `ROWS`): those of one class join in
    one stacked forward (`stepper.run_forwards`), rows in order, each keeping its own cache and store
    flag (`BlockBatch`; Fast-dLLM v2's `BlockRows`). `varlen` (the driver's, `LLMEngine(varlen_attention=True)`):
    a `BlockBatch` over the engine's page store attends in one `varlen_attention` call per layer."""

    ROWS: tuple = ()
    varlen = False

    def pack_key(self) -> tuple:
        return ()

    @classmethod
    def pack(cls, members: list[Any], sizes: list[int], varlen: bool = False) -> Any:
        """The argument of one forward over the members' rows stacked in order (`sizes[i]` rows of member i)."""
        for member, size in zip(members, sizes):
            rows = len(getattr(member, cls.ROWS[0]))
            if rows != size:
                raise ValueError(f"a {cls.__name__} of {rows} rows packed as {size}")
        packed = cls(*([row for m in members for row in getattr(m, name)] for name in cls.ROWS))
        packed.varlen = varlen
        return packed


@dataclass(eq=False)
class BlockBatch(PackedRows):
    """The cache of one forward over several requests' blocks `[B, L]`: row b attends over
    `row_caches[b]` and its own block, and stores its block's K/V when `store[b]`."""

    row_caches: list[Any]
    store: list[bool]
    ROWS = ("row_caches", "store")
    _plan = (None, None)   # the varlen route's (cache lengths, VarlenPlan): one for the forward's layers

    def attend(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention: Any) -> torch.Tensor:
        """`attention(q, k, v)` (the model's unmasked attention over `[1, H, n, D]` tensors) for
        each row against its cache, as that row's own forward calls it; rows stacked back. With `varlen` and every
        row's cache in the engine's page store: `_attend_varlen`."""
        if self.varlen and all(isinstance(cache, BlockKVCache) for cache in self.row_caches):
            return self._attend_varlen(layer_idx, query, key, value)
        outputs = []
        for b, (cache, store) in enumerate(zip(self.row_caches, self.store)):
            k, v = key[b:b + 1], value[b:b + 1]
            k, v = cache.update(k, v, layer_idx) if store else _joined(_cached(cache, layer_idx), k, v)
            outputs.append(attention(query[b:b + 1], k, v))
        return torch.cat(outputs)

    def _attend_varlen(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor) -> torch.Tensor:
        """Every row in ONE `varlen_attention` call: its block's queries over its stored positions, read in place
        from the page store through its table, then its block's own K/V, all visible (the unmasked attention of a
        block over its cache, at the default scale 1/√D the block-causal families use); the storing rows' K/V
        written first. Each row's reduction order is its own whatever else is stacked (the kernel's)."""
        from remask.kernels.varlen_attention import varlen_attention, varlen_plan

        caches, (B, Hq, L, D) = self.row_caches, query.shape
        lengths = [cache.get_seq_length(layer_idx) for cache in caches]
        for b, (cache, store) in enumerate(zip(caches, self.store)):
            if store:
                cache.store_block(key[b:b + 1], value[b:b + 1], layer_idx)
        if self._plan[0] != lengths:
            self._plan = (lengths, varlen_plan([L] * B, lengths if any(lengths) else None, device=query.device))
        plan = self._plan[1]
        paged = {}
        if any(lengths):   # the tables read after the writes: a shared page found different was made private
            store, manager = caches[0].store, caches[0].manager
            pages = [t.view(-1, manager.page_size, *t.shape[1:]) for t in (store.keys[layer_idx],
                                                                            store.values[layer_idx])]
            paged = dict(k_cache=pages[0], v_cache=pages[1],
                         block_table=manager.block_tables([cache.table for cache in caches], query.device))
        rows = [t.transpose(1, 2).flatten(0, 1) for t in (query, key, value)]   # [B · L, H, D]
        return varlen_attention(*rows, plan, **paged).view(B, L, Hq, D).transpose(1, 2)


def _cached(cache: Any, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Stored K/V of a layer from a `BlockKVCache` or a transformers `Cache` (a contiguous `DynamicCache`)."""
    if isinstance(cache, BlockKVCache):
        return cache.cached(layer_idx)
    if layer_idx >= len(cache.layers) or cache.layers[layer_idx].keys is None:
        return None
    return cache.layers[layer_idx].keys, cache.layers[layer_idx].values


def _joined(cached: tuple[torch.Tensor, torch.Tensor] | None, key: torch.Tensor,
            value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The `cached` K/V (None: none) followed by `key`, `value` along the positions."""
    if cached is None:
        return key, value
    return torch.cat([cached[0], key], dim=-2), torch.cat([cached[1], value], dim=-2)

"""The engine's paged KV store for autoregressive models, and one flat (varlen) forward over it.

Each engine step runs all AR work (new prompts, one token of each running sequence) as one forward
over the sequences' tokens back to back (`[1, T]`, no padding); transformers' attention is swapped,
for that forward, for `paged_attention_forward`, which writes the new K/V into the pages and attends
each sequence over its own with the call and shapes it has alone (a prompt: causal over its fresh
keys; a new token: one query over its gathered keys), so its tokens equal `remask.ar_generate` on it
alone. Prefix sharing keeps a prompt page only where its K/V are bitwise those the sequence computes
(kernels may round a row differently for another prompt length): the sequence still computes its
whole prompt, compares layer by layer and goes copy-on-write on the first difference (docs/engine.md).
The same flat forward serves another model's causal continuations without pages (APD's verifier): each
sequence appends its new K/V to its own cache and attends over it as its own forward does. With
`LLMEngine(varlen_attention=True)` a layer's attention is one `varlen_attention` call instead (over the store:
`_varlen_layer`, the pages read in place; over own caches: pooled): its bits its own alone or batched, not SDPA's.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from remask.caches.page_manager import PagedKVStore
from remask.models.hf_compat import swapped_setting

ATTN_IMPLEMENTATION = "remask_paged"
_CURRENT: contextvars.ContextVar["ForwardBatch | None"] = contextvars.ContextVar("remask_forward_batch", default=None)


@dataclass(eq=False)
class SequenceSlice:
    """One sequence's part of a flat forward."""

    start: int                  # first of its rows in the flat batch
    q_len: int                  # its new tokens
    ctx_len: int                # positions with K/V once this forward is done (its own included)
    table: list[int]            # its pages (may be rewritten by copy-on-write)
    shared: int = 0             # leading prompt pages held with others, to verify (prefill only)
    new_slots: torch.Tensor | None = None   # where a decode's new K/V go
    # a sequence with a cache of its own (APD's verifier; no pages): its K/V appended there and attended over as in
    # its own forward, under the mask that forward has (`own_cache_mask`, set by `ForwardBatch`; with `varlen` the
    # boolean causal mask `[q_len, ctx_len]` its varlen segment takes)
    cache: Any = None
    mask: torch.Tensor | None = None

    @property
    def is_prefill(self) -> bool:
        return self.q_len == self.ctx_len


@dataclass(eq=False)
class ForwardBatch:
    """The layout of one flat forward: the sequences' slices in order, the store and allocator."""

    slices: list[SequenceSlice]
    store: PagedKVStore | None   # None: every slice has its own cache
    device: torch.device
    # `LLMEngine(varlen_attention=True)` over the store: each layer one `varlen_attention` call (`_varlen_layer`),
    # with this forward's plan and page tables
    varlen: bool = False
    plan: Any = None
    block_table: torch.Tensor | None = None
    pooled: Any = None   # the own-cache slices' `varlen_attention_each` plan (APD's verifier)
    # decodes grouped by context length: (slice indices, slots of their context `[G, ctx]`)
    decode_groups: list[tuple[list[int], torch.Tensor]] = field(default_factory=list)
    # rows of equal-length slices, for the batch-invariant linear layers (one batched GEMM each)
    token_groups: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    # every decode's new K/V: their rows in the flat batch and their slots in the store (one scatter per layer)
    decode_rows: torch.Tensor | None = None
    decode_slots: torch.Tensor | None = None

    def __post_init__(self) -> None:
        by_len: dict[int, list[int]] = {}   # q_len → rows
        by_ctx: dict[int, list[int]] = {}   # a decode's ctx_len → slice indices
        for i, s in enumerate(self.slices):
            by_len.setdefault(s.q_len, []).extend(range(s.start, s.start + s.q_len))
            if s.cache is not None:
                s.mask = own_cache_mask(s.ctx_len - s.q_len, s.q_len, self.device) if not self.varlen else \
                    torch.ones(s.q_len, s.ctx_len, dtype=torch.bool, device=self.device).tril(s.ctx_len - s.q_len)
            elif not s.is_prefill:
                by_ctx.setdefault(s.ctx_len, []).append(i)
        self.token_groups = [(length, torch.tensor(rows, dtype=torch.long, device=self.device))
                             for length, rows in by_len.items()]
        # Slots are computed once per forward, not once per layer: one gather over the group's page tables.
        manager = self.store.manager if self.store is not None else None
        for ctx_len, members in by_ctx.items():
            tables = [self.slices[i].table for i in members]
            if any(len(table) < manager.pages_for(ctx_len) for table in tables):
                raise ValueError(f"a page table covers fewer than its {ctx_len} positions")
            pos = torch.arange(ctx_len)
            pages = manager.block_tables(tables)[:, pos // manager.page_size].long()
            slots = (pages * manager.page_size + pos % manager.page_size).to(self.device)
            for j, i in enumerate(members):
                self.slices[i].new_slots = slots[j, ctx_len - self.slices[i].q_len:]
            self.decode_groups.append((members, slots))
        if self.varlen and self.store is not None:   # each slice: its cached positions, then its new rows, causal
            from remask.kernels.varlen_attention import CAUSAL, varlen_plan

            self.plan = varlen_plan([s.q_len for s in self.slices], [s.ctx_len - s.q_len for s in self.slices],
                                    [CAUSAL] * len(self.slices), device=self.device)
            self.block_table = manager.block_tables([s.table for s in self.slices], self.device)
        decodes = [self.slices[i] for members, _ in self.decode_groups for i in members]
        if decodes:
            self.decode_rows = torch.tensor([row for s in decodes for row in range(s.start, s.start + s.q_len)],
                                            dtype=torch.long, device=self.device)
            self.decode_slots = torch.cat([s.new_slots for s in decodes])


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                            **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature: q `[1, Hq, T, D]`, k/v `[1, H_kv, T, D]` (after
    RoPE) → `[1, T, Hq, D]`. Outside an engine forward it is plain SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward as sdpa

    batch = _CURRENT.get()
    if batch is None:
        return sdpa(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    layer = module.layer_idx
    new_k, new_v = key[0].transpose(0, 1), value[0].transpose(0, 1)        # [T, H_kv, D]
    k_store, v_store = batch.store.layer(layer, new_k) if batch.store is not None else (None, None)
    outputs: list[torch.Tensor | None] = [None] * len(batch.slices)
    pooled = []   # with `varlen`: the own-cache slices' (index, queries, keys, values, causal mask) for one call
    for i, s in enumerate(batch.slices):
        rows = slice(s.start, s.start + s.q_len)
        if s.cache is not None:   # its own cache: appended to, then attended over as its own forward does
            k, v = s.cache.update(key[:, :, rows], value[:, :, rows], layer)
            if batch.varlen:   # (its mask: causal, new row r sees the positions up to its own)
                pooled.append((i, query[0, :, rows].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                               s.mask))
                continue
            outputs[i] = sdpa(module, query[:, :, rows], k, v, s.mask, scaling=scaling, dropout=0.0)[0]
        elif s.is_prefill:   # shared prompt pages are verified (module docstring)
            s.shared = batch.store.write(layer, s.table, 0, new_k[rows], new_v[rows], s.shared)
            if batch.plan is not None:   # it attends in the varlen call
                continue
            # The prompt attends over its own fresh keys, exactly as it does alone.
            outputs[i] = sdpa(module, query[:, :, rows], key[:, :, rows], value[:, :, rows], None,
                              scaling=scaling, dropout=0.0)[0]
    if batch.decode_rows is not None:   # every decode's new K/V in one scatter (distinct slots: any order)
        k_store.index_copy_(0, batch.decode_slots, new_k[batch.decode_rows])
        v_store.index_copy_(0, batch.decode_slots, new_v[batch.decode_rows])
    if batch.plan is not None:
        return _varlen_layer(batch, query, new_k, new_v, k_store, v_store, scaling), None
    if pooled:
        from remask.kernels.varlen_attention import varlen_attention_each

        index, *sets = zip(*pooled)
        own, batch.pooled = varlen_attention_each(*sets, plan=batch.pooled, scale=scaling)
        for i, out in zip(index, own):
            outputs[i] = out[None]
    for members, slots in batch.decode_groups:
        # Sequences with as many positions attend together: SDPA's rows are independent.
        k = k_store[slots].permute(0, 2, 1, 3)                                                # [G, H_kv, ctx, D]
        v = v_store[slots].permute(0, 2, 1, 3)
        q = torch.cat([query[:, :, batch.slices[i].start:batch.slices[i].start + batch.slices[i].q_len]
                       for i in members])
        out = sdpa(module, q, k, v, None, scaling=scaling, dropout=0.0)[0]                   # [G, q, Hq, D]
        for j, i in enumerate(members):
            outputs[i] = out[j:j + 1]
    return torch.cat(outputs, dim=1), None


def _varlen_layer(batch: ForwardBatch, query: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor,
                  k_store: torch.Tensor, v_store: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """Every slice's attention in ONE `varlen_attention` call (`varlen_attention=True`): its new rows over its
    cached positions, read in place from the store through its page table, and over its new K/V, causally —
    `[1, T, Hq, D]`. Each row's reduction order is its own whatever else is in the forward (the kernel's)."""
    from remask.kernels.varlen_attention import varlen_attention

    pages = [t.view(-1, batch.store.manager.page_size, *t.shape[1:]) for t in (k_store, v_store)]
    return varlen_attention(query[0].transpose(0, 1), new_k, new_v, batch.plan, k_cache=pages[0], v_cache=pages[1],
                            block_table=batch.block_table, scale=scaling)[None]


def own_cache_mask(past: int, q_len: int, device: Any) -> torch.Tensor | None:
    """The mask transformers gives SDPA for `q_len` new tokens after `past` cached ones: none for one token or no
    past (a new token attends to all; a prompt is causal), else causal from `past` `[1, 1, q_len, past + q_len]`."""
    if q_len == 1 or past == 0:
        return None
    keys, queries = torch.arange(past + q_len, device=device), torch.arange(past, past + q_len, device=device)
    return (keys[None, :] <= queries[:, None])[None, None]


def _mask(*args: Any, **kwargs: Any) -> Any:
    """Inside an engine forward: no mask (each sequence's attention is causal over a prompt, full for
    a new token). Anywhere else (another thread on the same model meanwhile): transformers' own."""
    if _CURRENT.get() is not None:
        return None
    from transformers.masking_utils import sdpa_mask
    return sdpa_mask(*args, **kwargs)


@functools.cache
def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _mask)


_CONFIGS: "weakref.WeakKeyDictionary[torch.nn.Module, list[Any]]" = weakref.WeakKeyDictionary()


def attention_configs(model: torch.nn.Module) -> list[Any]:
    """The distinct configs whose `_attn_implementation` the model's attention layers read (found once per model)."""
    if model not in _CONFIGS:
        configs = [m.config for m in model.modules() if hasattr(m, "config") and hasattr(m.config, "_attn_implementation")]
        _CONFIGS[model] = list({id(c): c for c in configs}.values())
    return _CONFIGS[model]


@contextlib.contextmanager
def paged_forward(model: torch.nn.Module, batch: ForwardBatch) -> Iterator[None]:
    """Run the model's forwards inside with `paged_attention_forward` over `batch`, restoring its
    attention setting when the last thread inside leaves (the server's engines, each on its thread, may
    share a model: an AR engine's and an APD verifier's; a thread with no batch gets transformers' SDPA)."""
    register()
    token = _CURRENT.set(batch)
    try:
        with swapped_setting(attention_configs(model), "_attn_implementation", ATTN_IMPLEMENTATION):
            yield
    finally:
        _CURRENT.reset(token)

"""The forwards of a semi-autoregressive block under a KV-cache mode (Fast-dLLM's caches). Both block loops (LLaDA's,
Dream's) call `refresh` at a block start and `step` at every later step; which positions a forward computes is
decided here and nowhere else:

* ``None``: every forward is a full forward over all T positions.
* ``"prefix"``: the block-start forward builds the cache, cut at the block start; each step feeds the block and
  everything after it.
* ``"dual"``: the block-start forward keeps every position's K/V; each step feeds only the block, whose fresh K/V
  overwrite its entries in place.
* ``"paged"`` (or a `PagedKVCache`): dual, with the K/V outside the block in pages (the paged-attention kernel).

Keys are cached after RoPE (the references rotate every cached key again at every step: the same values).
"""
from __future__ import annotations

from typing import Any, Generator

import torch

from remask.caches import KVCache, PagedKVCache
from remask.models.spec import ModelSpec

from .stepper import ForwardRequest

CACHE_MODES = (None, "prefix", "dual", "paged")


def cache_mode(use_cache: Any) -> str | None:
    """The mode named by `use_cache` (a `PagedKVCache` instance means "paged"); clear error otherwise."""
    if isinstance(use_cache, PagedKVCache):
        return "paged"
    if not (use_cache is None or isinstance(use_cache, str)) or use_cache not in CACHE_MODES:
        raise ValueError(f"use_cache must be one of {list(CACHE_MODES)} or a PagedKVCache, got {use_cache!r}")
    return use_cache


def valid_positions(attention_mask: torch.Tensor | None, total_len: int) -> torch.Tensor | None:
    """`[B, total_len]` bool, False on the left pads of a `[B, P]` prompt mask (None: no padding)."""
    if attention_mask is None:
        return None
    return torch.nn.functional.pad(attention_mask.bool(), (0, total_len - attention_mask.shape[1]), value=True)


class BlockForward:
    """The block loop's forwards as sub-generators of `ForwardRequest`s (``yield from``), the cache's
    bookkeeping around each request (so either driver gets the same); `rows_alone`: each row's linears as alone
    (`ForwardRequest.rows_alone`)."""

    def __init__(self, spec: ModelSpec, use_cache: Any, forward_inputs: dict[str, Any],
                 valid: torch.Tensor | None, rows_alone: bool = False) -> None:
        self.spec, self.forward_inputs, self.valid, self.rows_alone = spec, forward_inputs, valid, rows_alone
        self.mode = cache_mode(use_cache)
        self.cache: KVCache | PagedKVCache | None = use_cache if isinstance(use_cache, PagedKVCache) else (
            PagedKVCache() if self.mode == "paged" else None)

    @property
    def cache_nbytes(self) -> int:
        return 0 if self.cache is None else self.cache.nbytes

    def refresh(self, x: torch.Tensor, start: int, end: int) -> Generator[ForwardRequest, Any, torch.Tensor]:
        """The block-start forward: logits `[B, T, V]`."""
        if self.mode == "paged":
            self.cache.begin_block(x, self.valid, start, end)
        elif self.mode is not None:
            self.cache = KVCache()
        return (yield from self.step(x, start, end, refresh=True))[0]

    def step(self, x: torch.Tensor, start: int, end: int,
             refresh: bool = False) -> Generator[ForwardRequest, Any, tuple[torch.Tensor, int]]:
        """(logits of the fed positions, the first one's index), per the mode (`refresh`: all, filling the cache)."""
        if self.mode is None:
            return (yield from self.span(x, 0, x.shape[1], None)), 0
        fed, fed_end = (0, x.shape[1]) if refresh else (start, x.shape[1] if self.mode == "prefix" else end)
        logits = yield from self.span(x, fed, fed_end, self.cache)
        if self.mode == "prefix":
            self.cache.crop(start)   # the suffix's K/V are recomputed at every step, never kept
        return logits, fed

    def span(self, inputs: torch.Tensor, lo: int, hi: int, cache: Any,
             write_at: int | None = None) -> Generator[ForwardRequest, Any, torch.Tensor]:
        """The logits of positions `[lo, hi)` of `inputs` (ids `[B, T]` or embeddings `[B, T, d]`) against
        `cache`, which the forward writes (from entry `write_at`, by default `lo`); without a cache, a full forward
        (logits of all T)."""
        T = inputs.shape[1]
        part = inputs if cache is None else inputs[:, lo:hi]
        ids, per_row = (part, {}) if inputs.dim() == 2 else (None, {"inputs_embeds": part})
        if cache is None:
            return (yield ForwardRequest.call(ids, {**self.forward_inputs, **per_row}, spec=self.spec,
                                              rows_alone=self.rows_alone))
        fwd = self.forward_inputs if (lo, hi) == (0, T) else self.spec.inputs_for_positions(self.forward_inputs, lo, hi)
        cache.write_start = lo if write_at is None else write_at   # the model reads it, not cache_position[0]
        return (yield ForwardRequest.call(ids, {**fwd, **per_row}, spec=self.spec, cache=cache,
                                          cache_position=torch.arange(lo, hi, device=inputs.device),
                                          rows_alone=self.rows_alone))

"""Torch references for the paged KV cache kernels (the CPU runtime and the tests' oracle).

Layout (flash-attn / vLLM): per layer, `k_cache`, `v_cache` `[num_pages, page_size, H_kv, D]`;
a sequence's position p lives in page `block_table[b, p // page_size]` at offset
`p % page_size`; `seq_lens[b]` positions are valid. A slot is `page * page_size + offset`.
"""
from __future__ import annotations

import operator

import torch


def check_block_size(block_size, q: torch.Tensor, k_new: torch.Tensor | None) -> int | None:
    """Validate paged attention's `block_size` (None, or a positive int with fresh K/V of q's
    length); returns it as an int."""
    if block_size is None:
        return None
    try:
        size = None if isinstance(block_size, bool) else operator.index(block_size)
    except TypeError:
        size = None
    if size is None or size <= 0:
        raise ValueError(f"block_size must be a positive int or None, got {block_size!r}")
    if k_new is None:
        raise ValueError("block_size needs the block's fresh keys: pass k_new and v_new")
    if k_new.dim() < 2 or q.dim() < 2 or k_new.shape[1] != q.shape[1]:
        raise ValueError(f"block_size needs as many fresh keys as queries (k_new N == q M), got k_new "
                         f"{tuple(k_new.shape)} and q {tuple(q.shape)}")
    return size


def paged_store_torch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write rows `k`, `v` `[N, H_kv, D]` to slots `slot_mapping` `[N]` (−1: skip), in place."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    page_size = k_cache.shape[1]
    k_cache[slots // page_size, slots % page_size] = k[keep].to(k_cache.dtype)
    v_cache[slots // page_size, slots % page_size] = v[keep].to(v_cache.dtype)


def paged_positions(block_table: torch.Tensor, seq_lens: torch.Tensor, max_len: int, page_size: int):
    """(page, offset, valid) `[B, max_len]` of every position of every sequence."""
    pos = torch.arange(max_len, device=block_table.device)
    page_index = (pos // page_size).clamp(max=block_table.shape[1] - 1)
    pages = block_table.long()[:, page_index]
    valid = pos[None, :] < seq_lens.long()[:, None]
    return pages.masked_fill(~valid, 0), (pos % page_size).expand_as(pages), valid


def paged_gather_torch(cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                       max_len: int | None = None) -> torch.Tensor:
    """Pages → contiguous `[B, max_len, H_kv, D]` (zeros past each sequence's length)."""
    max_len = int(seq_lens.max()) if max_len is None else max_len
    pages, offsets, valid = paged_positions(block_table, seq_lens, max_len, cache.shape[1])
    out = cache[pages, offsets]
    return out.masked_fill(~valid[:, :, None, None], 0)


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                          seq_lens: torch.Tensor, k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
                          scale: float | None = None, *, block_size: int | None = None) -> torch.Tensor:
    """Bidirectional attention of a block of queries `q` `[B, M, Hq, D]` over each sequence's
    paged K/V (its first `seq_lens[b]` positions) followed by the block's own fresh K/V
    `k_new`, `v_new` `[B, N, H_kv, D]` (optional). GQA: Hq is a multiple of H_kv. Computed in
    float32 over a gathered copy (the reference; the kernel never gathers). Returns q's dtype.

    `block_size` (block diffusion: causal across blocks, bidirectional inside one): query i and
    fresh key j sit at absolute positions `seq_lens[b] + i` and `seq_lens[b] + j` (M == N, k_new
    required); query i sees every cached key and fresh key j only when
    `(seq_lens[b] + j) // block_size <= (seq_lens[b] + i) // block_size`. None: bidirectional."""
    block_size = check_block_size(block_size, q, k_new)
    B, M, Hq, D = q.shape
    max_len = int(seq_lens.max()) if seq_lens.numel() else 0
    k = paged_gather_torch(k_cache, block_table, seq_lens, max_len).float()
    v = paged_gather_torch(v_cache, block_table, seq_lens, max_len).float()
    valid = torch.arange(max_len, device=q.device)[None, :] < seq_lens.long()[:, None]
    if k_new is not None:
        k = torch.cat([k, k_new.float()], dim=1)
        v = torch.cat([v, v_new.float()], dim=1)
        valid = torch.cat([valid, torch.ones((B, k_new.shape[1]), dtype=torch.bool, device=q.device)], dim=1)
    group = Hq // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scale = D ** -0.5 if scale is None else scale
    scores = torch.einsum("bmhd,bnhd->bhmn", q.float(), k) * scale
    if block_size is None:
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    else:   # [B, M, max_len + N]: every valid cached key, and the fresh keys of this or an earlier block
        start = seq_lens.long().to(q.device)[:, None, None]
        q_block = (start + torch.arange(M, device=q.device)[None, :, None]) // block_size
        k_block = (start + torch.arange(k_new.shape[1], device=q.device)[None, None, :]) // block_size
        visible = torch.cat([valid[:, None, :max_len].expand(B, M, max_len),
                             k_block <= q_block], dim=2)
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)   # a sequence with no keys attends to nothing
    return torch.einsum("bhmn,bnhd->bmhd", probs, v).to(q.dtype)

"""Torch reference for varlen attention (`varlen_attention.py`): the CPU runtime and the tests' oracle.

A pack of S segments (requests): segment s owns query rows `cu_seqlens[s] : cu_seqlens[s + 1]` of
`q` `[N, Hq, D]` (M_s rows) and the same rows of the in-forward `k`, `v` `[N, H_kv, D]` (its fresh
keys), after the `cache_lens[s]` positions of its cache, read through its row of `block_table`
from `k_cache`, `v_cache` `[num_pages, page_size, H_kv, D]` (the paged layout of `paged.py`).
Query i and fresh key j sit at positions `cache_lens[s] + i` and `cache_lens[s] + j`; cached key
p at p. Each segment's mask is `block_sizes[s]`: `BIDIRECTIONAL` (0) every key; `CAUSAL` (1) keys
at positions <= the query's; b > 1 block-causal, key p visible to the query at r iff
`p // b <= r // b` (every cached key is visible under all three), and optionally a boolean
`[M_s, cache_lens[s] + M_s]` mask of its own (row = query, columns = its keys, cache first), ANDed
in: `pack_masks` lays them out flat. A query with no visible key outputs zeros.

Each segment is computed alone (a loop, its own float32 tensors), so its rows never depend on the
other segments of the pack: batch invariance by construction.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .paged_ref import paged_gather_torch

BIDIRECTIONAL = 0   # `block_sizes` entry: every key visible
CAUSAL = 1          # block-causal with blocks of one position


def pack_masks(masks: Sequence[torch.Tensor | None], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-segment boolean masks (`[M_s, cache_lens[s] + M_s]` each, None: no mask of its own) →
    (`mask`: all of them flattened and concatenated, `mask_offsets` `[S]` int64: where segment s's
    starts, −1 for None), the layout `varlen_attention` takes."""
    flat, offsets, used = [], [], 0
    for m in masks:
        if m is None:
            offsets.append(-1)
            continue
        if m.dim() != 2 or m.dtype != torch.bool:
            raise ValueError(f"each mask must be a bool [M_s, cache_len + M_s] tensor, got {m.dtype} {tuple(m.shape)}")
        device = m.device if device is None else device
        flat.append(m.reshape(-1).to(device))
        offsets.append(used)
        used += m.numel()
    mask = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.bool, device=device)
    return mask, torch.tensor(offsets, dtype=torch.int64, device=device)


def segment_visible(cache_len: int, m: int, block_size: int, has_new: bool, device=None) -> torch.Tensor:
    """[m, cache_len + (m if has_new else 0)] bool: which keys each query of a segment sees under its
    mask kind (`block_sizes` entry), before its own mask."""
    n_new = m if has_new else 0
    q_pos = cache_len + torch.arange(m, device=device)
    k_pos = torch.arange(cache_len + n_new, device=device)
    if block_size == BIDIRECTIONAL:
        return torch.ones(m, cache_len + n_new, dtype=torch.bool, device=device)
    return (k_pos[None, :] // block_size) <= (q_pos[:, None] // block_size)


def varlen_attention_torch(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, cu_seqlens: torch.Tensor,
                           *, k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                           block_table: torch.Tensor | None = None, cache_lens: torch.Tensor | None = None,
                           block_sizes: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                           mask_offsets: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Varlen attention over a pack of segments (see the module docstring), in float32, one segment
    at a time over a gathered copy of its cached keys; returns `[N, Hq, D]` in q's dtype. The
    arguments are as `varlen_attention` takes them (validated there)."""
    N, Hq, D = q.shape
    scale = D ** -0.5 if scale is None else float(scale)
    bounds = cu_seqlens.tolist()
    S = len(bounds) - 1
    lens = [0] * S if cache_lens is None else cache_lens.tolist()
    kinds = [BIDIRECTIONAL] * S if block_sizes is None else block_sizes.tolist()
    offsets = [-1] * S if mask_offsets is None else mask_offsets.tolist()
    out = torch.zeros((N, Hq, D), dtype=torch.float32, device=q.device)
    for s in range(S):
        start, end = bounds[s], bounds[s + 1]
        m, cache_len = end - start, lens[s]
        if m == 0:
            continue
        # Fresh float32 copies (never views of the pack: no result may depend on where a segment sits).
        keys, values = [], []
        if cache_len:
            one = (block_table[s:s + 1], cache_lens[s:s + 1], cache_len)
            keys.append(paged_gather_torch(k_cache, *one)[0].to(torch.float32, copy=True))
            values.append(paged_gather_torch(v_cache, *one)[0].to(torch.float32, copy=True))
        if k is not None:
            keys.append(k[start:end].to(torch.float32, copy=True))
            values.append(v[start:end].to(torch.float32, copy=True))
        if not keys:
            continue
        key, value = torch.cat(keys), torch.cat(values)
        group = Hq // key.shape[1]
        key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
        scores = torch.einsum("mhd,nhd->hmn", q[start:end].to(torch.float32, copy=True), key) * scale
        visible = segment_visible(cache_len, m, kinds[s], k is not None, q.device)
        if offsets[s] >= 0:
            visible = visible & mask[offsets[s]:offsets[s] + visible.numel()].view(visible.shape)
        probs = torch.softmax(scores.masked_fill(~visible[None], float("-inf")), dim=-1).nan_to_num(0.0)
        out[start:end] = torch.einsum("hmn,nhd->mhd", probs, value)
    return out.to(q.dtype)

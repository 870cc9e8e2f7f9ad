"""Torch paths of block-sparse attention: the dense-mask oracle of the tests and the CPU runtime.

Shapes (see `sparse_attention.py` for the full contract):

* `q` `[B, Hq, Lq, D]`; `k`, `v` `[B, H_kv, Lk, D]`, or with `block_table` `[B, max_logical_blocks]`
  the paged layout `[num_pages, page_size == kv_block_size, H_kv, D]` of `paged.py`.
* `kv_num_blocks` `[B, Hq, n_q_blocks]`, `kv_indices` `[B, Hq, n_q_blocks, max_blocks]` (int32/int64):
  query block i of head (b, h) attends to the keys of logical blocks
  `kv_indices[b, h, i, :kv_num_blocks[b, h, i]]`, block j covering positions
  `[j·kv_block_size, (j+1)·kv_block_size)`; positions ≥ `kv_len[b]` never.

Entries past a list's count are junk, counts are clamped to `max_blocks`, and ids outside
`[0, n_kv_blocks)` are ignored (the kernel does the same, so neither reads out of bounds).
Ids within a list are assumed distinct. A query attending to nothing outputs zeros.
"""
from __future__ import annotations

import torch


def _index_lists(kv_num_blocks: torch.Tensor, kv_indices: torch.Tensor, n_kv_blocks: int):
    """(ids, ok) `[B, Hq, n_q_blocks, C]`, C the longest count: int64 block ids (0 where not ok)
    and whether the entry is a real, in-range list entry."""
    count = kv_num_blocks.long().clamp(0, kv_indices.shape[-1])
    longest = int(count.max()) if count.numel() else 0   # a host read; these are the CPU paths
    ids = kv_indices[..., :longest].long()
    ok = (torch.arange(longest, device=ids.device) < count[..., None]) & (ids >= 0) & (ids < n_kv_blocks)
    return ids.masked_fill(~ok, 0), ok


def _kv_limit(kv_len: torch.Tensor | None, default: int, batch: int, device) -> torch.Tensor:
    """`[B]` int64: positions at or past it are never attended."""
    limit = torch.full((batch,), default, dtype=torch.int64, device=device)
    return limit if kv_len is None else torch.minimum(kv_len.long(), limit)


def block_mask_to_dense(kv_num_blocks: torch.Tensor, kv_indices: torch.Tensor, q_block_size: int,
                        kv_block_size: int, Lq: int, Lk: int, kv_len: torch.Tensor | None = None) -> torch.Tensor:
    """The block lists as a dense bool mask `[B, Hq, Lq, Lk]` (True: query may attend to key)."""
    B, Hq, n_qb = kv_num_blocks.shape
    n_kv_blocks = -(-Lk // kv_block_size)
    ids, ok = _index_lists(kv_num_blocks, kv_indices, n_kv_blocks)
    # Entries that are not ok scatter into a spare column that is dropped afterwards.
    blocks = torch.zeros((B, Hq, n_qb, n_kv_blocks + 1), dtype=torch.bool, device=kv_indices.device)
    blocks.scatter_(-1, ids.masked_fill(~ok, n_kv_blocks), True)
    dense = blocks[..., :n_kv_blocks].repeat_interleave(kv_block_size, dim=-1)[..., :Lk]
    dense = dense.repeat_interleave(q_block_size, dim=2)[:, :, :Lq]
    limit = _kv_limit(kv_len, Lk, B, dense.device)
    return dense & (torch.arange(Lk, device=dense.device) < limit[:, None, None, None])


def pages_to_contiguous(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """Paged `[num_pages, page_size, H_kv, D]` → `[B, H_kv, max_logical_blocks·page_size, D]`
    (junk table entries are clamped into range; the mask decides what is attended)."""
    pages = block_table.long().clamp(0, cache.shape[0] - 1)
    rows = cache[pages]                                    # [B, n_blocks, page_size, H_kv, D]
    return rows.flatten(1, 2).transpose(1, 2)


def block_sparse_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                     kv_num_blocks: torch.Tensor, kv_indices: torch.Tensor, *,
                                     q_block_size: int, kv_block_size: int, kv_len: torch.Tensor | None = None,
                                     block_table: torch.Tensor | None = None,
                                     scale: float | None = None) -> torch.Tensor:
    """The oracle: dense float32 attention with `block_mask_to_dense`'s mask (pages gathered to
    the contiguous layout first); rows with no allowed key are 0. Returns q's dtype."""
    if block_table is not None:
        k, v = pages_to_contiguous(k, block_table), pages_to_contiguous(v, block_table)
    B, Hq, Lq, D = q.shape
    Lk = k.shape[2]
    group = Hq // k.shape[1]
    scale = D ** -0.5 if scale is None else scale
    mask = block_mask_to_dense(kv_num_blocks, kv_indices, q_block_size, kv_block_size, Lq, Lk, kv_len)
    kf = k.float().repeat_interleave(group, dim=1)
    # Values no query may read (junk pages, the tail past kv_len) must not reach the product as
    # 0 · NaN: zero them.
    vf = v.float().repeat_interleave(group, dim=1).masked_fill(~mask.any(dim=2)[..., None], 0.0)
    scores = (q.float() @ kf.transpose(-1, -2)) * scale
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    probs = probs.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)   # all −inf rows softmax to NaN
    return (probs @ vf).to(q.dtype)


def _same_within_groups(ids: torch.Tensor, ok: torch.Tensor, h_kv: int) -> bool:
    """Whether every query head of a GQA group has the same list (entries and order)."""
    B, Hq, n_qb, C = ids.shape
    tagged = ids.masked_fill(~ok, -1).view(B, h_kv, Hq // h_kv, n_qb, C)
    return bool((tagged == tagged[:, :, :1]).all())


def _shared_positions(ids: torch.Tensor, ok: torch.Tensor, kv_block_size: int,
                      limit: torch.Tensor) -> list[torch.Tensor] | None:
    """Per row, the key positions of a single query block when every head lists the same blocks
    and every listed position is valid (`[P_b]` int64 each); None otherwise."""
    if not bool((ids == ids[:, :1]).all()) or not bool((ok == ok[:, :1]).all()):
        return None
    within = torch.arange(kv_block_size, device=ids.device)
    rows = []
    for b in range(ids.shape[0]):
        pos = (ids[b, 0, 0][ok[b, 0, 0]][:, None] * kv_block_size + within).reshape(-1)
        if pos.numel() == 0 or not bool((pos < limit[b]).all()):
            return None
        rows.append(pos)
    return rows


def block_sparse_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 kv_num_blocks: torch.Tensor, kv_indices: torch.Tensor, *,
                                 q_block_size: int, kv_block_size: int, kv_len: torch.Tensor | None = None,
                                 block_table: torch.Tensor | None = None,
                                 scale: float | None = None) -> torch.Tensor:
    """The CPU runtime: per (b, head, query block), gather the listed key positions (lists padded
    to the longest with masked dummies) into `[B, H, n_q_blocks, positions, D]` and attend over
    them only, in float32; never forms the dense Lq × Lk scores. When the heads of each GQA group
    share their lists, the keys are gathered once per KV head and the group's queries are stacked.
    Same contract as the kernel; returns q's dtype."""
    B, Hq, Lq, D = q.shape
    paged = block_table is not None
    h_kv = k.shape[2] if paged else k.shape[1]
    group = Hq // h_kv
    n_qb = kv_num_blocks.shape[2]
    given_scale = scale
    scale = D ** -0.5 if scale is None else scale
    if paged:
        n_kv_blocks = block_table.shape[1]
        capacity = n_kv_blocks * kv_block_size
    else:
        capacity = k.shape[2]
        n_kv_blocks = -(-capacity // kv_block_size)
    ids, ok = _index_lists(kv_num_blocks, kv_indices, n_kv_blocks)
    if not paged and n_qb == 1 and q_block_size >= Lq:
        shared = _shared_positions(ids, ok, kv_block_size, _kv_limit(kv_len, capacity, B, q.device))
        if shared is not None:
            # One query block whose positions are all valid and the same for every head (token
            # retention): gather them once per row with index_select, then SDPA in list order — the
            # computation upstream runs on its copied [kept ; block] K/V.
            out = []
            for b, pos in enumerate(shared):
                kk, vv = k[b].index_select(1, pos).to(q.dtype), v[b].index_select(1, pos).to(q.dtype)
                if group > 1:
                    kk, vv = kk.repeat_interleave(group, dim=0), vv.repeat_interleave(group, dim=0)
                out.append(torch.nn.functional.scaled_dot_product_attention(q[b:b + 1], kk[None], vv[None],
                                                                            scale=given_scale))
            return torch.cat(out)
    if group > 1 and _same_within_groups(ids, ok, h_kv):
        ids, ok = ids[:, ::group], ok[:, ::group]
        heads, kv_head = h_kv, torch.arange(h_kv, device=q.device)
    else:
        heads, kv_head = Hq, torch.arange(Hq, device=q.device) // group
    within = torch.arange(kv_block_size, device=q.device)
    pos = ids[..., None] * kv_block_size + within                # [B, heads, n_qb, C, kv_block_size]
    limit = _kv_limit(kv_len, capacity, B, q.device)
    valid = ok[..., None] & (pos < limit[:, None, None, None, None])
    if not bool(valid.any()):
        return torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    head_index = kv_head[None, :, None, None, None]
    if paged:
        pages = block_table.long().gather(1, ids.flatten(1)).view_as(ids).masked_fill(~ok, 0)
        pages = pages[..., None].expand(pos.shape)
        kk, vv = k[pages, within, head_index], v[pages, within, head_index]
    else:
        batch_index = torch.arange(B, device=q.device)[:, None, None, None, None]
        rows = pos.masked_fill(~valid, 0)
        kk, vv = k[batch_index, head_index, rows], v[batch_index, head_index, rows]
    valid = valid.flatten(3, 4)                                    # [B, heads, n_qb, P]
    kk = kk.flatten(3, 4).float()                                  # [B, heads, n_qb, P, D]
    # Padding entries read some row (page 0, position 0) that may hold anything, NaN included;
    # their scores are masked below and their values zeroed so 0 · NaN cannot appear.
    vv = vv.flatten(3, 4).float().masked_fill(~valid[..., None], 0.0)
    padded = n_qb * q_block_size
    qf = torch.nn.functional.pad(q.float(), (0, 0, 0, padded - Lq))
    if heads == Hq:
        qx = qf.view(B, Hq, n_qb, q_block_size, D)
    else:  # the group's query rows of one block attend together to their KV head's keys
        qx = qf.view(B, h_kv, group, n_qb, q_block_size, D).transpose(2, 3).reshape(
            B, h_kv, n_qb, group * q_block_size, D)
    scores = (qx @ kk.transpose(-1, -2)) * scale                   # [B, heads, n_qb, rows, P]
    probs = torch.softmax(scores.masked_fill(~valid[..., None, :], float("-inf")), dim=-1)
    probs = probs.masked_fill(~valid.any(dim=-1)[..., None, None], 0.0)   # empty lists: zeros, not NaN
    out = probs @ vv
    if heads != Hq:
        out = out.view(B, h_kv, n_qb, group, q_block_size, D).transpose(2, 3)
    out = out.reshape(B, Hq, padded, D)[:, :, :Lq]
    return out.to(q.dtype)

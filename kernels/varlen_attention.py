"""Varlen attention: one launch for a whole pack of requests (segments), each query row attending
only its own segment's keys — its cached prefix read in place through its block table, then its
in-forward K/V — under its own mask kind. Semantics and layout: `varlen_attention_ref.py`.

Batch invariance by construction: a program owns one tile of one segment's query rows (tiles start
at the segment's first row) and one query head, and walks that segment's keys in tiles of BLOCK_N
counted from the segment's first key (cache tiles in position order, then fresh tiles); BLOCK_M,
BLOCK_N and `num_warps` depend on (D, dtype) only (`varlen_attention_config`), never on the pack. So
a row's scores, its online-softmax updates and their order are the same whatever else is packed
with it, and its output is bitwise its output alone (tests/test_kernel_varlen_attention.py, under
the interpreter; the same argument holds compiled: one program's code and data do not change).

Why a kernel of our own (tried on the CPU box with torch 2.13.0, reasoned for the GPU; the figures
are in docs/kernels.md, "Varlen attention"):

* `torch.nn.attention.varlen.varlen_attn` (flash-attention; `block_table` + `seqused_k` for paged
  K/V, `num_splits=1` for batch invariance) has no CPU kernel (NotImplementedError for
  `aten::_flash_attention_forward`), takes fp16 / bf16 only (float32 is remask's reproduction
  dtype), and masks only causally or by sliding window: no block-causal, no per-query masks. Its
  paged keys must be all the keys, so every step would first copy the in-forward K/V into pages
  (a dual cache's block and a prefix cache's suffix included).
* FlexAttention (`flex_attention` + `create_block_mask`, a document mask over the packed sequence;
  `experimental._paged_attention` for pages) expresses every mask kind, but its KV tiles are
  aligned to the packed key sequence, not to each segment: where a segment's keys fall into tiles
  (and which tiles are partial) moves with its offset in the pack, so each row's reduction order
  depends on its batch-mates (its CPU path already gives a segment other bits packed than alone).
  It also needs one K/V sequence (the fresh rows copied into pages every step) and a BlockMask
  built per step on the host, over every (query block, key block) pair of the whole pack.
* FlashInfer (batch prefill over paged K/V with custom masks) is not a dependency, needs CUDA and
  fp16 / bf16, and its paged path also wants the fresh K/V appended to the pages first.

Layout: q `[N, Hq, D]`, k / v `[N, H_kv, D]` (or None: cache only), any strides with the last dim
contiguous; k_cache / v_cache `[num_pages, page_size, H_kv, D]` (last two dims contiguous, as
paged.py); block_table `[S, max_pages]`; cu_seqlens `[S + 1]`; cache_lens, block_sizes,
mask_offsets `[S]`. Index arithmetic is int64. The dots are paged.py's (`_dot`: bf16 / fp16 MMAs,
float32 as IEEE float32, never TF32), accumulated in float32.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from .dispatch import HAS_TRITON, next_power_of_2, use_triton
from .paged import low_precision_dot
from .varlen_attention_ref import BIDIRECTIONAL, CAUSAL, pack_masks, varlen_attention_torch

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .paged import _attend_tile, _attend_tile_masked, _load_q, _load_rows, _mma_operand

    @triton.jit
    def _own_mask(mask_ptr, offset, rows, keys, width, inside):
        # The segment's own mask on a [BLOCK_M, BLOCK_N] tile (row-major [M, width] from `offset`);
        # all true where it has none (offset < 0) or outside the segment. The test is broadcast from
        # the rows (a scalar one trips the interpreter: "mask has unsupported dtype").
        ok = inside & ((rows[:, None] * 0 + offset) >= 0)
        bits = tl.load(mask_ptr + offset + rows[:, None].to(tl.int64) * width + keys[None, :].to(tl.int64),
                       mask=ok, other=1)
        return bits != 0

    @triton.jit
    def varlen_attention_kernel(q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, bt_ptr, cu_ptr, len_ptr, blk_ptr,
                                mask_ptr, moff_ptr, tile_seg_ptr, tile_row_ptr, o_ptr,
                                stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
                                stride_kcp, stride_kcs, stride_kch, stride_vcp, stride_vcs, stride_vch,
                                stride_bts, stride_on, stride_oh,
                                D, PAGE_SIZE, scale,
                                GROUP: tl.constexpr, HAS_CACHE: tl.constexpr, HAS_NEW: tl.constexpr,
                                HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                BLOCK_D: tl.constexpr, LOW_PRECISION_DOT: tl.constexpr):
        tile = tl.program_id(0)
        h = tl.program_id(1).to(tl.int64)
        kvh = h // GROUP
        seg = tl.load(tile_seg_ptr + tile).to(tl.int64)
        row0 = tl.load(tile_row_ptr + tile).to(tl.int64)
        if row0 < 0:          # past the pack's last tile (the grid is an upper bound)
            return
        q_start = tl.load(cu_ptr + seg).to(tl.int64)
        M = tl.load(cu_ptr + seg + 1).to(tl.int64) - q_start
        if HAS_CACHE:
            C = tl.load(len_ptr + seg).to(tl.int64)
        else:
            C = tl.zeros([], tl.int64)
        # Block size of the mask kind: 0 (bidirectional) → one block holding every position.
        blk = tl.load(blk_ptr + seg).to(tl.int64)
        blk = tl.where(blk <= 0, C + M + 1, blk)
        if HAS_MASK:
            moff = tl.load(moff_ptr + seg).to(tl.int64)
        else:
            moff = tl.full([], -1, tl.int64)
        width = C + M if HAS_NEW else C
        rows = row0 + tl.arange(0, BLOCK_M).to(tl.int64)
        row_ok = rows < M
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        q, qk_scale = _load_q(q_ptr + (q_start + rows)[:, None] * stride_qn + h * stride_qh + d[None, :],
                              row_ok[:, None] & d_ok[None, :], scale, LOW_PRECISION_DOT)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        cols = tl.arange(0, BLOCK_N).to(tl.int64)
        if HAS_CACHE:
            # Every cached key precedes every query: visible under each mask kind.
            for n0 in range(0, C, BLOCK_N):
                pos = n0 + cols
                valid = pos < C
                page = tl.load(bt_ptr + seg * stride_bts + pos // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
                offset = pos % PAGE_SIZE
                tile_ok = valid[:, None] & d_ok[None, :]
                k = _mma_operand(tl.load(kc_ptr + page[:, None] * stride_kcp + offset[:, None] * stride_kcs
                                         + kvh * stride_kch + d[None, :], mask=tile_ok, other=0.0), LOW_PRECISION_DOT)
                v = _mma_operand(tl.load(vc_ptr + page[:, None] * stride_vcp + offset[:, None] * stride_vcs
                                         + kvh * stride_vch + d[None, :], mask=tile_ok, other=0.0), LOW_PRECISION_DOT)
                if HAS_MASK:
                    visible = _own_mask(mask_ptr, moff, rows, pos, width, row_ok[:, None] & valid[None, :])
                    visible = visible & valid[None, :]
                    m_i, l_i, acc = _attend_tile_masked(q, k, v, visible, m_i, l_i, acc, qk_scale, LOW_PRECISION_DOT)
                else:
                    m_i, l_i, acc = _attend_tile(q, k, v, valid, m_i, l_i, acc, qk_scale, LOW_PRECISION_DOT)
        if HAS_NEW:
            # Fresh key j / query i at C + j / C + i: i sees j when (C + j) // blk <= (C + i) // blk.
            # Keys below `n_all` are visible to every row of this tile, keys from `n_end` on to none
            # (never loaded); the tiles between are masked per element.
            row_last = tl.minimum(row0 + BLOCK_M, M) - 1
            n_all = tl.minimum(((C + row0) // blk + 1) * blk - C, M)
            n_end = tl.minimum(((C + row_last) // blk + 1) * blk - C, M)
            n_full = (n_all // BLOCK_N) * BLOCK_N
            if HAS_MASK:
                n_full = n_full * 0
            base_k = q_start * stride_kn + kvh * stride_kh
            base_v = q_start * stride_vn + kvh * stride_vh
            for n0 in range(0, n_full, BLOCK_N):
                n = n0 + cols
                valid = n < M
                tile_ok = valid[:, None] & d_ok[None, :]
                k = _load_rows(k_ptr, base_k, n, stride_kn, d, tile_ok, LOW_PRECISION_DOT)
                v = _load_rows(v_ptr, base_v, n, stride_vn, d, tile_ok, LOW_PRECISION_DOT)
                m_i, l_i, acc = _attend_tile(q, k, v, valid, m_i, l_i, acc, qk_scale, LOW_PRECISION_DOT)
            q_block = (C + rows) // blk
            for n0 in range(n_full, n_end, BLOCK_N):
                n = n0 + cols
                valid = n < n_end
                tile_ok = valid[:, None] & d_ok[None, :]
                k = _load_rows(k_ptr, base_k, n, stride_kn, d, tile_ok, LOW_PRECISION_DOT)
                v = _load_rows(v_ptr, base_v, n, stride_vn, d, tile_ok, LOW_PRECISION_DOT)
                visible = valid[None, :] & (((C + n) // blk)[None, :] <= q_block[:, None])
                if HAS_MASK:
                    visible = visible & _own_mask(mask_ptr, moff, rows, C + n, width,
                                                  row_ok[:, None] & valid[None, :])
                m_i, l_i, acc = _attend_tile_masked(q, k, v, visible, m_i, l_i, acc, qk_scale, LOW_PRECISION_DOT)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(o_ptr + (q_start + rows)[:, None] * stride_on + h * stride_oh + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


# The register cap of 16-bit launches: ptxas' own choice at 8 warps (128 registers) spilled 4 B on
# sm_100 without a cache; told 168 it used 125 and spilled nothing. Float32 launches get none (capped
# at 168, sm_100 spilled 4 B; uncapped it used 128 and spilled nothing). No result depends on it.
MAX_REGISTERS = 168


def varlen_attention_config(head_dim: int, dtype: torch.dtype, low_precision: bool = True) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): a function of the head dim and dtype only, never of the pack
    (what makes each row's reduction order independent of its batch-mates). 32-row query tiles: the
    diffusion blocks remask runs are 4 … 64 queries per request, so a 64-row tile would leave most
    of its rows idle for the common 32-token block. Key tiles of 32, or 16 for float32 operands
    (`low_precision` False), whose FMA dots hold float32 tiles: with 32 the cache tiles' per-row
    page addresses took sm_80 to 255 registers and 48 B of spills at D = 128. 8 warps from D = 128
    on (at 4, sm_90 spilled 12 B with bf16 operands) and for float32 operands, else 4. 16-bit
    launches also cap registers at `MAX_REGISTERS`."""
    return BLOCK_M, (32 if low_precision else 16), 8 if head_dim > 64 or not low_precision else 4


BLOCK_M = 32     # query rows per program, whatever the head dim or dtype: `VarlenPlan`'s tiles are built for it


def _int_vector(name: str, t: torch.Tensor | None, S: int, device) -> None:
    if t is None:
        return
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape[0] != S or t.is_floating_point() \
            or t.dtype == torch.bool:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be an int tensor [S={S}], got {getattr(t, 'dtype', '')} {shape}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, q on {device}")


def _check(q, k, v, cu_seqlens, k_cache, v_cache, block_table, cache_lens, block_sizes, mask, mask_offsets,
           plan=None):
    if q.dim() != 3:
        raise ValueError(f"q must be [N, Hq, D], got {tuple(q.shape)}")
    N, Hq, D = q.shape
    if not q.is_floating_point():
        raise ValueError(f"q must be a float tensor, got {q.dtype}")
    if (k is None) != (v is None):
        raise ValueError("pass both k and v, or neither (cache only)")
    if (k_cache is None) != (v_cache is None) or (k_cache is None) != (block_table is None) \
            or (k_cache is None) != (cache_lens is None):
        raise ValueError("pass k_cache, v_cache, block_table and cache_lens together, or none of them")
    if k is None and k_cache is None:
        raise ValueError("no keys: pass k and v, or a cache (k_cache, v_cache, block_table, cache_lens)")
    H_kv = (k if k is not None else k_cache).shape[-2]
    if k is not None:
        if k.shape != v.shape or k.dim() != 3 or k.shape[0] != N or k.shape[2] != D:
            raise ValueError(f"k and v must be [N={N}, H_kv, D={D}], got {tuple(k.shape)} and {tuple(v.shape)}")
        for name, t in (("k", k), ("v", v)):
            if not t.is_floating_point() or t.device != q.device:
                raise ValueError(f"{name} must be a float tensor on q's device, got {t.dtype} on {t.device}")
    if Hq % H_kv:
        raise ValueError(f"q heads ({Hq}) must be a multiple of the K/V heads ({H_kv})")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2 or cu_seqlens.is_floating_point() \
            or cu_seqlens.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must be an int tensor [S + 1] (S >= 1), got {cu_seqlens.dtype} "
                         f"{tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device}, q on {q.device}")
    S = cu_seqlens.shape[0] - 1
    bounds = cu_seqlens.long() if plan is None or mask is not None else None   # a copy: a launch on a GPU
    if plan is not None:
        if plan.num_rows != N:
            raise ValueError(f"plan covers {plan.num_rows} query rows, q has N={N}")
    elif int(bounds[0]) != 0 or int(bounds[-1]) != N or bool((bounds[1:] < bounds[:-1]).any()):
        raise ValueError(f"cu_seqlens must rise from 0 to N={N}, got {cu_seqlens.tolist()}")
    if k_cache is not None:
        if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[2:] != (H_kv, D):
            raise ValueError(f"k_cache and v_cache must both be [num_pages, page_size, H_kv={H_kv}, D={D}], got "
                             f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if c.stride(3) != 1 or c.stride(2) != c.shape[3]:
                raise ValueError(f"{name} must be contiguous in its last two dims (H_kv, D)")
            if not c.is_floating_point() or c.device != q.device:
                raise ValueError(f"{name} must be a float tensor on q's device, got {c.dtype} on {c.device}")
        if block_table.dtype not in (torch.int32, torch.int64) or block_table.dim() != 2 \
                or block_table.shape[0] != S or block_table.device != q.device:
            raise ValueError(f"block_table must be int32/int64 [S={S}, max_pages] on q's device, got "
                             f"{block_table.dtype} {tuple(block_table.shape)}")
        _int_vector("cache_lens", cache_lens, S, q.device)
        capacity = block_table.shape[1] * k_cache.shape[1]
        if plan is not None:
            if plan.max_cache_len > capacity:
                raise ValueError(f"plan's cache_lens reach {plan.max_cache_len}, past the block_table capacity "
                                 f"{block_table.shape[1]} pages × page_size {k_cache.shape[1]}")
        elif S and (int(cache_lens.min()) < 0 or int(cache_lens.max()) > capacity):
            raise ValueError(f"cache_lens must lie in [0, block_table capacity {block_table.shape[1]} pages × "
                             f"page_size {k_cache.shape[1]}], got {cache_lens.tolist()}")
    _int_vector("block_sizes", block_sizes, S, q.device)
    if plan is None and block_sizes is not None and S and int(block_sizes.min()) < 0:
        raise ValueError(f"block_sizes must be >= 0 (0 bidirectional, 1 causal, b block-causal), got "
                         f"{block_sizes.tolist()}")
    if k is None and (not plan.all_bidirectional if plan is not None
                      else block_sizes is not None and bool((block_sizes != BIDIRECTIONAL).any())):
        raise ValueError("block_sizes other than bidirectional need the in-forward keys: pass k and v")
    if (mask is None) != (mask_offsets is None):
        raise ValueError("pass both mask and mask_offsets (pack_masks), or neither")
    if mask is not None:
        if mask.dtype != torch.bool or mask.dim() != 1 or mask.device != q.device:
            raise ValueError(f"mask must be a flat bool tensor on q's device (pack_masks), got {mask.dtype} "
                             f"{tuple(mask.shape)}")
        _int_vector("mask_offsets", mask_offsets, S, q.device)
        rows = bounds[1:] - bounds[:-1]
        width = rows * (k is not None) + (cache_lens.long() if cache_lens is not None else 0)
        ends = torch.where(mask_offsets >= 0, mask_offsets.long() + rows * width, 0)
        if S and (int(ends.max()) > mask.shape[0] or int(mask_offsets.min()) < -1):
            raise ValueError(f"mask_offsets {mask_offsets.tolist()} reach past mask ({mask.shape[0]} entries; "
                             f"segment s needs M_s × (cache_len + M_s) from its offset, −1 for none)")
    return S, H_kv


class VarlenPlan(NamedTuple):
    """A pack's segment metadata, checked on the host and moved to the device in one copy, made once
    per engine step and passed to every layer's `varlen_attention` in place of `cu_seqlens`: the
    calls then read no value back from the device (no sync) and launch nothing but the kernel. On an
    H200 the per-call checks and tile table cost 6 syncs and ~10 small launches, 0.5 ms per call
    against a 29 µs kernel (bench/results/gpu-h200-2026-11-29.md). Made by `varlen_plan`."""
    cu_seqlens: torch.Tensor           # [S + 1] int32
    cache_lens: torch.Tensor | None    # [S] int32, None: no cache
    block_sizes: torch.Tensor          # [S] int32
    tile_seg: torch.Tensor             # [tiles] int32: each BLOCK_M tile's segment ...
    tile_row: torch.Tensor             # ... and first row within it
    num_rows: int                      # N, the pack's query rows
    max_cache_len: int
    all_bidirectional: bool


def varlen_plan(seq_lens: Sequence[int], cache_lens: Sequence[int] | None = None,
                block_sizes: Sequence[int] | None = None, *, device: torch.device | str | None = None) -> VarlenPlan:
    """The `VarlenPlan` of a pack whose segment s has `seq_lens[s]` query rows (and fresh keys),
    `cache_lens[s]` cached positions (None: no cache) and mask kind `block_sizes[s]` (default all
    `BIDIRECTIONAL`), on `device`. Every value is checked here, on the host."""
    S = len(seq_lens)
    if S == 0:
        raise ValueError("seq_lens must name at least one segment")
    for name, values in (("seq_lens", seq_lens), ("cache_lens", cache_lens), ("block_sizes", block_sizes)):
        if values is None:
            continue
        if len(values) != S:
            raise ValueError(f"{name} must have one entry per segment (S={S}), got {len(values)}")
        if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in values):
            raise ValueError(f"{name} must be ints >= 0, got {list(values)}")
    kinds = [BIDIRECTIONAL] * S if block_sizes is None else list(block_sizes)
    bounds, tile_seg, tile_row = [0], [], []
    for s, m in enumerate(seq_lens):
        bounds.append(bounds[-1] + m)
        tile_seg += [s] * -(-m // BLOCK_M)
        tile_row += range(0, m, BLOCK_M)
    lens = [] if cache_lens is None else list(cache_lens)
    # One host tensor, one copy: cu_seqlens | cache_lens | block_sizes | tile_seg | tile_row.
    flat = torch.tensor(bounds + lens + kinds + tile_seg + tile_row, dtype=torch.int32).to(device)
    parts = flat.split([S + 1, len(lens), S, len(tile_seg), len(tile_row)])
    return VarlenPlan(parts[0], parts[1] if cache_lens is not None else None, parts[2], parts[3], parts[4],
                      bounds[-1], max(lens, default=0), all(b == BIDIRECTIONAL for b in kinds))


def varlen_attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                     cu_seqlens: torch.Tensor | VarlenPlan, *,
                     k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                     block_table: torch.Tensor | None = None, cache_lens: torch.Tensor | None = None,
                     block_sizes: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                     mask_offsets: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Attention of a pack of segments in one launch: segment s's queries `q[cu_seqlens[s]:cu_seqlens[s+1]]`
    (`[N, Hq, D]`) attend its `cache_lens[s]` cached positions (pages of `k_cache` / `v_cache`
    `[num_pages, page_size, H_kv, D]` through `block_table[s]`) and then its own rows of `k` / `v`
    `[N, H_kv, D]` (None: its cache only), under its `block_sizes[s]` (0 = `BIDIRECTIONAL`, 1 =
    `CAUSAL`, b = block-causal; positions count from the segment's first cached key; default all
    bidirectional) ANDed with its own boolean mask (`mask`, `mask_offsets` from `pack_masks`).
    GQA when Hq is a multiple of H_kv; float32 accumulation (16-bit MMAs when every operand is
    bf16 or every one fp16, else float32 IEEE dots); `scale` default D^-½. Returns `[N, Hq, D]` in
    q's dtype; a query with no visible key gets zeros. Each row's output is bitwise independent of
    the other segments of the pack (both paths). Triton on CUDA (or `REMASK_TRITON=1`), else the
    torch reference. `cu_seqlens` may be a `VarlenPlan` (`varlen_plan`), which carries the
    segments' cache_lens and block_sizes too: pass neither then."""
    plan, tiles = None, None
    if isinstance(cu_seqlens, VarlenPlan):
        if cache_lens is not None or block_sizes is not None:
            raise ValueError("a VarlenPlan carries cache_lens and block_sizes: pass neither with it")
        if (k_cache is None) != (cu_seqlens.cache_lens is None):
            raise ValueError("k_cache, v_cache and block_table go with a plan made with cache_lens, and only with one")
        plan, tiles = cu_seqlens, (cu_seqlens.tile_seg, cu_seqlens.tile_row)
        cu_seqlens, cache_lens, block_sizes = plan.cu_seqlens, plan.cache_lens, plan.block_sizes
    S, H_kv = _check(q, k, v, cu_seqlens, k_cache, v_cache, block_table, cache_lens, block_sizes, mask, mask_offsets,
                     plan)
    N, Hq, D = q.shape
    scale = D ** -0.5 if scale is None else float(scale)
    if not use_triton(q):
        return varlen_attention_torch(q, k, v, cu_seqlens, k_cache=k_cache, v_cache=v_cache, block_table=block_table,
                                      cache_lens=cache_lens, block_sizes=block_sizes, mask=mask,
                                      mask_offsets=mask_offsets, scale=scale)
    return varlen_attention_triton(q, k, v, cu_seqlens, k_cache, v_cache, block_table, cache_lens, block_sizes,
                                   mask, mask_offsets, scale, tiles)


def query_tiles(cu_seqlens: torch.Tensor, n_rows: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(segment, first row within it) of every BLOCK_M tile of every segment's queries, computed on
    cu_seqlens' device without a host sync: `S + n_rows // block_m` entries (an upper bound on the
    tiles; the grid), the unused ones at the end with row −1. Tiles start at each segment's first row."""
    bounds = cu_seqlens.long()
    S = bounds.shape[0] - 1
    n_tiles = (bounds[1:] - bounds[:-1] + block_m - 1) // block_m
    ends = torch.cumsum(n_tiles, 0)
    t = torch.arange(S + n_rows // block_m, device=cu_seqlens.device)
    seg = torch.searchsorted(ends, t, right=True)
    used = seg < S
    seg = seg.clamp(max=S - 1)
    row0 = torch.where(used, (t - (ends - n_tiles)[seg]) * block_m, -1)
    return seg.to(torch.int32), row0.to(torch.int32)


def varlen_attention_triton(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, cu_seqlens: torch.Tensor,
                            k_cache: torch.Tensor | None, v_cache: torch.Tensor | None,
                            block_table: torch.Tensor | None, cache_lens: torch.Tensor | None,
                            block_sizes: torch.Tensor | None, mask: torch.Tensor | None,
                            mask_offsets: torch.Tensor | None, scale: float,
                            tiles: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The Triton launch of `varlen_attention` (arguments validated by it); `tiles`: a plan's
    (tile_seg, tile_row), else `query_tiles` makes them."""
    N, Hq, D = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    S = cu_seqlens.shape[0] - 1
    if N == 0:
        return out
    has_cache, has_new, has_mask = k_cache is not None, k is not None, mask is not None
    if q.stride(2) != 1:
        q = q.contiguous()
    if has_new and (k.stride(2) != 1 or v.stride(2) != 1):
        k, v = k.contiguous(), v.contiguous()
    H_kv = (k if has_new else k_cache).shape[1 if has_new else 2]
    operands = (q,) + ((k, v) if has_new else ()) + ((k_cache, v_cache) if has_cache else ())
    low_precision = low_precision_dot(varlen_attention_kernel, *operands)
    block_m, block_n, warps = varlen_attention_config(D, q.dtype, low_precision)
    tile_seg, tile_row = tiles if tiles is not None else query_tiles(cu_seqlens, N, block_m)
    # Absent operands: any tensor of the right kind (never read: the constexpr flags drop their loads).
    kn, vn = (k, v) if has_new else (q, q)
    kc, vc = (k_cache, v_cache) if has_cache else (q[None], q[None])
    table = block_table if has_cache else cu_seqlens[None]
    lens = cache_lens if has_cache else cu_seqlens
    blocks = block_sizes if block_sizes is not None else torch.zeros(S, dtype=torch.int32, device=q.device)
    bits = mask.view(torch.uint8) if has_mask else tile_row.view(torch.uint8)
    offsets = mask_offsets if has_mask else cu_seqlens
    varlen_attention_kernel[(tile_seg.shape[0], Hq)](
        q, kn, vn, kc, vc, table, cu_seqlens, lens, blocks, bits, offsets, tile_seg, tile_row, out,
        q.stride(0), q.stride(1), kn.stride(0), kn.stride(1), vn.stride(0), vn.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
        table.stride(0), out.stride(0), out.stride(1),
        D, kc.shape[1], scale,
        GROUP=Hq // H_kv, HAS_CACHE=has_cache, HAS_NEW=has_new, HAS_MASK=has_mask, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_D=max(16, next_power_of_2(D)), LOW_PRECISION_DOT=low_precision, num_warps=warps,
        **({"maxnreg": MAX_REGISTERS} if low_precision else {}))
    return out


class PooledPlan(NamedTuple):
    """`varlen_attention_each`'s metadata of one layout, reusable by every layer of a forward."""
    layout: tuple                      # ((M_s, T_s), ...): each set's queries and keys
    plan: VarlenPlan
    block_table: torch.Tensor          # [S, max T_s] int32: set s's keys are pool rows first_s … first_s + T_s − 1
    mask: torch.Tensor | None          # pack_masks' layout
    mask_offsets: torch.Tensor | None


def varlen_attention_each(queries: Sequence[torch.Tensor], keys: Sequence[torch.Tensor],
                          values: Sequence[torch.Tensor], masks: Sequence[torch.Tensor | None] | None = None,
                          plan: PooledPlan | None = None, scale: float | None = None
                          ) -> tuple[list[torch.Tensor], PooledPlan]:
    """Several attentions in ONE `varlen_attention` call: set s's queries `[M_s, Hq, D]` attend its own keys and
    values `[T_s, H_kv, D]`, every key visible unless `masks[s]` (a bool `[M_s, T_s]`, or None) hides it. The keys
    are gathered into one pool `[ΣT, 1, H_kv, D]` read through a block table of one-slot pages (each set a
    cache-only segment), so each row's reduction order is its own whatever the other sets (batch invariance).
    `plan`: a previous call's, reused where the layout is the same (the layers of one forward: its masks are then
    the plan's). Returns each set's output `[M_s, Hq, D]` and the plan."""
    layout = tuple((q.shape[0], k.shape[0]) for q, k in zip(queries, keys))
    if plan is None or plan.layout != layout:
        device, lengths = queries[0].device, [T for _, T in layout]
        first = torch.tensor([0] + lengths[:-1]).cumsum(0)
        table = (first[:, None] + torch.arange(max(lengths))).to(torch.int32).to(device)
        masks = [None] * len(layout) if masks is None else list(masks)
        mask, offsets = pack_masks(masks, device) if any(m is not None for m in masks) else (None, None)
        plan = PooledPlan(layout, varlen_plan([M for M, _ in layout], lengths, device=device), table, mask, offsets)
    out = varlen_attention(torch.cat(list(queries)), None, None, plan.plan, k_cache=torch.cat(list(keys))[:, None],
                           v_cache=torch.cat(list(values))[:, None], block_table=plan.block_table, mask=plan.mask,
                           mask_offsets=plan.mask_offsets, scale=scale)
    return list(out.split([M for M, _ in layout])), plan


__all__ = ["BIDIRECTIONAL", "CAUSAL", "PooledPlan", "VarlenPlan", "pack_masks", "query_tiles", "varlen_attention",
           "varlen_attention_config", "varlen_attention_each", "varlen_attention_torch", "varlen_attention_triton",
           "varlen_plan"]

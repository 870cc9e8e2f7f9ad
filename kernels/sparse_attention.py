"""Block-sparse bidirectional attention (a FlexAttention-style block mask), read in place.

Shapes and dtypes:

* `q` `[B, Hq, Lq, D]` fp32/fp16/bf16, last dim contiguous (other strides arbitrary). Output
  `[B, Hq, Lq, D]` in q's dtype, accumulated in float32.
* `k`, `v` `[B, H_kv, Lk, D]` (last dim contiguous), or, with `block_table` `[B, max_logical_blocks]`
  int32/int64, the paged layout `[num_pages, page_size, H_kv, D]` of `paged.py` with
  `page_size == kv_block_size`: logical block j of sequence b lives in page `block_table[b, j]`.
  GQA: query head h reads KV head h // (Hq // H_kv).
* Queries form blocks of `q_block_size` consecutive positions (n_q_blocks = ceil(Lq / q_block_size)),
  keys logical blocks of `kv_block_size` (block j: positions `[j·kv_block_size, (j+1)·kv_block_size)`);
  both sizes are any integer ≥ 1 (`kv_block_size=1`: token-level lists, e.g. retained positions).
* `kv_num_blocks` `[B, Hq, n_q_blocks]`, `kv_indices` `[B, Hq, n_q_blocks, max_blocks]`, int32/int64,
  any strides (stride 0: one list shared by several heads): query block i of (b, h) attends to the
  keys of blocks `kv_indices[b, h, i, :kv_num_blocks[b, h, i]]` (distinct, any order; entries past
  the count are junk and never read; counts are clamped to max_blocks and ids outside
  `[0, n_kv_blocks)` are ignored, so a bad list cannot read out of bounds).
* `kv_len` `[B]` int (optional): positions ≥ kv_len[b] are never attended (a partial last block).
  Default: Lk (contiguous), every position of the listed pages (paged).

A query attending to nothing outputs zeros (FlexAttention's convention), never NaN.

The kernel: one program per (query block, b·Hq + h, BLOCK_M rows of the block) loads its queries
once and walks its index list in tiles of ENTRIES list entries × BLOCK_W positions, reading K/V
rows in place from the block id (through the block table when paged) with an online softmax in
float32 (q·kᵀ and p·v as bf16 / fp16 MMAs when q, k and v share that dtype, accumulated in float32:
`paged.low_precision_dot`; float32 or mixed operands as float32 FMAs, ``input_precision="ieee"``, never
TF32: `paged._dot`); nothing is gathered. Index arithmetic is int64. Configurations are a plain function of
the shape (`block_sparse_config`), never autotuned.

`block_sparse_attention` is the dispatcher: Triton on CUDA (or with `REMASK_TRITON=1`), the torch
runtime of `sparse_attention_ref.py` otherwise.
"""
from __future__ import annotations

import torch

from .dispatch import HAS_TRITON, next_power_of_2, use_triton
from .paged import low_precision_dot
from .sparse_attention_ref import block_sparse_attention_torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)

if HAS_TRITON:
    import triton
    import triton.language as tl

    # The online-softmax update over a tile of keys is the paged-attention kernel's (one copy).
    from .paged import _attend_tile, _load_q, _mma_operand

    @triton.jit
    def block_sparse_attention_kernel(
        q_ptr, k_ptr, v_ptr, num_ptr, idx_ptr, bt_ptr, kv_len_ptr, o_ptr,
        stride_qb, stride_qh, stride_qm,
        stride_kb, stride_kh, stride_kblk, stride_kn,
        stride_vb, stride_vh, stride_vblk, stride_vn,
        stride_nb, stride_nh, stride_nq,
        stride_ib, stride_ih, stride_iq, stride_ie,
        stride_btb, stride_btn,
        stride_ob, stride_oh, stride_om,
        Hq, Lq, D, Q_BLOCK, KV_BLOCK, MAX_ENTRIES, N_KV_BLOCKS, KV_LIMIT, scale,
        GROUP: tl.constexpr, PAGED: tl.constexpr, HAS_KV_LEN: tl.constexpr,
        BLOCK_M: tl.constexpr, ENTRIES: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr,
        LOW_PRECISION_DOT: tl.constexpr,
    ):
        """Program (query block i, b·Hq + h, row chunk c).

        K/V addressing is shared by both layouts: a key at offset `w` of list entry `blk` lives at
        `b·stride_kb + kvh·stride_kh + base(blk)·stride_kblk + w·stride_kn`, where base(blk) is
        blk (contiguous: stride_kblk = kv_block_size·row stride) or `block_table[b, blk]` (PAGED:
        stride_kb = 0, stride_kblk = the page stride). KV_LIMIT caps the logical positions (Lk, or
        the table's capacity when paged); HAS_KV_LEN lowers it to kv_len[b].
        """
        qblk = tl.program_id(0).to(tl.int64)
        pid = tl.program_id(1)
        b = (pid // Hq).to(tl.int64)
        h = (pid % Hq).to(tl.int64)
        kvh = h // GROUP
        in_block = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        rows = qblk * Q_BLOCK + in_block.to(tl.int64)
        row_ok = (in_block < Q_BLOCK) & (rows < Lq)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        q, qk_scale = _load_q(q_ptr + b * stride_qb + h * stride_qh + rows[:, None] * stride_qm + d[None, :],
                              row_ok[:, None] & d_ok[None, :], scale, LOW_PRECISION_DOT)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

        limit = KV_LIMIT + b * 0   # an int64 scalar in both branches
        if HAS_KV_LEN:
            limit = tl.minimum(tl.load(kv_len_ptr + b).to(tl.int64), limit)
        count = tl.load(num_ptr + b * stride_nb + h * stride_nh + qblk * stride_nq).to(tl.int32)
        count = tl.minimum(count, MAX_ENTRIES)   # a count past the list's width must not read past it
        idx_base = idx_ptr + b * stride_ib + h * stride_ih + qblk * stride_iq
        k_base = k_ptr + b * stride_kb + kvh * stride_kh
        v_base = v_ptr + b * stride_vb + kvh * stride_vh

        # The tile, flattened: position t is entry t // BLOCK_W of the tile, offset t % BLOCK_W in
        # its block, so several small blocks (or single tokens) fill one matmul-sized tile.
        offs = tl.arange(0, ENTRIES * BLOCK_W)
        slot = offs // BLOCK_W
        offset = offs % BLOCK_W
        for e0 in range(0, count, ENTRIES):
            entry = e0 + slot
            listed = entry < count
            # Each id is loaded once per position of its block: cached, and cheaper than a reshape.
            blk = tl.load(idx_base + entry.to(tl.int64) * stride_ie, mask=listed, other=-1).to(tl.int64)
            listed = listed & (blk >= 0) & (blk < N_KV_BLOCKS)
            if PAGED:
                base = tl.load(bt_ptr + b * stride_btb + blk * stride_btn, mask=listed, other=0).to(tl.int64)
            else:
                base = blk
            # Blocks wider than BLOCK_W (kv_block_size > 64) take several passes.
            for w0 in range(0, KV_BLOCK, BLOCK_W):
                within = (w0 + offset).to(tl.int64)
                valid = listed & (within < KV_BLOCK) & (blk * KV_BLOCK + within < limit)
                row_off = base * stride_kblk + within * stride_kn
                tile = valid[:, None] & d_ok[None, :]
                k = _mma_operand(tl.load(k_base + row_off[:, None] + d[None, :], mask=tile, other=0.0),
                                 LOW_PRECISION_DOT)
                row_off = base * stride_vblk + within * stride_vn
                v = _mma_operand(tl.load(v_base + row_off[:, None] + d[None, :], mask=tile, other=0.0),
                                 LOW_PRECISION_DOT)
                m_i, l_i, acc = _attend_tile(q, k, v, valid, m_i, l_i, acc, qk_scale, LOW_PRECISION_DOT)

        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(o_ptr + b * stride_ob + h * stride_oh + rows[:, None] * stride_om + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def block_sparse_config(q_block_size: int, kv_block_size: int, D: int) -> dict[str, int]:
    """Tile sizes as a plain function of the shape.

    BLOCK_W ≥ kv_block_size (capped at 64: wider blocks are walked in passes) and ENTRIES list
    entries per tile, so a tile always holds 64 key positions whatever the block size (tl.dot
    wants ≥ 16, token-level lists would otherwise run one key per step, and a wider tile only
    adds register pressure). BLOCK_M covers the query block up to 64 rows; larger query blocks
    are split over the grid's third axis."""
    block_w = min(64, next_power_of_2(kv_block_size))
    return dict(BLOCK_M=min(64, max(16, next_power_of_2(q_block_size))), ENTRIES=max(1, 64 // block_w),
                BLOCK_W=block_w, BLOCK_D=max(16, next_power_of_2(D)))


def block_sparse_launch_options(cfg: dict[str, int], low_precision: bool = True) -> dict[str, int]:
    """`num_warps` / `num_stages` for a `block_sparse_config` (they change no result). A 64-row
    tile runs on 8 warps with a 2-stage pipeline: at 4 warps, or with the default 3 stages (the
    next 64-key K/V tiles prefetched into registers, one list entry per tile), it spills at D = 128
    (and at D = 64 on sm_80) — `python -m remask.kernels.aot`. Smaller tiles keep 4 warps, 3 stages.
    float32 operands (`low_precision` False: FMA dots over float32 operand tiles) take 8 warps and
    no prefetch (1 stage): at 4 warps a 32-row tile at D = 128 spilled over 1 KB per thread."""
    if not low_precision:
        return dict(num_warps=8, num_stages=1)
    if cfg["BLOCK_M"] >= 64:
        return dict(num_warps=8, num_stages=2)
    return dict(num_warps=4)


def block_sparse_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_num_blocks: torch.Tensor,
                                  kv_indices: torch.Tensor, *, q_block_size: int, kv_block_size: int,
                                  kv_len: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                                  scale: float | None = None) -> torch.Tensor:
    """The Triton launcher (arguments as validated by `block_sparse_attention`)."""
    B, Hq, Lq, D = q.shape
    paged = block_table is not None
    scale = D ** -0.5 if scale is None else float(scale)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    n_qb = kv_num_blocks.shape[2]
    if out.numel() == 0:
        return out
    if q.stride(3) != 1:
        q = q.contiguous()
    if paged:
        h_kv = k.shape[2]
        n_kv_blocks = block_table.shape[1]
        kv_limit = n_kv_blocks * kv_block_size
        # [page, offset, head, d]: no batch stride; the block stride is the page stride.
        k_strides = (0, k.stride(2), k.stride(0), k.stride(1))
        v_strides = (0, v.stride(2), v.stride(0), v.stride(1))
        bt, bt_strides = block_table, (block_table.stride(0), block_table.stride(1))
    else:
        if k.stride(3) != 1:
            k = k.contiguous()
        if v.stride(3) != 1:
            v = v.contiguous()
        h_kv = k.shape[1]
        kv_limit = k.shape[2]
        n_kv_blocks = -(-kv_limit // kv_block_size)
        k_strides = (k.stride(0), k.stride(1), kv_block_size * k.stride(2), k.stride(2))
        v_strides = (v.stride(0), v.stride(1), kv_block_size * v.stride(2), v.stride(2))
        bt, bt_strides = kv_num_blocks, (0, 0)   # an unused placeholder pointer
    # A query block longer than the whole query (one block over Lq) only needs Lq rows of tiles.
    rows_per_block = min(q_block_size, Lq)
    cfg = block_sparse_config(rows_per_block, kv_block_size, D)
    # Query blocks on the first axis: the only one with room for more than 65535 programs, and
    # token-level query blocks (q_block_size=1) can be that many.
    grid = (n_qb, B * Hq, triton.cdiv(rows_per_block, cfg["BLOCK_M"]))
    low_precision = low_precision_dot(block_sparse_attention_kernel, q, k, v)
    block_sparse_attention_kernel[grid](
        q, k, v, kv_num_blocks, kv_indices, bt, kv_num_blocks if kv_len is None else kv_len, out,
        q.stride(0), q.stride(1), q.stride(2),
        *k_strides, *v_strides,
        kv_num_blocks.stride(0), kv_num_blocks.stride(1), kv_num_blocks.stride(2),
        kv_indices.stride(0), kv_indices.stride(1), kv_indices.stride(2), kv_indices.stride(3),
        *bt_strides,
        out.stride(0), out.stride(1), out.stride(2),
        Hq, Lq, D, q_block_size, kv_block_size, kv_indices.shape[3], n_kv_blocks, kv_limit, scale,
        GROUP=Hq // h_kv, PAGED=paged, HAS_KV_LEN=kv_len is not None,
        LOW_PRECISION_DOT=low_precision, **block_sparse_launch_options(cfg, low_precision), **cfg)
    return out


def _check_index(name: str, t: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be an int32/int64 tensor, got "
                         f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
    if t.dim() != len(shape) or any(want is not None and got != want for got, want in zip(t.shape, shape)):
        want = ", ".join("*" if s is None else str(s) for s in shape)
        raise ValueError(f"{name} must have shape [{want}], got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {t.device}")


def _check_block_size(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int ≥ 1, got {value!r}")
    return value


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_num_blocks: torch.Tensor,
                           kv_indices: torch.Tensor, *, q_block_size: int, kv_block_size: int,
                           kv_len: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                           scale: float | None = None) -> torch.Tensor:
    """Attention of each query block over the key blocks its list names (see the module docstring
    for the shapes); `scale` defaults to 1/sqrt(D). Returns `[B, Hq, Lq, D]` in q's dtype."""
    q_block_size = _check_block_size("q_block_size", q_block_size)
    kv_block_size = _check_block_size("kv_block_size", kv_block_size)
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q must be a float32/float16/bfloat16 tensor [B, Hq, Lq, D], got "
                         f"{getattr(q, 'dtype', type(q).__name__)} {list(getattr(q, 'shape', []))}")
    B, Hq, Lq, D = q.shape
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} must be a float32/float16/bfloat16 tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    if k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"k and v must have the same 4-d shape, got {list(k.shape)} and {list(v.shape)}")
    if block_table is None:
        if k.shape[0] != B or k.shape[3] != D:
            raise ValueError(f"k and v must be [B={B}, H_kv, Lk, D={D}] (or pass block_table for the paged "
                             f"layout), got {list(k.shape)}")
        h_kv = k.shape[1]
    else:
        if k.shape[3] != D:
            raise ValueError(f"paged k and v must be [num_pages, page_size, H_kv, D={D}], got {list(k.shape)}")
        if k.shape[1] != kv_block_size:
            raise ValueError(f"paged k and v need page_size == kv_block_size, got page_size {k.shape[1]} and "
                             f"kv_block_size {kv_block_size}")
        if k.stride(3) != 1 or v.stride(3) != 1:
            raise ValueError("paged k and v must be contiguous in their last dim (D)")
        if k.shape[0] == 0:
            raise ValueError("paged k and v must hold at least one page")
        _check_index("block_table", block_table, (B, None), q.device)
        h_kv = k.shape[2]
    if h_kv == 0 or Hq % h_kv:
        raise ValueError(f"q heads (Hq={Hq}) must be a multiple of the K/V heads (H_kv={h_kv})")
    n_qb = -(-Lq // q_block_size)
    _check_index("kv_num_blocks", kv_num_blocks, (B, Hq, n_qb), q.device)
    _check_index("kv_indices", kv_indices, (B, Hq, n_qb, None), q.device)
    if kv_len is not None:
        _check_index("kv_len", kv_len, (B,), q.device)
    scale = D ** -0.5 if scale is None else float(scale)
    run = block_sparse_attention_triton if use_triton(q) else block_sparse_attention_torch
    return run(q, k, v, kv_num_blocks, kv_indices, q_block_size=q_block_size, kv_block_size=kv_block_size,
               kv_len=kv_len, block_table=block_table, scale=scale)

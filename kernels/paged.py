"""Paged KV cache kernels: store (scatter rows into pages), gather (pages → contiguous) and
paged attention (a block of queries over a sequence's pages plus its fresh K/V, no gather).

Layout (flash-attn / vLLM), per layer: `k_cache`, `v_cache` `[num_pages, page_size, H_kv, D]`
(any float dtype; last two dims contiguous); `block_table` `[B, max_pages]` int32/int64 page ids;
`seq_lens` `[B]` valid positions per sequence; a slot is `page * page_size + offset`.
Index arithmetic is int64 throughout (a large cache overflows int32 offsets). Attention's dots take
bf16 / fp16 operands to the tensor cores as they are and float32 ones as float32 (``input_precision=
"ieee"``, not `tl.dot`'s TF32 default): `_dot`, `low_precision_dot`.

Dispatchers pick Triton on CUDA (or with `REMASK_TRITON=1` under the interpreter) and the torch
references of `paged_ref.py` elsewhere.
"""
from __future__ import annotations

import torch

from .dispatch import HAS_TRITON, next_power_of_2, use_triton
from .paged_ref import check_block_size, paged_attention_torch, paged_gather_torch, paged_store_torch

if HAS_TRITON:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    @triton.jit
    def paged_store_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
                           stride_kn, stride_kh, stride_vn, stride_vh,
                           stride_kcp, stride_kcs, stride_kch, stride_vcp, stride_vcs, stride_vch,
                           H, D, PAGE_SIZE, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        raw = tl.load(slot_ptr + n).to(tl.int64)
        slot = tl.maximum(raw, 0)
        page = slot // PAGE_SIZE
        offset = slot % PAGE_SIZE
        h = tl.arange(0, BLOCK_H)[:, None].to(tl.int64)
        d = tl.arange(0, BLOCK_D)[None, :]
        # −1 skips: the row's mask is all false (a broadcast of the scalar test).
        m = (h < H) & (d < D) & ((h * 0 + raw) >= 0)
        k = tl.load(k_ptr + n * stride_kn + h * stride_kh + d, mask=m, other=0.0)
        v = tl.load(v_ptr + n * stride_vn + h * stride_vh + d, mask=m, other=0.0)
        tl.store(kc_ptr + page * stride_kcp + offset * stride_kcs + h * stride_kch + d,
                 k.to(kc_ptr.dtype.element_ty), mask=m)
        tl.store(vc_ptr + page * stride_vcp + offset * stride_vcs + h * stride_vch + d,
                 v.to(vc_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def paged_gather_kernel(c_ptr, bt_ptr, len_ptr, o_ptr, stride_cp, stride_cs, stride_btb, stride_ob, stride_ot,
                            max_len, HD, PAGE_SIZE, BLOCK_T: tl.constexpr, BLOCK_HD: tl.constexpr):
        # Program (b, BLOCK_T positions, BLOCK_HD columns of the H_kv·D row): the row is tiled over
        # the grid's third axis, so a wide row (32 heads × 128) never sits in one program's registers.
        b = tl.program_id(0).to(tl.int64)
        t = (tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        e = tl.program_id(2) * BLOCK_HD + tl.arange(0, BLOCK_HD)
        seq_len = tl.load(len_ptr + b).to(tl.int64)
        in_seq = t < seq_len
        page = tl.load(bt_ptr + b * stride_btb + t // PAGE_SIZE, mask=in_seq, other=0).to(tl.int64)
        src = c_ptr + page[:, None] * stride_cp + (t % PAGE_SIZE)[:, None] * stride_cs + e[None, :]
        vals = tl.load(src, mask=in_seq[:, None] & (e[None, :] < HD), other=0.0)
        tl.store(o_ptr + b * stride_ob + t[:, None] * stride_ot + e[None, :], vals,
                 mask=(t[:, None] < max_len) & (e[None, :] < HD))

    @triton.jit
    def _mma_operand(x, LOW_PRECISION_DOT: tl.constexpr):
        # A loaded tile as a tl.dot operand: kept in its (fp16/bf16) dtype for a 16-bit MMA, else
        # upcast to float32 (the launcher's `low_precision_dot` picks).
        if not LOW_PRECISION_DOT:
            x = x.to(tl.float32)
        return x

    @triton.jit
    def _dot(a, b, LOW_PRECISION_DOT: tl.constexpr):
        # a·b accumulated in float32. 16-bit operands go to the tensor cores as they are; float32
        # ones are multiplied as float32 (``input_precision="ieee"``: FMAs), since a compiled
        # `tl.dot` on float32 operands defaults to TF32 (10-bit mantissas: scores off by ~1e-3 on
        # an H200 against the float32 reference). The interpreter computes float32 either way.
        if LOW_PRECISION_DOT:
            c = tl.dot(a, b, out_dtype=tl.float32)
        else:
            c = tl.dot(a, b, input_precision="ieee", out_dtype=tl.float32)
        return c

    @triton.jit
    def _load_q(ptr, mask, scale, LOW_PRECISION_DOT: tl.constexpr):
        # The query tile and the factor the scores still need: float32 queries are pre-scaled (the
        # scores need none); 16-bit ones stay unrounded operands and the scores are scaled in float32.
        q = tl.load(ptr, mask=mask, other=0.0)
        if LOW_PRECISION_DOT:
            qk_scale = scale
        else:
            q = q.to(tl.float32) * scale
            qk_scale = 1.0
        return q, qk_scale

    @triton.jit
    def _load_rows(ptr, base, idx, stride_row, d, mask, LOW_PRECISION_DOT: tl.constexpr):
        # A [BLOCK_N, BLOCK_D] tile of one KV head: rows `idx` from `base`, as an MMA operand.
        return _mma_operand(tl.load(ptr + base + idx[:, None].to(tl.int64) * stride_row + d[None, :], mask=mask,
                                    other=0.0), LOW_PRECISION_DOT)

    @triton.jit
    def _attend_tile(q, k, v, valid, m_i, l_i, acc, qk_scale, LOW_PRECISION_DOT: tl.constexpr):
        # One online-softmax update with a [BLOCK_N] tile of keys (invalid ones masked out). The
        # dots accumulate in float32 whatever the operands' dtype (`_dot`); p is cast to v's for
        # p·v, and the softmax statistics stay float32.
        s = _dot(q, tl.trans(k), LOW_PRECISION_DOT) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, LOW_PRECISION_DOT)
        return m_new, l_i, acc

    @triton.jit
    def _attend_tile_masked(q, k, v, visible, m_i, l_i, acc, qk_scale, LOW_PRECISION_DOT: tl.constexpr):
        # `_attend_tile` under a [BLOCK_M, BLOCK_N] mask (block-causal diagonal tiles).
        s = _dot(q, tl.trans(k), LOW_PRECISION_DOT) * qk_scale
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, LOW_PRECISION_DOT)
        return m_new, l_i, acc

    @triton.jit
    def paged_attention_kernel(q_ptr, kc_ptr, vc_ptr, bt_ptr, len_ptr, kn_ptr, vn_ptr, o_ptr,
                               stride_qb, stride_qm, stride_qh,
                               stride_kcp, stride_kcs, stride_kch, stride_vcp, stride_vcs, stride_vch,
                               stride_btb,
                               stride_knb, stride_knn, stride_knh, stride_vnb, stride_vnn, stride_vnh,
                               stride_ob, stride_om, stride_oh,
                               M, N_NEW, Hq, D, PAGE_SIZE, DIFF_BLOCK, scale,
                               GROUP: tl.constexpr, HAS_NEW: tl.constexpr, BLOCK_CAUSAL: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                               LOW_PRECISION_DOT: tl.constexpr):
        pid = tl.program_id(0)
        b = (pid // Hq).to(tl.int64)
        h = (pid % Hq).to(tl.int64)
        kvh = h // GROUP
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        q, qk_scale = _load_q(q_ptr + b * stride_qb + rows[:, None].to(tl.int64) * stride_qm + h * stride_qh
                              + d[None, :], (rows[:, None] < M) & d_ok[None, :], scale, LOW_PRECISION_DOT)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        seq_len = tl.load(len_ptr + b).to(tl.int64)
        cols = tl.arange(0, BLOCK_N)
        n_pages = (seq_len + PAGE_SIZE - 1) // PAGE_SIZE
        for p in range(0, n_pages):
            page = tl.load(bt_ptr + b * stride_btb + p).to(tl.int64)
            valid = (cols < PAGE_SIZE) & (p * PAGE_SIZE + cols < seq_len)
            tile = valid[:, None] & d_ok[None, :]
            k = _load_rows(kc_ptr, page * stride_kcp + kvh * stride_kch, cols, stride_kcs, d, tile,
                           LOW_PRECISION_DOT)
            v = _load_rows(vc_ptr, page * stride_vcp + kvh * stride_vch, cols, stride_vcs, d, tile,
                           LOW_PRECISION_DOT)
            m_i, l_i, acc = _attend_tile(q, k, v, valid, m_i, l_i, acc, qk_scale, LOW_PRECISION_DOT)
        if BLOCK_CAUSAL:
            # Fresh key j / query i sit at seq_len + j / seq_len + i (M == N_NEW); i sees j when
            # (seq_len + j) // DIFF_BLOCK <= (seq_len + i) // DIFF_BLOCK. Keys below `n_all` are
            # visible to every row of this tile (no mask), keys from `n_end` on to none (skipped).
            row0 = (tl.program_id(1) * BLOCK_M).to(tl.int64)
            row_last = tl.minimum(row0 + BLOCK_M, M) - 1
            n_all = tl.minimum(((seq_len + row0) // DIFF_BLOCK + 1) * DIFF_BLOCK - seq_len, N_NEW)
            n_end = tl.minimum(((seq_len + row_last) // DIFF_BLOCK + 1) * DIFF_BLOCK - seq_len, N_NEW)
            n_full = (n_all // BLOCK_N) * BLOCK_N
            for n0 in range(0, n_full, BLOCK_N):
                n = n0 + cols
                valid = n < N_NEW
                tile = valid[:, None] & d_ok[None, :]
                k = _load_rows(kn_ptr, b * stride_knb + kvh * stride_knh, n, stride_knn, d, tile,
                               LOW_PRECISION_DOT)
                v = _load_rows(vn_ptr, b * stride_vnb + kvh * stride_vnh, n, stride_vnn, d, tile,
                               LOW_PRECISION_DOT)
                m_i, l_i, acc = _attend_tile(q, k, v, valid, m_i, l_i, acc, qk_scale, LOW_PRECISION_DOT)
            q_block = (seq_len + rows.to(tl.int64)) // DIFF_BLOCK
            for n0 in range(n_full, n_end, BLOCK_N):
                n = n0 + cols
                valid = n < n_end
                tile = valid[:, None] & d_ok[None, :]
                k = _load_rows(kn_ptr, b * stride_knb + kvh * stride_knh, n, stride_knn, d, tile,
                               LOW_PRECISION_DOT)
                v = _load_rows(vn_ptr, b * stride_vnb + kvh * stride_vnh, n, stride_vnn, d, tile,
                               LOW_PRECISION_DOT)
                k_block = (seq_len + n.to(tl.int64)) // DIFF_BLOCK
                visible = valid[None, :] & (k_block[None, :] <= q_block[:, None])
                m_i, l_i, acc = _attend_tile_masked(q, k, v, visible, m_i, l_i, acc, qk_scale, LOW_PRECISION_DOT)
        elif HAS_NEW:
            for n0 in range(0, N_NEW, BLOCK_N):
                n = n0 + cols
                valid = n < N_NEW
                tile = valid[:, None] & d_ok[None, :]
                k = _load_rows(kn_ptr, b * stride_knb + kvh * stride_knh, n, stride_knn, d, tile,
                               LOW_PRECISION_DOT)
                v = _load_rows(vn_ptr, b * stride_vnb + kvh * stride_vnh, n, stride_vnn, d, tile,
                               LOW_PRECISION_DOT)
                m_i, l_i, acc = _attend_tile(q, k, v, valid, m_i, l_i, acc, qk_scale, LOW_PRECISION_DOT)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(o_ptr + b * stride_ob + rows[:, None].to(tl.int64) * stride_om + h * stride_oh + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=(rows[:, None] < M) & d_ok[None, :])


GATHER_MAX_COLUMNS = 1024
LOW_PRECISION_DTYPES = (torch.float16, torch.bfloat16)


def interpreted(kernel) -> bool:
    """True when `kernel` runs under Triton's interpreter (TRITON_INTERPRET=1), whose tl.dot is
    wrong on bfloat16 operands; a compiled kernel (or the compiled-code gate's recorder) is not."""
    return HAS_TRITON and isinstance(kernel, InterpretedFunction)


def low_precision_dot(kernel, *tensors: torch.Tensor) -> bool:
    """The attention kernels' `LOW_PRECISION_DOT`: True when every operand is float16, or every one
    bfloat16, so q·kᵀ and p·v run as 16-bit MMAs (HMMA/HGMMA/tcgen05 kind::f16, accumulated in
    float32). Mixed or float32 operands get float32 dots (``input_precision="ieee"``: float32 FMAs,
    never TF32, as the float32 torch reference); so do bfloat16 ones under the interpreter
    (`interpreted`: its bf16 tl.dot is wrong; its fp16 one is right, so fp16 runs the 16-bit path
    there too)."""
    dtype = tensors[0].dtype
    if dtype not in LOW_PRECISION_DTYPES or any(t.dtype != dtype for t in tensors):
        return False
    return not (dtype == torch.bfloat16 and interpreted(kernel))


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_pages, page_size, H_kv, D], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.stride(3) != 1 or c.stride(2) != c.shape[3]:
            raise ValueError(f"{name} must be contiguous in its last two dims (H_kv, D)")
        if not c.is_floating_point():
            raise ValueError(f"{name} must be a float tensor, got {c.dtype}")


def _check_table(block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int, batch: int) -> None:
    if block_table.dtype not in (torch.int32, torch.int64) or block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(f"block_table must be int32/int64 [B={batch}, max_pages], got {block_table.dtype} "
                         f"{tuple(block_table.shape)}")
    if seq_lens.dim() != 1 or seq_lens.shape[0] != batch or seq_lens.is_floating_point():
        raise ValueError(f"seq_lens must be an int tensor [B={batch}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    if seq_lens.numel() and int(seq_lens.max()) > block_table.shape[1] * page_size:
        raise ValueError(f"seq_lens up to {int(seq_lens.max())} exceed block_table capacity "
                         f"{block_table.shape[1]} pages × page_size {page_size}")


def paged_store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slot_mapping: torch.Tensor) -> None:
    """Scatter `k`, `v` `[N, H_kv, D]` into the caches at `slot_mapping` `[N]` (−1 skips), in place."""
    _check_cache(k_cache, v_cache)
    if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"k and v must be [N, H_kv={k_cache.shape[2]}, D={k_cache.shape[3]}], got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.is_floating_point():
        raise ValueError(f"slot_mapping must be an int tensor [N={k.shape[0]}], got {tuple(slot_mapping.shape)}")
    if not use_triton(k):
        return paged_store_torch(k, v, k_cache, v_cache, slot_mapping)
    if k.shape[0] == 0:
        return None
    k, v = k.contiguous() if k.stride(2) != 1 else k, v.contiguous() if v.stride(2) != 1 else v
    H, D = k.shape[1:]
    paged_store_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), H, D, k_cache.shape[1], BLOCK_H=next_power_of_2(H), BLOCK_D=next_power_of_2(D))
    return None


def paged_gather(cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                 max_len: int | None = None) -> torch.Tensor:
    """Pages → contiguous `[B, max_len, H_kv, D]`, zeros past each sequence's length (for
    interoperability; attention reads the pages directly)."""
    _check_cache(cache, cache)
    _check_table(block_table, seq_lens, cache.shape[1], block_table.shape[0])
    max_len = (int(seq_lens.max()) if seq_lens.numel() else 0) if max_len is None else max_len
    if not use_triton(cache):
        return paged_gather_torch(cache, block_table, seq_lens, max_len)
    B = block_table.shape[0]
    H, D = cache.shape[2:]
    out = torch.empty((B, max_len, H, D), dtype=cache.dtype, device=cache.device)
    if B == 0 or max_len == 0:
        return out
    BLOCK_T = 16
    # ≤ 16 × 1024 elements per program (≤ 64 registers of bf16 per thread at 4 warps).
    block_hd = min(GATHER_MAX_COLUMNS, next_power_of_2(H * D))
    paged_gather_kernel[(B, triton.cdiv(max_len, BLOCK_T), triton.cdiv(H * D, block_hd))](
        cache, block_table, seq_lens, out, cache.stride(0), cache.stride(1), block_table.stride(0),
        out.stride(0), out.stride(1), max_len, H * D, cache.shape[1], BLOCK_T=BLOCK_T, BLOCK_HD=block_hd)
    return out


def paged_attention_warps(block_n: int, block_d: int, low_precision: bool = True) -> int:
    """`num_warps` of the attention kernel (no result depends on it): 8 once a key tile holds 64 × 128
    values (page 64 at D = 128), where 4 warps need 251 of the 255 registers on sm_100 (block-causal),
    and for float32 operands (`low_precision` False), whose FMA dots hold float32 operand tiles (at 4
    warps page 32 at D = 128 took 255 registers and spilled 64 B on sm_80); else 4."""
    return 8 if block_n * block_d >= 64 * 128 or not low_precision else 4


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
                    scale: float | None = None, *, block_size: int | None = None) -> torch.Tensor:
    """Bidirectional attention of `q` `[B, M, Hq, D]` over each sequence's paged K/V (first
    `seq_lens[b]` positions) and the block's fresh `k_new`, `v_new` `[B, N, H_kv, D]`; GQA when
    Hq is a multiple of H_kv. Online softmax in float32 (q·kᵀ and p·v as bf16 / fp16 MMAs when q
    and every K/V share that dtype, accumulated in float32: `low_precision_dot`; otherwise in
    float32, IEEE, not TF32); returns `[B, M, Hq, D]` in q's dtype.

    `block_size` (block diffusion: SDAR, LLaDA2, Fast-dLLM v2): block-causal instead. The fresh
    tokens are consecutive positions right after the cached ones (query i and fresh key j at
    `seq_lens[b] + i` and `seq_lens[b] + j`; M == N, k_new required); query i sees every cached
    key and fresh key j when `(seq_lens[b] + j) // block_size <= (seq_lens[b] + i) // block_size`,
    so one call can prefill several blocks, or finish a partially filled first block. Fresh-key
    tiles entirely in a query tile's future are skipped."""
    _check_cache(k_cache, v_cache)
    if q.dim() != 4:
        raise ValueError(f"q must be [B, M, Hq, D], got {tuple(q.shape)}")
    B, M, Hq, D = q.shape
    H_kv = k_cache.shape[2]
    if k_cache.shape[3] != D or Hq % H_kv:
        raise ValueError(f"q heads ({Hq}) must be a multiple of the cache's H_kv ({H_kv}) and head dims must "
                         f"match (q {D}, cache {k_cache.shape[3]})")
    _check_table(block_table, seq_lens, k_cache.shape[1], B)
    if (k_new is None) != (v_new is None):
        raise ValueError("pass both k_new and v_new, or neither")
    if k_new is not None and (k_new.shape != v_new.shape or k_new.dim() != 4 or k_new.shape[0] != B
                              or k_new.shape[2:] != (H_kv, D)):
        raise ValueError(f"k_new and v_new must be [B={B}, N, H_kv={H_kv}, D={D}], got {tuple(k_new.shape)}")
    block_size = check_block_size(block_size, q, k_new)
    scale = D ** -0.5 if scale is None else float(scale)
    if not use_triton(q):
        return paged_attention_torch(q, k_cache, v_cache, block_table, seq_lens, k_new, v_new, scale,
                                     block_size=block_size)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if B == 0 or M == 0:
        return out
    page_size = k_cache.shape[1]
    block_m = min(64, max(16, next_power_of_2(M)))
    block_n = max(16, next_power_of_2(page_size))
    block_d = max(16, next_power_of_2(D))
    has_new = k_new is not None
    kn = k_new if has_new else q
    vn = v_new if has_new else q
    if has_new and (kn.stride(3) != 1 or vn.stride(3) != 1):
        kn, vn = kn.contiguous(), vn.contiguous()
    if q.stride(3) != 1:
        q = q.contiguous()
    low_precision = low_precision_dot(paged_attention_kernel, q, k_cache, v_cache, *((kn, vn) if has_new else ()))
    paged_attention_kernel[(B * Hq, triton.cdiv(M, block_m))](
        q, k_cache, v_cache, block_table, seq_lens, kn, vn, out,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0),
        kn.stride(0), kn.stride(1), kn.stride(2), vn.stride(0), vn.stride(1), vn.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        M, kn.shape[1] if has_new else 0, Hq, D, page_size, 1 if block_size is None else block_size, scale,
        GROUP=Hq // H_kv, HAS_NEW=has_new, BLOCK_CAUSAL=block_size is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=block_d, LOW_PRECISION_DOT=low_precision,
        num_warps=paged_attention_warps(block_n, block_d, low_precision))
    return out

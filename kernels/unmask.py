"""Select and commit in one launch: which masked positions a step unmasks, written into x.

One program per row holds the row (confidence, mask) and ranks its masked positions in the order
of a stable descending sort: by confidence, the lower index first among equals. `torch.topk` gives
the same order in practice on CPU and CUDA but does not promise it for equal values; with distinct
confidences the two always agree. Two paths, bit-identical (`sort_path` chooses; both apply the
rules through one `_select`):

* counting (rows shorter than `SORT_MIN_L`): rank(i) = the number of masked j with ``c_j > c_i``,
  or ``c_j == c_i`` and ``j < i`` — O(L²) comparisons, the row in registers and j in BLOCK_J-wide
  chunks, so that one step compares a BLOCK_L × BLOCK_J tile of at most `COUNT_TILE` lanes (a
  whole L × L comparison spilled from L = 64 on); float64 confidences are compared as monotone
  int64 keys with the index as the tie-break, fp16/bf16/fp32 (exactly float32) as the sort path's
  packed (float32 key, index complement) int64, one comparison.
* sort (L ≥ `SORT_MIN_L`): fp16/bf16/fp32 confidences are exactly float32, whose monotone int32
  key packs with the index's complement into one int64 (`reductions.pack_desc`); one descending
  `tl.sort` puts the candidates in rank order in slots 0 … n − 1 (everything else is packed below
  them), the rules run on the slots and the writes scatter back to the unpacked positions. A
  float64 key needs all 64 bits, so float64 rows (up to `SORT_MAX_L_F64`) sort twice, least
  significant word first (an LSD radix sort, exact): pass 1 sorts (the key's low word, the lower
  index first); pass 2 sorts (the high word, then the lower pass-1 slot first), packed as the
  high word, the slot's complement and the position (16 bits each), the high word re-read at the
  positions pass 1 gathered. Equal high words keep the pass-1 order, which is the low word's, then
  the index's: the full stable order of the float64 keys. Longer float64 rows count. (−0.0 is
  +0.0 in every key; NaN confidences are not ranked as `torch.topk` ranks them on either path.)

Rules (per row, n masked positions): a budget ``k`` → ranks < k; ``threshold`` τ → rank 0 plus
every rank with c ≥ τ (Fast-dLLM; combined with k: only ranks < k, Dream's
``confidence_threshold``); ``factor`` f → Fast-dLLM's factor rule (see `unmask_ref.unmask_torch`).
The kernel then writes x0 into x and clears the mask at the chosen positions and stores the
per-row count: no host synchronisation, no loop over rows on the host.

`unmask` is the dispatcher: Triton on CUDA (or with ``REMASK_TRITON=1``), `unmask_ref` otherwise.
"""
from __future__ import annotations

import torch

from .dispatch import HAS_TRITON, next_power_of_2, use_triton
from .unmask_ref import rule_thresholds, unmask_torch

CONF_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
RULE_NONE, RULE_THRESHOLD, RULE_FACTOR = 0, 1, 2
SORT_MIN_L = 512          # rows this long take the sort path
SORT_MAX_L_F64 = 32768    # float64's second sort packs slot and index into 16 bits each
COUNT_TILE = 2048         # the counting path's comparisons per step (BLOCK_L × BLOCK_J), to stay in registers

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .reductions import from_key32, order_key32, pack_desc, unpack_index

    @triton.jit
    def _order_key(c):
        """Monotone int64 image of float64 values (−0.0 mapped to +0.0 first)."""
        bits = (c + 0.0).to(tl.int64, bitcast=True)
        return bits ^ ((bits >> 63) & 0x7FFFFFFFFFFFFFFF)

    @triton.jit
    def _select(rank, cand, c, n, k_ptr, rule_ptr, b, HAS_K: tl.constexpr, RULE: tl.constexpr):
        """The rules on lanes that know their rank (0-based, among the n candidates `cand`) and
        confidence c (float64): True where the lane is committed. Shared by both paths."""
        limit = n
        if HAS_K:
            limit = tl.minimum(n, tl.maximum(tl.load(k_ptr + b), 0))
        selected = cand & (rank < limit)
        if RULE == 1:
            selected = selected & ((rank == 0) | (c >= tl.load(rule_ptr)))
        elif RULE == 2:
            thresholds = tl.load(rule_ptr + rank, mask=cand, other=float("-inf"))
            fails = cand & (rank >= 1) & (c < thresholds)
            first_fail = tl.min(tl.where(fails, rank, n), axis=0)
            count = tl.where(first_fail >= n - 1, n, first_fail)
            selected = selected & (rank < count)
        return selected

    @triton.jit
    def unmask_kernel(
        x_ptr, stride_x, mask_ptr, stride_mask, x0_ptr, stride_x0, conf_ptr, stride_conf,
        k_ptr, rule_ptr, count_ptr, L,
        BLOCK_L: tl.constexpr, BLOCK_J: tl.constexpr, HAS_K: tl.constexpr, RULE: tl.constexpr,
        KEY64: tl.constexpr,
    ):
        """The counting path. Program b: row b of x `[B, L]` int64, mask `[B, L]` uint8 (a view of
        the bool mask), x0 `[B, L]` int64, conf `[B, L]` (any float dtype; rows may be strided, L
        contiguous), k `[B]` int64 (HAS_K), rule_ptr float64 thresholds (τ, or 1 − f/(r + 2) per
        rank r). Writes x and mask in place and count `[B]` int64.

        The row stays in registers ([BLOCK_L] lanes); rank(i) is counted over BLOCK_J-wide chunks
        of j, so one step compares a BLOCK_L × BLOCK_J tile (the launcher keeps it at
        `COUNT_TILE` lanes at most, whatever L). KEY64 (float64 confidences): the int64 keys,
        ties broken by the index, a position off the mask (or past L) never ahead; otherwise the
        float32 key packed with the index's complement (`reductions.pack_desc`, what the sort path
        sorts), a position off the mask packed below every candidate: one int64 comparison."""
        b = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BLOCK_L)
        in_row = i < L
        row_mask = mask_ptr + b * stride_mask
        row_conf = conf_ptr + b * stride_conf
        cand = tl.load(row_mask + i, mask=in_row, other=0) != 0
        n = tl.sum(cand.to(tl.int64), axis=0)
        rank = tl.zeros([BLOCK_L], dtype=tl.int32)
        if KEY64:
            c_i = tl.load(row_conf + i, mask=in_row, other=0.0).to(tl.float64)
            key_i = _order_key(c_i)
            for j0 in range(0, L, BLOCK_J):
                j = j0 + tl.arange(0, BLOCK_J)
                in_j = j < L
                cand_j = tl.load(row_mask + j, mask=in_j, other=0) != 0
                key_j = _order_key(tl.load(row_conf + j, mask=in_j, other=0.0).to(tl.float64))
                key_j = tl.where(cand_j, key_j, -9223372036854775808)   # never strictly ahead
                tie_j = tl.where(cand_j, j, BLOCK_L)                      # never ahead on a tie
                ahead = (key_j[None, :] > key_i[:, None]) | (
                    (key_j[None, :] == key_i[:, None]) & (tie_j[None, :] < i[:, None]))
                rank += tl.sum(ahead.to(tl.int32), axis=1)
        else:
            c32 = tl.load(row_conf + i, mask=in_row, other=0.0).to(tl.float32)
            c_i = c32.to(tl.float64)
            packed_i = pack_desc(order_key32(c32), i, in_row)
            for j0 in range(0, L, BLOCK_J):
                j = j0 + tl.arange(0, BLOCK_J)
                in_j = j < L
                cand_j = tl.load(row_mask + j, mask=in_j, other=0) != 0
                key_j = order_key32(tl.load(row_conf + j, mask=in_j, other=0.0).to(tl.float32))
                packed_j = pack_desc(key_j, j, cand_j)
                rank += tl.sum((packed_j[None, :] > packed_i[:, None]).to(tl.int32), axis=1)
        selected = _select(rank, cand, c_i, n, k_ptr, rule_ptr, b, HAS_K, RULE)
        x0 = tl.load(x0_ptr + b * stride_x0 + i, mask=selected, other=0)
        tl.store(x_ptr + b * stride_x + i, x0, mask=selected)
        tl.store(row_mask + i, tl.zeros([BLOCK_L], dtype=tl.uint8), mask=selected)
        tl.store(count_ptr + b, tl.sum(selected.to(tl.int64), axis=0))

    @triton.jit
    def unmask_sort_kernel(
        x_ptr, stride_x, mask_ptr, stride_mask, x0_ptr, stride_x0, conf_ptr, stride_conf,
        k_ptr, rule_ptr, count_ptr, L,
        BLOCK_L: tl.constexpr, HAS_K: tl.constexpr, RULE: tl.constexpr, KEY64: tl.constexpr,
    ):
        """The sort path, arguments as `unmask_kernel`'s. Lane r of the sorted tensors is rank r:
        the rules run in sorted order and the writes scatter back to the gathered positions.
        KEY64 (float64 confidences, L ≤ `SORT_MAX_L_F64`): two sorts, least significant word first
        (module docstring); otherwise one sort of float32 keys packed with the index."""
        b = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, BLOCK_L)
        in_row = i < L
        row_conf = conf_ptr + b * stride_conf
        cand = tl.load(mask_ptr + b * stride_mask + i, mask=in_row, other=0) != 0
        n = tl.sum(cand.to(tl.int64), axis=0)
        live = i < n   # sorted slots holding a candidate; the padding sorts after them
        if KEY64:
            key = _order_key(tl.load(row_conf + i, mask=in_row, other=0.0).to(tl.float64))
            # pass 1: (low word, lower index first); the low word as unsigned → flip its top bit
            first = tl.sort(pack_desc(key.to(tl.int32) ^ -2147483648, i, cand), descending=True)
            idx_1 = tl.where(live, unpack_index(first), 0)
            # pass 2: (high word, pass-1 slot); the slot's complement and the index share the low word
            hi = _order_key(tl.load(row_conf + idx_1, mask=live, other=0.0).to(tl.float64)) >> 32
            packed = (hi << 32) | ((65535 - i.to(tl.int64)) << 16) | idx_1
            second = tl.sort(tl.where(live, packed, -9223372036854775808), descending=True)
            idx = tl.where(live, second & 65535, 0)
            c = tl.load(row_conf + idx, mask=live, other=0.0).to(tl.float64)
        else:
            key32 = order_key32(tl.load(row_conf + i, mask=in_row, other=0.0).to(tl.float32))
            ordered = tl.sort(pack_desc(key32, i, cand), descending=True)
            idx = tl.where(live, unpack_index(ordered), 0)
            c = tl.where(live, from_key32((ordered >> 32).to(tl.int32)), 0.0).to(tl.float64)
        selected = _select(i.to(tl.int64), live, c, n, k_ptr, rule_ptr, b, HAS_K, RULE)
        x0 = tl.load(x0_ptr + b * stride_x0 + idx, mask=selected, other=0)
        tl.store(x_ptr + b * stride_x + idx, x0, mask=selected)
        tl.store(mask_ptr + b * stride_mask + idx, tl.zeros([BLOCK_L], dtype=tl.uint8), mask=selected)
        tl.store(count_ptr + b, tl.sum(selected.to(tl.int64), axis=0))


def sort_path(dtype: torch.dtype, length: int) -> bool:
    """Whether `unmask_triton` ranks rows of `length` confidences of `dtype` by sorting."""
    return length >= SORT_MIN_L and (dtype != torch.float64 or length <= SORT_MAX_L_F64)


def unmask_triton(x, mask, x0, conf, *, k=None, threshold=None, factor=None, path: str | None = None) -> torch.Tensor:
    """Launch the kernel (arguments as `unmask_torch`; checked by `unmask`). `path` ``"count"`` or
    ``"sort"`` forces a path (tests, benchmarks); None lets `sort_path` choose."""
    B, L = conf.shape
    counts = torch.empty(B, dtype=torch.long, device=conf.device)
    if B == 0 or L == 0:
        return counts.zero_()
    if path not in (None, "count", "sort"):
        raise ValueError(f"path must be 'count', 'sort' or None, got {path!r}")
    if path == "sort" and conf.dtype == torch.float64 and L > SORT_MAX_L_F64:
        raise ValueError(f"the sort path takes float64 rows of at most {SORT_MAX_L_F64}, got {L}")
    sort = sort_path(conf.dtype, L) if path is None else path == "sort"
    block_l = next_power_of_2(L)
    rule = rule_thresholds(conf.dtype, L, conf.device, threshold=threshold, factor=factor)
    mask_u8 = mask.view(torch.uint8)
    args = (x, x.stride(0), mask_u8, mask_u8.stride(0), x0, x0.stride(0), conf, conf.stride(0),
            k if k is not None else counts, rule if rule is not None else conf, counts, L)
    meta = dict(BLOCK_L=block_l, HAS_K=k is not None,
                RULE=RULE_THRESHOLD if threshold is not None else RULE_FACTOR if factor is not None else RULE_NONE,
                num_warps=4 if block_l <= 1024 else 8)
    if sort:
        unmask_sort_kernel[(B,)](*args, KEY64=conf.dtype == torch.float64, **meta)
    else:
        block_j = max(1, min(block_l, COUNT_TILE // block_l))  # a BLOCK_L × BLOCK_J tile per step
        unmask_kernel[(B,)](*args, BLOCK_J=block_j, KEY64=conf.dtype == torch.float64, **meta)
    return counts


def _check(x, mask, x0, conf, k, threshold, factor):
    for name, t in (("x", x), ("mask", mask), ("x0", x0), ("conf", conf)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D tensor [B, L], got shape {getattr(t, 'shape', None)}")
        if t.shape != conf.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected conf's {tuple(conf.shape)}")
        if t.device != conf.device:
            raise ValueError(f"{name} is on {t.device}, conf on {conf.device}")
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name} must be contiguous along L (stride(1) == 1); rows may be strided")
    if x.dtype != torch.long or x0.dtype != torch.long:
        raise TypeError(f"x and x0 must be int64 token ids, got {x.dtype} and {x0.dtype}")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor, got {mask.dtype}")
    if conf.dtype not in CONF_DTYPES:
        raise TypeError(f"conf dtype must be one of {[str(d) for d in CONF_DTYPES]}, got {conf.dtype}")
    if threshold is not None and factor is not None:
        raise ValueError("pass either threshold or factor, not both")
    if factor is not None and k is not None:
        raise ValueError("factor fixes the count itself; do not pass k with factor")
    if k is None and threshold is None and factor is None:
        raise ValueError("pass one of k (per-row budget), threshold or factor")
    if threshold is not None and not 0 <= threshold <= 1:
        raise ValueError(f"threshold must be in [0, 1], got {threshold}")
    if factor is not None and not factor > 0:
        raise ValueError(f"factor must be > 0, got {factor}")


def unmask(x: torch.Tensor, mask: torch.Tensor, x0: torch.Tensor, conf: torch.Tensor, *,
           k: torch.Tensor | int | None = None, threshold: float | None = None,
           factor: float | None = None) -> torch.Tensor:
    """Commit the chosen masked positions of each row: ``x[b, i] = x0[b, i]``, ``mask[b, i] = False``.

    Args:
        x: `[B, L]` int64 tokens, updated in place (a strided view into a longer sequence is fine).
        mask: `[B, L]` bool, True where a position may be committed; cleared in place.
        x0: `[B, L]` int64 proposals. conf: `[B, L]` confidences (float64/32/16 or bfloat16).
        k: per-row budget `[B]` (or an int for every row); more than the masked count commits all.
        threshold: Fast-dLLM's rule — the most confident masked position plus every masked position
            with confidence ≥ threshold (with `k`: only among the k most confident).
        factor: Fast-dLLM's factor rule (first rank r ≥ 1 with c < 1 − factor/(r + 2) stops it).

    Returns:
        int64 `[B]`: how many positions each row committed.
    """
    if isinstance(k, int) and not isinstance(k, bool):
        k = torch.full((conf.shape[0],), k, dtype=torch.long, device=conf.device)
    _check(x, mask, x0, conf, k, threshold, factor)
    if k is not None:
        if k.shape != (conf.shape[0],) or k.dtype not in (torch.int32, torch.int64) or k.device != conf.device:
            raise ValueError(f"k must be an int or an int tensor of shape [{conf.shape[0]}] on {conf.device}")
        k = k.to(torch.long)
    if use_triton(conf):
        return unmask_triton(x, mask, x0, conf, k=k, threshold=threshold, factor=factor)
    return unmask_torch(x, mask, x0, conf, k=k, threshold=threshold, factor=factor)

"""`@triton.jit` reductions shared by the kernels, written once because exactness rests on them.

* `argmax_lowest(values, index, valid)`: the maximum of `values` over the `valid` lanes and the
  lowest `index` attaining it — `torch.argmax`'s tie rule (the first maximal element). Invalid
  lanes never win; with no valid lane the index is `NO_INDEX` (2³¹ − 1).
* `running_argmax(best, best_index, chunk_best, chunk_index)`: folds a chunk's argmax into the
  running one when chunks come in ascending index order: a later chunk wins only when strictly
  greater, so the lower index keeps a tie. A running index below 0 means "nothing yet".
* `online_softmax(m, s, t, x, chunk_max, WITH_T)`: folds a chunk `x` (−inf where absent) into the
  running softmax statistics m (max), s = Σ e^(x−m) and, with WITH_T, t = Σ e^(x−m)(x − m) (the
  entropy's term), rescaling by e^(m_old − m_new) when the max moves; while nothing finite has been
  seen (s = 0) the old max is −inf and the rescale is 1.
* `order_key32(c)`: the monotone int32 image of float32 `c` (−0.0 first mapped to +0.0), so
  ``a > b`` ⇔ ``key(a) > key(b)`` (and equality) for every non-NaN pair; `from_key32` inverts it.
* `pack_desc(key32, index, valid)` / `unpack_index(packed)`: one int64 per lane, ``key32 << 32 |
  (2³² − 1 − index)``, so a descending `tl.sort` orders by key, the lower index first among equal
  keys (a stable descending sort); invalid lanes become `PAD_KEY` (−2⁶³), below every valid lane
  (whose low word is ≥ 1 for index < 2³² − 1), so the valid lanes fill slots 0 … count − 1.

Used by `confidence.py` (selection, runner-up, split combine, statistics), `accept.py` (APD's
mixture argmax and its combine) and `canvas.py` (Gumbel-max sample, argmax, statistics).
"""
from __future__ import annotations

from .dispatch import HAS_TRITON

NO_INDEX = 2147483647
PAD_KEY = -9223372036854775808

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def argmax_lowest(values, index, valid):
        best = tl.max(tl.where(valid, values, float("-inf")), axis=0)
        lowest = tl.min(tl.where((values == best) & valid, index, 2147483647), axis=0)
        return best, lowest

    @triton.jit
    def running_argmax(best, best_index, chunk_best, chunk_index):
        take = (chunk_best > best) | (best_index < 0)
        return tl.where(take, chunk_best, best), tl.where(take, chunk_index, best_index)

    @triton.jit
    def online_softmax(m, s, t, x, chunk_max, WITH_T: tl.constexpr):
        m_new = tl.maximum(m, chunk_max)
        dm = tl.where(s > 0, m - m_new, 0.0)
        alpha = tl.exp(dm)
        finite = x > float("-inf")
        shifted = tl.where(finite, x - tl.where(finite, m_new, 0.0), 0.0)
        e = tl.where(finite, tl.exp(shifted), 0.0)
        if WITH_T:   # Σ e'(x − m') = α(Σ e(x − m) + (m − m')Σ e) for the new max m'
            t = alpha * (t + dm * s) + tl.sum(e * shifted, axis=0)
        return m_new, alpha * s + tl.sum(e, axis=0), t

    @triton.jit
    def order_key32(c):
        bits = (c + 0.0).to(tl.int32, bitcast=True)
        return bits ^ ((bits >> 31) & 0x7FFFFFFF)

    @triton.jit
    def from_key32(key):
        return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)

    @triton.jit
    def pack_desc(key32, index, valid):
        packed = (key32.to(tl.int64) << 32) | (4294967295 - index.to(tl.int64))
        return tl.where(valid, packed, -9223372036854775808)

    @triton.jit
    def unpack_index(packed):
        return 4294967295 - (packed & 4294967295)

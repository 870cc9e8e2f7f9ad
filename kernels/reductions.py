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

Used by `confidence.py` (selection, runner-up, split combine, statistics), `accept.py` (APD's
mixture argmax and its combine) and `canvas.py` (Gumbel-max sample, argmax, statistics).
"""
from __future__ import annotations

from .dispatch import HAS_TRITON

NO_INDEX = 2147483647

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

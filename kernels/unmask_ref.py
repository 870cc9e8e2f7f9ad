"""Torch reference for the unmask kernel: the CPU runtime and the oracle of tests and benchmarks.

Also the reference *formulation* (`unmask_reference_loop`): LLaDA / Fast-dLLM's per-row Python
loop over `torch.topk`, the baseline of the benchmarks.
"""
from __future__ import annotations

import functools

import torch


def rule_thresholds(conf_dtype: torch.dtype, length: int, device, *, threshold: float | None = None,
                    factor: float | None = None) -> torch.Tensor | None:
    """The thresholds a rule compares confidences with, float64 values rounded to the confidences'
    dtype (as torch does when a Python float meets a tensor): threshold → `[1]` (τ); factor →
    `[length]`, entry r = 1 − f/(r + 2) for the candidate of rank r (0-based)."""
    if threshold is not None:
        values = torch.tensor([threshold], dtype=torch.float64, device=device)
    elif factor is not None:
        values = 1 - factor / torch.arange(2, length + 2, dtype=torch.float64, device=device)
    else:
        return None
    return values.to(conf_dtype).to(torch.float64)


def _first_true(flags: torch.Tensor) -> torch.Tensor:
    return flags & (torch.cumsum(flags, dim=1) == 1)


def select_top(scores: torch.Tensor, mask: torch.Tensor, limit: torch.Tensor,
               ordered: torch.Tensor | None = None) -> torch.Tensor:
    """The `limit[b]` (≤ masked count) highest-scoring masked positions of each row, the lower
    index first among equal scores; `scores` is −inf off the mask. The value of the last one taken
    comes from the row sorted in descending order (`ordered`, as `torch.topk` ranks: NaN first),
    then the positions tied with it are filled in index order. No host read: the sort is over the
    whole row rather than a `topk` of the largest budget."""
    if ordered is None:
        ordered = torch.sort(scores, dim=1, descending=True).values
    if scores.shape[1] == 0:
        return torch.zeros_like(mask)
    last = ordered.gather(1, (limit - 1).clamp_min(0))
    above = mask & (scores > last)
    tied = mask & (scores == last)
    quota = limit - above.sum(dim=1, keepdim=True)
    return (above | (tied & (torch.cumsum(tied, dim=1) <= quota))) & (limit > 0)


def unmask_torch(x: torch.Tensor, mask: torch.Tensor, x0: torch.Tensor, conf: torch.Tensor, *,
                 k: torch.Tensor | None = None, threshold: float | None = None,
                 factor: float | None = None) -> torch.Tensor:
    """Select and commit, in place (x ← x0 at the chosen positions, mask cleared there).

    Per row, the masked positions ordered by confidence (descending, the lower index first among
    equals; −0.0 equals +0.0) and n of them: budget `k` → the first k; `threshold` τ → the first,
    and every one with confidence ≥ τ (with `k` as well: only among the first k, Dream's
    ``confidence_threshold``); `factor` f → Fast-dLLM's rule: the first c, where c is the first
    rank r ≥ 1 whose confidence is below 1 − f/(r + 2), and all n when there is none or it is the
    last one (the reference's quirk).

    No host synchronisation (one sort of each row instead of a `topk` of the largest budget), so a
    step that commits through it runs ahead of the device. Returns the per-row number committed
    (int64 `[B]`).
    """
    B, L = conf.shape
    scores = torch.where(mask, conf, -torch.inf)
    if threshold is not None and k is None and factor is None:
        # No budget: every masked position is a candidate (the ranking of `select_top` with limit n keeps all but
        # NaN, which the threshold's comparisons drop too), so the sort is skipped; the same selection.
        selected = mask & (_row_best(mask, scores) | (conf.to(torch.float64) >= _threshold(conf.dtype, conf.device,
                                                                                           threshold)))
        return _write(x, mask, x0, selected)
    ordered = torch.sort(scores, dim=1, descending=True).values
    n = mask.sum(dim=1, keepdim=True)
    limit = n if k is None else torch.minimum(n, k.reshape(B, 1).clamp_min(0))
    if factor is not None:
        ranked = ordered.to(torch.float64)
        rank = _positions(L, conf.device)[None]
        thresholds = rule_thresholds(conf.dtype, L, conf.device, factor=factor)
        fails = (rank >= 1) & (rank < n) & (ranked < thresholds)
        first_fail = torch.where(fails, rank, n).amin(dim=1, keepdim=True) if L else n
        limit = torch.where(first_fail >= n - 1, n, first_fail)
    selected = select_top(scores, mask, limit, ordered)
    if threshold is not None:
        selected &= _row_best(mask, scores) | (conf.to(torch.float64) >= _threshold(conf.dtype, conf.device, threshold))
    return _write(x, mask, x0, selected)


def _row_best(mask: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Each row's first masked position of the highest score (none in a row holding a NaN)."""
    return _first_true(mask & (scores == scores.amax(dim=1, keepdim=True)))


def _write(x: torch.Tensor, mask: torch.Tensor, x0: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """Commit `selected` (x ← x0 there, mask cleared); the per-row count."""
    x.copy_(torch.where(selected, x0, x))
    mask.masked_fill_(selected, False)
    return selected.sum(dim=1)


@functools.lru_cache(maxsize=64)
def _threshold(conf_dtype: torch.dtype, device: torch.device, threshold: float) -> torch.Tensor:
    """`rule_thresholds` for a threshold, made once per (dtype, device, τ) rather than every step."""
    return rule_thresholds(conf_dtype, 1, device, threshold=threshold)


@functools.lru_cache(maxsize=64)
def _positions(length: int, device: torch.device) -> torch.Tensor:
    """0 … length−1 as int64 on `device` (made once per length)."""
    return torch.arange(length, device=device)


def unmask_reference_loop(x: torch.Tensor, mask: torch.Tensor, x0: torch.Tensor, conf: torch.Tensor,
                          k: torch.Tensor) -> torch.Tensor:
    """LLaDA's formulation: confidence −inf off the mask, then a Python loop of `torch.topk` per
    row (one host synchronisation per row for its budget)."""
    confidence = torch.where(mask, conf, -torch.inf)
    transfer = torch.zeros_like(mask)
    for j in range(confidence.shape[0]):
        _, select_index = torch.topk(confidence[j], k=int(k[j]))
        transfer[j, select_index] = True
    transfer &= mask  # budgets beyond the masked count pick −inf positions; the reference then writes x back
    x.copy_(torch.where(transfer, x0, x))
    mask.masked_fill_(transfer, False)
    return transfer.sum(dim=1)

"""Torch references of dInfer's decoding kernels (`kernels/dinfer.py`): what the CPU path runs and
what the kernels are tested against.

* `credit_confidence_torch(logits, credit, masked, first, alpha, gamma, beta)`: dInfer's credit
  update and fusion — ``credit ← beta·credit`` (not on a block's first call), ``credit[top1] +=
  p_top1^gamma`` on masked rows (top1, p_top1: argmax and probability of the raw logits), then the
  argmax x0 and its softmax probability of ``logits + alpha·log(1 + credit)``. `credit` is updated
  in place; returns (x0, conf).
* `dinfer_select_torch(x, x0, conf, mask_id, rule, threshold, low_threshold)`: the commit of one
  step on each row of a block, in place on `x`: ``rule="threshold"`` (masked candidates whose x0 is
  not the mask token, conf ≥ min(threshold, max − 1e-5)) or ``"hierarchy"`` (the most confident of
  every contiguous masked run above `low_threshold`, every position above `threshold`, and the
  single most confident masked one; None switches a part off).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

SELECT_RULES = ("threshold", "hierarchy")


def credit_confidence_torch(logits: torch.Tensor, credit: torch.Tensor, masked: torch.Tensor, first: bool,
                            alpha: float, gamma: float, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`logits` `[B, L, V]`, `credit` float32 `[B, L, V]` (updated), `masked` bool `[B, L]`."""
    if not first:
        credit.mul_(beta)
    top_p, top_i = F.softmax(logits.to(torch.float32), dim=-1).max(dim=-1)
    # row by row: a vectorised pow's bits depend on where an element falls in the tensor (a row alone, a row stacked)
    boost = torch.stack([row.pow(gamma) for row in top_p.reshape(-1, top_p.shape[-1])]).view_as(top_p) \
        * masked.to(torch.float32)
    credit.scatter_add_(2, top_i.unsqueeze(-1), boost.unsqueeze(-1))
    fused = logits + alpha * torch.log(credit + 1)
    x0 = fused.argmax(dim=-1)
    conf = F.softmax(fused.to(torch.float32), dim=-1).gather(-1, x0.unsqueeze(-1)).squeeze(-1)
    return x0, conf


def dinfer_select_torch(x: torch.Tensor, x0: torch.Tensor, conf: torch.Tensor, mask_id: int, rule: str,
                        threshold: float | None, low_threshold: float | None = None) -> torch.Tensor:
    """Commit in `x` `[B, L]` (in place) from predictions `x0` and float32 confidences `conf`."""
    masked = x == mask_id
    if rule == "threshold":
        candidates = masked & (x0 != mask_id)
        c = torch.where(candidates, conf, -math.inf)
        best = c.amax(dim=1, keepdim=True)
        bar = (best - 1e-5).clamp(-1000, threshold)
        # the most confident always clears its own bar: compared apart, so a decision-margin
        # recorder (remask.margins) sees only the others against the bar, not a constant 1e-5
        commit = ((c == best) | (torch.where(c == best, -math.inf, c) >= bar)) & candidates
    else:
        B, L = x.shape
        floor = torch.finfo(conf.dtype).min
        c = torch.where(masked, conf, torch.full_like(conf, floor))
        prev = torch.cat([masked.new_zeros((B, 1)), masked[:, :-1]], dim=1)
        run = torch.where(masked, torch.cumsum((masked & ~prev).long(), dim=1) - 1, 0)
        run_max = torch.full_like(c, floor).scatter_reduce(1, run, c, reduce="amax", include_self=True)
        commit = c == run_max.gather(1, run)
        if low_threshold is not None:
            commit &= c > low_threshold
        if threshold is not None:
            commit |= c > threshold
        commit |= F.one_hot(c.argmax(dim=1), num_classes=L).bool()
        commit &= masked
    x.copy_(torch.where(commit, x0, x))
    return x

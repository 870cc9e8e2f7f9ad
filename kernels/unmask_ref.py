"""Torch reference for the unmask kernel: the CPU runtime and the oracle of tests and benchmarks.

Also the reference *formulation* (`unmask_reference_loop`): LLaDA / Fast-dLLM's per-row Python
loop over `torch.topk`, the baseline of the benchmarks.
"""
from __future__ import annotations

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


def candidate_ranks(conf: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Rank `[B, L]` (0 = most confident) of each masked position among its row's masked positions:
    confidence descending, the lower index first among equal confidences; unmasked positions rank
    after every masked one."""
    B, L = conf.shape
    c = conf.to(torch.float64) + 0.0  # −0.0 and +0.0 compare equal, as in torch.topk
    order = torch.sort(c, dim=1, descending=True, stable=True).indices
    order = order.gather(1, torch.sort(mask.gather(1, order).to(torch.int8), dim=1, descending=True,
                                       stable=True).indices)
    ranks = torch.empty_like(order)
    return ranks.scatter_(1, order, torch.arange(L, device=conf.device).expand(B, L).contiguous())


def unmask_torch(x: torch.Tensor, mask: torch.Tensor, x0: torch.Tensor, conf: torch.Tensor, *,
                 k: torch.Tensor | None = None, threshold: float | None = None,
                 factor: float | None = None) -> torch.Tensor:
    """Select and commit, in place (x ← x0 at the chosen positions, mask cleared there).

    Per row, with the masked positions ranked by `candidate_ranks` and n of them:
    budget `k`: ranks < k; `threshold` τ: rank 0, and every rank with confidence ≥ τ (with `k` as
    well: only among ranks < k, Dream's ``confidence_threshold``); `factor` f: Fast-dLLM's rule —
    the first c rank-ordered candidates where c is the first rank r ≥ 1 whose confidence is below
    1 − f/(r + 2), and all n when there is none or it is the last one (the reference's quirk).

    Returns the per-row number committed (int64 `[B]`).
    """
    B, L = conf.shape
    mask_b = mask.bool()
    rank = candidate_ranks(conf, mask_b)
    n = mask_b.sum(dim=1, keepdim=True)
    limit = n if k is None else torch.minimum(n, k.reshape(B, 1).to(torch.long).clamp_min(0))
    selected = mask_b & (rank < limit)
    c = conf.to(torch.float64)
    if threshold is not None:
        tau = rule_thresholds(conf.dtype, 1, conf.device, threshold=threshold)
        selected &= (rank == 0) | (c >= tau)
    elif factor is not None:
        thresholds = rule_thresholds(conf.dtype, L, conf.device, factor=factor)
        fails = mask_b & (rank >= 1) & (c < thresholds[rank.clamp_max(L - 1)])
        first_fail = torch.where(fails, rank, n).amin(dim=1, keepdim=True)
        count = torch.where(first_fail >= n - 1, n, first_fail)
        selected &= rank < count
    x.copy_(torch.where(selected, x0, x))
    mask.masked_fill_(selected, False)
    return selected.sum(dim=1)


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

"""Selection: which masked positions a step commits, given their confidences.

All functions take `confidence` `[B, L]` in which positions that may not be committed already
hold −inf (or the dtype's minimum), and return a bool `transfer_index` `[B, L]`. They are
vectorised over rows (no Python loop, no host synchronisation except where a reference's rule is
itself data-dependent on the host). `commit` writes the chosen tokens. This is the seam where the
fused Triton unmask kernel plugs in.

Ties: `torch.topk` decides, as in the references (on CPU and CUDA it returns the lower index
first among exactly equal values in practice, but does not promise it).
"""
from __future__ import annotations

import torch


def schedule_counts(block_mask: torch.Tensor, steps: int) -> torch.Tensor:
    """LLaDA's integer schedule `[B, steps]` (int64): with m masked positions in the block, each
    step commits ``m // steps`` and the first ``m % steps`` steps one more."""
    total = block_mask.sum(dim=1, keepdim=True)
    base = total // steps
    remainder = total % steps
    cols = torch.arange(steps, device=block_mask.device)[None]
    return base + (cols < remainder).to(torch.int64)


def select_topk(confidence: torch.Tensor, k: torch.Tensor | int) -> torch.Tensor:
    """The `k[b]` most confident positions of each row (per-row budgets, one `topk` call)."""
    B, L = confidence.shape
    k = torch.as_tensor(k, device=confidence.device).reshape(-1).expand(B)
    transfer = torch.zeros((B, L), dtype=torch.bool, device=confidence.device)
    k_max = int(k.max()) if B else 0
    if k_max <= 0:
        return transfer
    _, idx = torch.topk(confidence, min(k_max, L), dim=-1)
    keep = torch.arange(idx.shape[1], device=confidence.device)[None] < k[:, None]
    return transfer.scatter(1, idx, keep)


def select_threshold(confidence: torch.Tensor, candidates: torch.Tensor, threshold: float) -> torch.Tensor:
    """Fast-dLLM's threshold rule: per row, the most confident candidate always, plus every
    candidate with confidence ``>= threshold``."""
    above = candidates & (confidence >= threshold)
    best = torch.zeros_like(candidates).scatter_(1, torch.argmax(confidence, dim=1, keepdim=True), True)
    return (above | best) & candidates


def select_factor(confidence: torch.Tensor, candidates: torch.Tensor, factor: float) -> torch.Tensor:
    """Fast-dLLM's factor rule: sort a row's candidate confidences c1 ≥ c2 ≥ …; accept the i-th
    (1-based) while ``c_i >= 1 - factor / (i + 1)``; the first is always accepted.

    Reproduces the reference's quirk: when the first failure is at the *last* candidate, every
    candidate is accepted.
    """
    B, L = confidence.shape
    n_cand = candidates.sum(dim=1)
    sorted_conf = torch.sort(torch.where(candidates, confidence, -torch.inf), dim=1, descending=True).values
    rank = torch.arange(L, device=confidence.device)[None]
    # Thresholds rounded to the confidences' dtype, as the reference's Python floats are.
    thresholds = (1 - factor / (rank + 2).to(torch.float64)).to(confidence.dtype)
    fails = (sorted_conf < thresholds) & (rank >= 1) & (rank < n_cand[:, None])
    first_fail = torch.where(fails.any(dim=1), fails.to(torch.int64).argmax(dim=1), n_cand)
    count = torch.where(first_fail >= n_cand - 1, n_cand, first_fail)
    return select_topk(torch.where(candidates, confidence, -torch.inf), count) & candidates


def commit(x: torch.Tensor, x0: torch.Tensor, transfer_index: torch.Tensor) -> torch.Tensor:
    """Write the chosen tokens: `x` where not transferring, `x0` where transferring."""
    return torch.where(transfer_index, x0, x)

"""LLaDA's commit schedule. Which positions a step commits, and the commit itself, are
`remask.kernels.unmask` (per-row budget, Fast-dLLM threshold / factor, Dream's
confidence_threshold), one launch on CUDA, the torch reference elsewhere; Fast-dLLM++'s Fréchet
profile rule is a per-row budget for it (`frechet_profile_counts`)."""
from __future__ import annotations

import torch


def schedule_counts(block_mask: torch.Tensor, steps: int) -> torch.Tensor:
    """LLaDA's integer schedule `[B, steps]` (int64): with m masked positions in the block, each step commits ``m //
    steps`` and the first ``m % steps`` steps one more."""
    total = block_mask.sum(dim=1, keepdim=True)
    cols = torch.arange(steps, device=block_mask.device)[None]
    return total // steps + (cols < total % steps).to(torch.int64)


def entropy_bound_accept(entropy: torch.Tensor, entropy_bound: float, *, stable: bool = False) -> torch.Tensor:
    """The EB-sampler's decision (a bool mask): per row, the lowest-entropy positions while the sum of
    their entropies minus the largest stays ≤ `entropy_bound` (the lowest always; +inf entropies never).
    `stable`: equal entropies in index order (transformers' DiffusionGemma sorts without it)."""
    sorted_entropy, order = torch.sort(entropy, dim=-1, descending=False, stable=stable)
    within = torch.cumsum(sorted_entropy, dim=-1) - sorted_entropy <= entropy_bound
    return torch.scatter(torch.zeros_like(within), -1, order, within)


def frechet_profile_counts(conf: torch.Tensor, mask: torch.Tensor, margin: float) -> torch.Tensor:
    """Fast-dLLM++'s Fréchet profile budget, int64 `[B]`: with a row's masked confidences sorted
    c_1 ≥ … ≥ c_m, the number of n in 1…m whose score ``(c_1 + … + c_n − (n − 1)) − (1 − c_n)`` is
    above `margin` (n = 1 always counts; the score falls as n grows, so the count is the largest such
    prefix). Computed in the confidences' dtype (the reference's float64), the prefix sums in
    sorted order as the reference's cumsum. At least 1 (a row with no mask commits nothing anyway)."""
    ordered = torch.sort(torch.where(mask, conf, torch.zeros((), dtype=conf.dtype, device=conf.device)),
                         dim=1, descending=True).values
    cols = torch.arange(conf.shape[1], device=conf.device)
    valid = cols[None] < mask.sum(dim=1, keepdim=True)
    # confidences are ≥ 0, so the zeros put off the mask sort after every masked one (ties among zeros change
    # nothing: only the values enter the score)
    score = torch.cumsum(ordered, dim=1) - cols.to(conf.dtype) - (1.0 - ordered)
    chosen = valid & (score > margin)
    chosen[:, :1] = True
    return chosen.sum(dim=1)


def topk_commit(block_x: torch.Tensor, block_mask: torch.Tensor, x0: torch.Tensor, conf: torch.Tensor,
                k: torch.Tensor, length: int, offset: int) -> torch.Tensor:
    """LLaDA-style commit with `torch.topk`'s own order among equal confidences, as the references call it: per
    row, `topk` over the forward's `length` positions, the block's confidences at `[offset, offset + block)`,
    −inf elsewhere and off the mask (`kernels.unmask` commits the lower index first among ties; CPU `torch.topk`
    promises no order; float32 confidences often tie at 1.0). Writes `block_x`, clears `block_mask`; counts `[B]`."""
    B, block = block_x.shape
    scores = torch.full((B, length), -torch.inf, dtype=conf.dtype, device=conf.device)
    scores[:, offset:offset + block] = torch.where(block_mask, conf, torch.tensor(-torch.inf, dtype=conf.dtype))
    committed = torch.zeros_like(block_mask)
    for row in range(B):
        committed[row, torch.topk(scores[row], k=int(k[row])).indices - offset] = True
    committed &= block_mask
    block_x[committed] = x0[committed]
    block_mask &= ~committed   # cleared in place, as `unmask` does
    return committed.sum(dim=1)

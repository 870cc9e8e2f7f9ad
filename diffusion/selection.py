"""LLaDA's commit schedule. Which positions a step commits, and the commit itself, are
`remask.kernels.unmask` (per-row budget, Fast-dLLM threshold / factor, Dream's
confidence_threshold), one launch on CUDA, the torch reference elsewhere."""
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

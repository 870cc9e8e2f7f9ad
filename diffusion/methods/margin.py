"""The margin rule: commit every masked position whose top-1 − top-2 probability margin is at
least `margin` (LLaDA's `margin` confidence used as dInfer uses the probability). A commit rule, so
every loop that takes `decoder=` runs it: dInfer's block loop on LLaDA and Dream, SDAR's and
LLaDA2's loops, Elastic-Cache's window, the engine; its registry name is "margin"."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..parts.checks import check_real, checked
from ..parts.step import CommitRule


@dataclass(frozen=True)
class MarginDecoding(CommitRule):
    """Commit every masked position whose top-1 − top-2 probability margin is at least `margin`, or, when none is,
    the one with the largest (ties: the first), greedily; the mask token is never proposed. LLaDA's `margin`
    confidence used as dInfer uses the probability: a combination no paper shipped (`{"name": "margin"}`)."""

    name = "margin"
    margin: float = checked(0.5, check_real, low=0, high=1)

    def commit(self, block: torch.Tensor, logits: torch.Tensor, mask_id: int,
               state: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(logits.float(), dim=-1)
        if 0 <= mask_id < probs.shape[-1]:
            probs = probs.index_fill(-1, torch.tensor([mask_id], device=probs.device), 0.0)
        top = probs.topk(2, dim=-1)
        x0, gap = top.indices[..., 0], top.values[..., 0] - top.values[..., 1]
        masked = block == mask_id
        gap = torch.where(masked, gap, torch.full_like(gap, -1.0))
        commit = masked & (gap >= self.margin)
        best = torch.zeros_like(commit).scatter_(-1, gap.argmax(dim=-1, keepdim=True), True)
        stuck = masked.any(dim=-1, keepdim=True) & ~commit.any(dim=-1, keepdim=True)
        commit = commit | (best & masked & stuck)
        return commit, torch.where(commit, x0, block)

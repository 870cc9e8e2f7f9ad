"""EB-Sampler (entropy-bounded unmasking; Ben-Hamu et al., arXiv 2505.24857) as a commit rule.

At each step, over a block's masked positions sorted by the entropy of their predicted distribution
(lowest first), commit the largest prefix whose summed entropy minus its largest entropy stays
within `gamma` — the lowest-entropy position always — each to its argmax (greedy). No official
repository exists; this follows the paper's rule, which SGLang's port (`EBSampling`, default
γ = 0.15) and DiffusionGemma's own sampler (`entropy_bound`) also implement: entropies in nats from
a float32 softmax with the mask token's logit removed, so the mask token is never proposed; equal
entropies in index order. A commit rule, so every loop that takes `decoder=` runs it (LLaDA's and
Dream's block loop, SDAR's and LLaDA2's loops, Elastic-Cache's window, the engine); registry name
"eb_sampler".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..parts.checks import check_real, checked
from ..parts.selection import entropy_bound_accept
from ..parts.step import CommitRule


@dataclass(frozen=True)
class EBSampler(CommitRule):
    """Commit the lowest-entropy masked positions while their summed entropy minus the largest is
    ≤ `gamma` (at least one per step), greedily. With γ = 0 a step commits the lowest-entropy
    position and every other one of entropy 0."""

    name = "eb_sampler"
    gamma: float = checked(0.15, check_real, low=0)

    def commit(self, block: torch.Tensor, logits: torch.Tensor, mask_id: int,
               state: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        logits = logits.float()
        if 0 <= mask_id < logits.shape[-1]:
            logits = logits.index_fill(-1, torch.tensor([mask_id], device=logits.device), -torch.inf)
        log_probs = torch.log_softmax(logits, dim=-1)
        entropy = -(log_probs.exp() * log_probs.nan_to_num(neginf=0.0)).sum(dim=-1)
        masked = block == mask_id
        commit = entropy_bound_accept(torch.where(masked, entropy, torch.inf), self.gamma, stable=True) & masked
        return commit, torch.where(commit, logits.argmax(dim=-1), block)

"""Fast-dLLM++'s Fréchet profile rule (Ringo-Star/FastdLLM_plusplus, `v1/llada/generate.py`,
`get_transfer_index_frechet_profile`; arXiv 2606.02955) as a commit rule.

At each step, over a block's masked positions sorted by confidence c_1 ≥ … ≥ c_m (the float64 softmax
probability of the argmax), commit the largest prefix n whose profile score — the Fréchet lower bound
on all n being right, ``c_1 + … + c_n − (n − 1)``, minus the bound on a competitor, ``1 − c_n`` — is
above `frechet_margin`; the most confident position always. With equal confidences it is Fast-dLLM's
factor rule at ``factor = 1 − frechet_margin``. The budget is `parts/selection.frechet_profile_counts`,
the commit `kernels.unmask` (the lower index first among equal confidences).

Two ways in: ``remask.generate(..., frechet_margin=δ)`` (and `SamplingParams(frechet_margin=δ)`) is the
reference's own loop, Fast-dLLM v1's block loop with or without its prefix / dual cache, beside
`threshold` and `factor` (`diffusion/families/llada.py`); this config, `decoder=FrechetRule(...)`, is the
rule on every loop that takes a commit rule (dInfer's block loop on LLaDA and Dream, SDAR's and LLaDA2's
loops, Elastic-Cache's window, the engine), greedily, the mask token never proposed; registry name
"frechet".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from remask.kernels import unmask

from ..parts.checks import check_real, checked
from ..parts.scoring import score_tokens
from ..parts.selection import frechet_profile_counts
from ..parts.step import CommitRule


@dataclass(frozen=True)
class FrechetRule(CommitRule):
    """Commit the most confident masked positions while their Fréchet profile score stays above
    `frechet_margin` (δ; at least one per step), each to its argmax. The README's default δ = 0.25
    (its main tables; smaller commits more per step). Any finite δ is taken, as the reference takes
    it: δ ≥ 1 commits one position a step (no score of n ≥ 2 exceeds 1), a negative δ more."""

    name = "frechet"
    frechet_margin: float = checked(0.25, check_real)

    def commit(self, block: torch.Tensor, logits: torch.Tensor, mask_id: int,
               state: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        # the reference's scoring: argmax, its float64 softmax probability (the mask token never proposed; a mask id
        # past the vocabulary is never the argmax)
        x0, conf = score_tokens(logits, softmax_dtype=torch.float64, exclude_id=mask_id)
        masked = block == mask_id
        tokens, left = block.clone(), masked.clone()
        unmask(tokens, left, x0, conf, k=frechet_profile_counts(conf, masked, self.frechet_margin))
        return masked & ~left, tokens

"""Logits processors: edits of a forward's logits before a decoder's commit scores them, given to a
decoder as parts (`Decoder.add_processor`) rather than as subclasses of it.

`HoldEndIds` is `min_tokens`: vLLM masks the end tokens while fewer than `min_tokens` tokens exist;
a diffusion model writes in any order, so here they are masked at the answer's first `min_tokens`
positions at every step, before the (unchanged) rule scores. The structured-output filter
(`constrain.CommitFilter`) and temperature / top-p (`scoring.filter_logits`) are the other parts
that edit logits; they live beside the scoring they belong to.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from remask.models.parallel import full_logits


def hold_end_ids(logits: torch.Tensor, fed: int, until: int, ids: torch.Tensor) -> torch.Tensor:
    """`logits` `[B, L, V]` of positions `fed`, `fed + 1`, … with `ids` at −inf at the positions
    before `until` (`min_tokens`: no end token can be chosen there). A copy where anything changes;
    the caller's tensor (a shared forward's) is never written."""
    cut = min(until - fed, logits.shape[1])
    if cut <= 0:
        return logits
    logits = full_logits(logits).clone()     # whole rows: the ids are global vocabulary ids
    logits[:, :cut].index_fill_(-1, ids, -torch.inf)
    return logits


@dataclass(frozen=True, eq=False)
class HoldEndIds:
    """`min_tokens`: the end `ids` held back at the answer's first `min_tokens` positions."""

    min_tokens: int
    ids: torch.Tensor

    def __call__(self, state: Any, logits: torch.Tensor, fed: int) -> torch.Tensor:
        return hold_end_ids(logits, fed, state.prompt_len + self.min_tokens, self.ids)

"""The shape of every diffusion step: score → decide → update.

* **score**: the model's logits give each position a proposal (its sample or argmax) and a score
  (confidence, entropy): `scoring.score_rows` (mask models), `kernels.canvas.canvas_score`
  (uniform-noise models).
* **decide**: a rule picks what changes — a `Decision` of three kinds of change:
  *commit* (a mask becomes a token: LLaDA, Dream, Fast-dLLM's rules), *edit* (a decoded token
  becomes another: token-editing models), *renoise* (a token becomes a uniformly random one:
  uniform-noise models such as DiffusionGemma, where every position not accepted is re-drawn).
* **update**: `apply_decision` writes the proposals and the noise into the tokens.

Where a kernel fuses decide and update (`kernels.unmask` for commits, `kernels.canvas.canvas_update`
for the entropy-bound accept + renoise), it produces exactly what `apply_decision` does with the
same decision; the rules that run in torch build a `Decision` and call it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch


@dataclass
class Decision:
    """What one step changes, as bool masks over the tokens `[B, L]` (None: nothing of that kind).

    commit: positions that take their proposal now (masked ones for mask models, the accepted ones
    for uniform-noise models). edit: decoded positions that take a new proposal. renoise:
    positions that get a fresh uniform token. The three never overlap."""

    commit: torch.Tensor
    edit: torch.Tensor | None = None
    renoise: torch.Tensor | None = None

    def __post_init__(self) -> None:
        masks = [m for m in (self.commit, self.edit, self.renoise) if m is not None]
        for m in masks:
            if m.dtype != torch.bool or m.shape != self.commit.shape:
                raise ValueError(f"a Decision's masks are bool tensors of one shape, got {m.dtype} {tuple(m.shape)}")
        if len(masks) > 1 and bool((torch.stack(masks).sum(0) > 1).any()):
            raise ValueError("a position can be committed, edited or renoised, not two of them")

    @property
    def changed(self) -> torch.Tensor:
        """Every position the step writes."""
        out = self.commit
        for m in (self.edit, self.renoise):
            if m is not None:
                out = out | m
        return out


def apply_decision(tokens: torch.Tensor, proposal: torch.Tensor, decision: Decision,
                   noise_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """The update: committed and edited positions take `proposal`, renoised ones `noise_tokens`;
    the rest keep `tokens`. Returns a new tensor (`tokens` is not modified)."""
    take = decision.commit if decision.edit is None else decision.commit | decision.edit
    out = torch.where(take, proposal, tokens)
    if decision.renoise is not None:
        if noise_tokens is None:
            raise ValueError("a Decision that renoises needs noise_tokens")
        out = torch.where(decision.renoise, noise_tokens, out)
    return out


class CommitRule:
    """A commit rule that `decoder=` takes: a small config whose `commit` decides, from one block's
    tokens `[B, L]` and logits `[B, L, V]`, which masked positions take which token this step.

    `commit(block, logits, mask_id, state)` returns `(commit, tokens)`: `commit` a bool `[B, L]` of
    masked positions, `tokens` `[B, L]` holding their tokens; nothing is changed in place, and a
    block with a masked position gets at least one commit (so every loop ends). `new_state()` is the
    rule's memory over one block's steps (None: none; `CreditDecoding`'s credit matrix), made again
    at each block. Defining a subclass with a `name` registers it in `CommitRule.registry`: every
    loop that takes `decoder=` (dInfer's block loop on LLaDA and Dream, SDAR's, LLaDA2's), the
    `SamplingParams` check, the JSON form `{"name": ...}` and docs/compatibility.md find it there —
    a new rule is one class in `diffusion/parts/rules.py` and its test.
    """

    name: ClassVar[str] = ""
    registry: ClassVar[dict[str, type]] = {}
    smoothing: Any = None     # dInfer's iteration smoothing (its own loop only); None for other rules

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("name"):
            CommitRule.registry[cls.name] = cls

    def new_state(self) -> Any:
        return None

    def commit(self, block: torch.Tensor, logits: torch.Tensor, mask_id: int,
               state: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

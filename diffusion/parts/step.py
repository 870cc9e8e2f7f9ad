"""The shape of every diffusion step: score → decide → update.

* **score**: each position gets a proposal (its sample or argmax) and a score (confidence, entropy):
  `scoring.score_rows` (mask models), `kernels.canvas.canvas_score` (uniform-noise models).
* **decide**: a rule picks what changes, a `Decision`: *commit* (a mask becomes a token), *edit* (a decoded token
  becomes another) or *renoise* (a uniformly random token: DiffusionGemma's rejects).
* **update**: `apply_decision` writes the proposals and the noise into the tokens; a kernel fusing decide and
  update (`kernels.unmask`, `kernels.canvas.canvas_update`) does exactly the same.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import torch

from .checks import NoWorkBound
from .protocol import Together


@dataclass
class Decision:
    """What one step changes: non-overlapping bool masks over the tokens `[B, L]` (None: nothing of that kind); for a
    uniform-noise model, `commit` holds the accepted positions."""

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
        return torch.stack([m for m in (self.commit, self.edit, self.renoise) if m is not None]).any(0)


def masked_canvas(prompt: torch.Tensor, gen_length: int, mask_id: int, device: Any = None) -> torch.Tensor:
    """The canvas a mask model decodes: `prompt` `[B, P]`, then `gen_length` mask tokens (int64)."""
    x = torch.full((prompt.shape[0], prompt.shape[1] + gen_length), mask_id, dtype=torch.long,
                   device=prompt.device if device is None else device)
    x[:, :prompt.shape[1]] = prompt
    return x


def apply_decision(tokens: torch.Tensor, proposal: torch.Tensor, decision: Decision,
                   noise_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """A new tensor: committed and edited positions take `proposal`, renoised ones `noise_tokens`, the rest `tokens`."""
    take = decision.commit if decision.edit is None else decision.commit | decision.edit
    out = torch.where(take, proposal, tokens)
    if decision.renoise is not None:
        if noise_tokens is None:
            raise ValueError("a Decision that renoises needs noise_tokens")
        out = torch.where(decision.renoise, noise_tokens, out)
    return out


class CommitRule(NoWorkBound):
    """A commit rule that `decoder=` takes: a small config whose `commit(block, logits, mask_id, state)` returns
    `(commit, tokens)` for one block's tokens `[B, L]` and logits `[B, L, V]`: `commit` a bool `[B, L]` of masked
    positions, `tokens` `[B, L]` their tokens; nothing is changed in place, and a block with a mask gets at least one
    commit (so every loop ends). `new_state()`: the rule's memory over one block's steps (None: none;
    `CreditDecoding`'s credit matrix). `name`: its JSON name; a new rule is its own file in `diffusion/methods/`
    plus a line in the registry (`diffusion/methods/registry.py`), where every loop that takes `decoder=`, the
    `SamplingParams` check, the JSON form `{"name": ...}` and docs/compatibility.md find it.

    A rule has no work bound (`check_request`, which every config has, refuses nothing)."""

    name: ClassVar[str] = ""
    smoothing: Any = None     # dInfer's iteration smoothing (`BlockDecoder(rule=...)` only); None for other rules

    def new_state(self) -> Any:
        return None

    def check_greedy(self, loop: str) -> None:
        """Refuse by name a setting that draws (KLASS's "random": its own loop's generator); `loop`'s loop runs the
        rule greedily (`check_rule_on_loop`, dInfer's `BlockDecoder`)."""

    def commit(self, block: torch.Tensor, logits: torch.Tensor, mask_id: int,
               state: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    stacks_state: ClassVar[bool] = False   # its `commit_rows` stacks its requests' states (`CreditDecoding`)

    def commit_rows(self, block: torch.Tensor, logits: torch.Tensor, mask_id: int, states: Sequence[Any],
                    sizes: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """`commit` over several requests' blocks stacked (request i: `sizes[i]` rows, its `new_state()` `states[i]`:
        None, or stacked by a rule that `stacks_state`), each row committing what its own request's `commit` would (a
        rule decides row by row): the engine's batched commit."""
        return self.commit(block, logits, mask_id, None)

    def commit_later(self, block: torch.Tensor, logits: torch.Tensor, mask_id: int, state: Any = None) -> Together:
        """`commit(...)` as a step generator asks for it (``commit, tokens = yield rule.commit_later(...)``): in the
        engine one `commit_rows` with the other requests' blocks of this rule and width."""
        return Together((CommitRule, self, block.shape[1:]) if self.batches(state) else None, rule_commits,
                        (self, block, logits, mask_id, state))

    def batches(self, state: Any) -> bool:
        """Whether commits with this `new_state()` batch across requests (`commit_rows`): no state, or one it stacks."""
        return state is None or self.stacks_state


def rule_commits(items: list[tuple]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`(rule, block, logits, mask_id, state)` items of one rule and block width: each its `(commit, tokens)`, as
    `rule.commit` gives them; several in one `commit_rows` over their blocks stacked."""
    _, commit, tokens = stacked_rule_commit(items)
    sizes = [len(block) for _, block, _, _, _ in items]
    return list(zip(commit.split(sizes), tokens.split(sizes)))


def stacked_rule_commit(items: list[tuple]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`rule_commits` with the items' rows stacked: (their blocks, commit, tokens), each `[Σ rows, L]`."""
    rule, block, logits, mask_id, state = items[0]
    if len(items) == 1:
        return block, *rule.commit(block, logits, mask_id, state)
    blocks = torch.cat([item[1] for item in items])
    return blocks, *rule.commit_rows(blocks, torch.cat([item[2] for item in items]), mask_id,
                                     [item[4] for item in items], [len(item[1]) for item in items])

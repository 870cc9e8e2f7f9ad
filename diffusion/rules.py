"""dInfer's commit rules as small pure functions over one block's scores, for any step-wise loop.

`ThresholdDecoding`, `HierarchicalDecoding` and `CreditDecoding` (`remask.diffusion.dinfer`) decide,
from a block's logits, which of its masked positions to commit at a step. Here each is a function

    commit, tokens = rule_commit(block, logits, mask_id, rule, credit=None)

over the block's tokens `[B, L]` and logits `[B, L, V]`: `commit` (bool `[B, L]`) is the masked
positions the rule commits this step, `tokens` the block with them written (the caller writes
``block[commit] = tokens[commit]``). Nothing is changed in place. The maths is dInfer's own, imported
from `remask.diffusion.dinfer` and not copied (`_threshold_commit`, `_hierarchy_commit`, `_Credit`,
`_fallback`, the `dinfer_select` kernel): the logits are read in float32, x0 is their argmax, and a
step where every candidate predicts the mask token commits the most confident masked position with
its best other token (dInfer's loop repeats such a step forever; `dinfer_generate` does the same) —
so every step on a block with masks commits at least one position.

`CreditDecoding` keeps a credit matrix over a block's steps: `new_credit(rule)` makes it (one per
block and prompt), and `rule_commit` updates it; the function is pure given that state.

The block-causal families' loops take them as `decoder=` (new combinations, no paper shipped
them): SDAR (`sdar_generate`, `remask.compat.sdar.block_diffusion_generate`, the engine) and
LLaDA2.0 (`remask.compat.llada2.generate`, the engine) run their own block loop — their forwards,
cache, block order and stop rule — with the rule choosing each step's commits instead of their
remasking strategy, greedily (temperature 0), until the block has no mask. `check_rule_on_loop`
refuses by name every setting of the family's that the combination does not read.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from remask.kernels.dinfer import dinfer_select

from .checks import check_instance
from .dinfer import (CreditDecoding, HierarchicalDecoding, ThresholdDecoding, _Credit, _fallback, _hierarchy_commit,
                     _threshold_commit)

__all__ = ["RULES", "is_rule", "new_credit", "threshold_commit", "hierarchy_commit", "credit_commit", "rule_commit",
           "check_rule_on_loop", "check_block_decoder", "unread_settings"]

RULES = (ThresholdDecoding, CreditDecoding, HierarchicalDecoding)


def is_rule(decoder: Any) -> bool:
    """Whether `decoder` is one of dInfer's commit rules."""
    return isinstance(decoder, RULES)


def new_credit(rule: CreditDecoding) -> _Credit:
    """A fresh credit state (zeros) for one block of one prompt."""
    return _Credit(rule)


def _scores(block: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if block.dim() != 2 or logits.dim() != 3 or logits.shape[:2] != block.shape:
        raise ValueError(f"a block [B, L] and its logits [B, L, V], got {tuple(block.shape)} and "
                         f"{tuple(logits.shape)}")
    logits = logits if logits.dtype == torch.float32 else logits.to(torch.float32)   # dInfer's decode
    return block.clone(), logits, block


def _committed(proposal: torch.Tensor, before: torch.Tensor, logits: torch.Tensor,
               mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    _fallback(proposal, before, logits, mask_id)
    return before & (proposal != mask_id), proposal


def threshold_commit(block: torch.Tensor, logits: torch.Tensor, mask_id: int,
                     threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`ThresholdDecoding`: every masked position whose argmax (not the mask token) has float32
    probability ≥ min(threshold, the block's best − 1e-5)."""
    proposal, logits, block = _scores(block, logits)
    before = block == mask_id
    _threshold_commit(proposal, logits, threshold, mask_id)
    return _committed(proposal, before, logits, mask_id)


def hierarchy_commit(block: torch.Tensor, logits: torch.Tensor, mask_id: int,
                     rule: HierarchicalDecoding) -> tuple[torch.Tensor, torch.Tensor]:
    """`HierarchicalDecoding`: the best of every contiguous masked run above `low_threshold`, every
    position above `threshold`, and the single most confident masked position."""
    proposal, logits, block = _scores(block, logits)
    before = block == mask_id
    _hierarchy_commit(proposal, logits, rule, mask_id)
    return _committed(proposal, before, logits, mask_id)


def credit_commit(block: torch.Tensor, logits: torch.Tensor, mask_id: int, rule: CreditDecoding,
                  credit: _Credit) -> tuple[torch.Tensor, torch.Tensor]:
    """`CreditDecoding`: the threshold rule on ``logits + credit_alpha · log(1 + C)``; `credit`
    (`new_credit(rule)`, one per block) is updated."""
    proposal, logits, block = _scores(block, logits)
    before = block == mask_id
    x0, conf = credit.step(logits, before)
    dinfer_select(proposal, x0, conf, mask_id, "threshold", rule.threshold)
    return _committed(proposal, before, logits, mask_id)


def rule_commit(block: torch.Tensor, logits: torch.Tensor, mask_id: int, rule: Any,
                credit: _Credit | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(commit `[B, L]` bool, tokens `[B, L]`) of `rule` on a block and its logits (see the module
    docstring); `credit` is required by `CreditDecoding` and ignored otherwise."""
    if isinstance(rule, HierarchicalDecoding):
        return hierarchy_commit(block, logits, mask_id, rule)
    if isinstance(rule, CreditDecoding):
        if credit is None:
            raise ValueError("CreditDecoding keeps a credit state over a block's steps: pass credit=new_credit(rule)")
        return credit_commit(block, logits, mask_id, rule, credit)
    if isinstance(rule, ThresholdDecoding):
        return threshold_commit(block, logits, mask_id, rule.threshold)
    raise ValueError(f"rule must be one of {', '.join(t.__name__ for t in RULES)}, got {type(rule).__name__}")


def check_rule_on_loop(rule: Any, family: str, *, temperature: float, unread: Mapping[str, Any] = (),
                       replaces: str = "remasking rule") -> None:
    """Refuse what `decoder=rule` on `family`'s loop does not read, each by name with both parts:
    a temperature above 0 (the rules are greedy), iteration smoothing (it feeds embeddings to
    dInfer's own loop) and `unread`, the family's settings given (name → value) that the rule
    replaces."""
    name = type(rule).__name__
    if temperature != 0:
        raise ValueError(f"temperature: decoder={name} on {family}'s loop decodes greedily (temperature 0), "
                         f"got {temperature}")
    if rule.smoothing is not None:
        raise ValueError(f"smoothing: decoder={name}(smoothing=IterationSmoothing) feeds embeddings to dInfer's own "
                         f"loop; {family}'s loop feeds token ids: leave smoothing None")
    given = dict(unread)
    if given:
        raise ValueError(f"decoder={name} replaces {family}'s {replaces} and does not read {list(given)}: leave "
                         f"{'it' if len(given) == 1 else 'them'} unset (got "
                         f"{', '.join(f'{k}={v!r}' for k, v in given.items())})")


def check_block_decoder(decoder: Any) -> None:
    """`decoder=` on a block-causal family's drop-in function: FreeDave or one of dInfer's rules."""
    from .freedave import FreeDave

    check_instance("decoder", decoder, (FreeDave, *RULES), "remask.FreeDave, ThresholdDecoding, CreditDecoding or "
                   "HierarchicalDecoding (the decoders block-causal models take)")


def unread_settings(given: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The settings in `given` that differ from their `defaults` (those a caller set)."""
    return {name: value for name, value in given.items() if value != defaults[name]}

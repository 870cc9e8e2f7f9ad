"""Commit rules: dInfer's three (their maths in `remask.diffusion.methods.dinfer`), `MarginDecoding`, and the calls around
them of the loops that take `decoder=` (how a rule plugs in: `CommitRule` in `diffusion/parts/step.py`). On SDAR's
and LLaDA2.0's own loops a rule chooses each step's commits instead of their remasking strategy, greedily.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .checks import check_instance, check_real
from ..methods.dinfer import CreditDecoding, HierarchicalDecoding, ThresholdDecoding
from .step import CommitRule

__all__ = ["CommitRule", "CreditDecoding", "HierarchicalDecoding", "MarginDecoding", "ThresholdDecoding", "is_rule",
           "rule_types", "rule_commit", "commit_block", "check_rule_on_loop", "check_block_decoder", "unread_settings"]


def rule_types() -> tuple[type, ...]:
    """Every registered commit rule (dInfer's three and any defined since)."""
    return tuple(CommitRule.registry.values())


def is_rule(decoder: Any) -> bool:
    """Whether `decoder` is a commit rule (`CommitRule`)."""
    return isinstance(decoder, CommitRule)


def rule_commit(block: torch.Tensor, logits: torch.Tensor, mask_id: int, rule: CommitRule,
                state: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(commit, tokens) `[B, L]` of `rule` on a block and its logits; `state`: the rule's `new_state()`."""
    if not is_rule(rule):
        raise ValueError(f"rule must be a remask commit rule ({', '.join(t.__name__ for t in rule_types())}), got "
                         f"{type(rule).__name__}")
    if block.dim() != 2 or logits.dim() != 3 or logits.shape[:2] != block.shape:
        raise ValueError(f"a block [B, L] and its logits [B, L, V], got {tuple(block.shape)} and {tuple(logits.shape)}")
    return rule.commit(block, logits, mask_id, state)


def commit_block(rule: CommitRule, block: torch.Tensor, logits: torch.Tensor, mask_id: int, held: Any,
                 block_id: int) -> tuple[torch.Tensor, tuple[int, Any]]:
    """One step of `rule` on `block` (a view: written in place). `held`: the previous call's (block id, the rule's
    state) or None, fresh at a new block. Returns (the commit mask, what to hold for the next call)."""
    if held is None or held[0] != block_id:
        held = (block_id, rule.new_state())
    commit, tokens = rule_commit(block, logits, mask_id, rule, held[1])
    block[commit] = tokens[commit]
    return commit, held


def check_rule_on_loop(rule: Any, family: str, *, temperature: float, unread: Mapping[str, Any] = (),
                       replaces: str = "remasking rule") -> None:
    """Refuse by name what `decoder=rule` on `family`'s loop does not read: a temperature above 0 (rules are
    greedy), iteration smoothing (dInfer's own loop only) and `unread`, the replaced settings given (name → value)."""
    name = type(rule).__name__
    if temperature != 0:
        raise ValueError(f"temperature: decoder={name} on {family}'s loop decodes greedily (temperature 0), "
                         f"got {temperature}")
    if rule.smoothing is not None:
        raise ValueError(f"smoothing: decoder={name}(smoothing=IterationSmoothing) feeds embeddings to dInfer's own "
                         f"loop; {family}'s loop feeds token ids: leave smoothing None")
    if unread:
        raise ValueError(f"decoder={name} replaces {family}'s {replaces} and does not read {list(unread)}: leave "
                         f"{'it' if len(unread) == 1 else 'them'} unset (got "
                         f"{', '.join(f'{k}={v!r}' for k, v in unread.items())})")


def check_block_decoder(decoder: Any) -> None:
    """`decoder=` on a block-causal family's drop-in function: FreeDave or one of dInfer's rules."""
    from ..methods.freedave import FreeDave

    check_instance("decoder", decoder, (FreeDave, CommitRule), "remask.FreeDave or a commit rule ("
                   + ", ".join(t.__name__ for t in rule_types()) + ": the decoders block-causal models take)")


def unread_settings(given: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The settings in `given` that differ from their `defaults` (those a caller set)."""
    return {name: value for name, value in given.items() if value != defaults[name]}


@dataclass(frozen=True)
class MarginDecoding(CommitRule):
    """Commit every masked position whose top-1 − top-2 probability margin is at least `margin`, or, when none is,
    the one with the largest (ties: the first), greedily; the mask token is never proposed. LLaDA's `margin`
    confidence used as dInfer uses the probability: a combination no paper shipped (`{"name": "margin"}`)."""

    name = "margin"
    margin: float = 0.5

    def __post_init__(self) -> None:
        check_real("margin", self.margin, low=0, high=1)

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

"""Commit rules: small pure functions over one block's scores, for any step-wise loop.

A rule is a `CommitRule` (`diffusion/parts/step.py`): a config whose

    commit, tokens = rule.commit(block, logits, mask_id, state)

decides, from a block's tokens `[B, L]` and logits `[B, L, V]`, which masked positions take which
token this step (`commit` bool `[B, L]`; the caller writes ``block[commit] = tokens[commit]``;
nothing is changed in place). `rule_commit` is that call with its shapes checked. dInfer's three
rules are `ThresholdDecoding`, `CreditDecoding` (its credit matrix is the rule's per-block state,
`rule.new_state()`) and `HierarchicalDecoding` (`remask.diffusion.dinfer`, where their maths is);
a new rule is a `CommitRule` subclass with a `name` here, and every loop that takes `decoder=` runs
it: dInfer's block loop on LLaDA and Dream (`dinfer_steps`), SDAR's and LLaDA2.0's own loops (their
forwards, cache, block order and stop rule, with the rule choosing each step's commits instead of
their remasking strategy, greedily, until the block has no mask), the engine, the JSON form
`{"name": ...}` and docs/compatibility.md. `check_rule_on_loop` refuses by name every setting of a
family's loop that the combination does not read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .checks import check_instance, check_real
from ..methods.dinfer import CreditDecoding, HierarchicalDecoding, ThresholdDecoding
from .step import CommitRule

__all__ = ["CommitRule", "CreditDecoding", "HierarchicalDecoding", "MarginDecoding", "ThresholdDecoding", "is_rule", "rule_types",
           "rule_commit", "commit_block", "check_rule_on_loop", "check_block_decoder", "unread_settings"]


def rule_types() -> tuple[type, ...]:
    """Every registered commit rule (dInfer's three and any defined since)."""
    return tuple(CommitRule.registry.values())


def is_rule(decoder: Any) -> bool:
    """Whether `decoder` is a commit rule (`CommitRule`)."""
    return isinstance(decoder, CommitRule)


def rule_commit(block: torch.Tensor, logits: torch.Tensor, mask_id: int, rule: CommitRule,
                state: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(commit `[B, L]` bool, tokens `[B, L]`) of `rule` on a block and its logits; `state` is the
    rule's per-block state (`rule.new_state()`, None for the rules without one)."""
    if not is_rule(rule):
        raise ValueError(f"rule must be a remask commit rule ({', '.join(t.__name__ for t in rule_types())}), got "
                         f"{type(rule).__name__}")
    if block.dim() != 2 or logits.dim() != 3 or logits.shape[:2] != block.shape:
        raise ValueError(f"a block [B, L] and its logits [B, L, V], got {tuple(block.shape)} and "
                         f"{tuple(logits.shape)}")
    return rule.commit(block, logits, mask_id, state)


def commit_block(rule: CommitRule, block: torch.Tensor, logits: torch.Tensor, mask_id: int, held: Any,
                 block_id: int) -> tuple[torch.Tensor, tuple[int, Any]]:
    """One step of `rule` on `block` (a view: the commits are written into it), for the loops that
    take a rule. `held` is what the previous call returned for this request — `(block id, the rule's
    state)` or None — and the state is made fresh when the block changes. Returns (the commit mask,
    what to hold for the next call)."""
    if held is None or held[0] != block_id:
        held = (block_id, rule.new_state())
    commit, tokens = rule_commit(block, logits, mask_id, rule, held[1])
    block[commit] = tokens[commit]
    return commit, held


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
    from ..methods.freedave import FreeDave

    check_instance("decoder", decoder, (FreeDave, CommitRule), "remask.FreeDave or a commit rule ("
                   + ", ".join(t.__name__ for t in rule_types()) + ": the decoders block-causal models take)")


def unread_settings(given: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The settings in `given` that differ from their `defaults` (those a caller set)."""
    return {name: value for name, value in given.items() if value != defaults[name]}


@dataclass(frozen=True)
class MarginDecoding(CommitRule):
    """The margin rule: commit every masked position whose top-1 − top-2 probability margin is at
    least `margin`, or, when none is, the one with the largest margin (ties: the first). Greedy:
    each committed position takes its argmax. The mask token is never proposed (its probability is
    set aside before the top two are taken). The margin is LLaDA's `margin` confidence (the gap
    between the two most likely tokens) used as a threshold rule, as dInfer uses the probability;
    a combination no paper shipped, written as a `CommitRule` so every loop that takes
    `decoder=` runs it (`decoder={"name": "margin", "margin": 0.5}` in JSON)."""

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

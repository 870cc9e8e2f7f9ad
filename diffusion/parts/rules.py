"""Commit rules: dInfer's three (`ThresholdDecoding`, `CreditDecoding`, `HierarchicalDecoding`; dInfer's loop, LLaDA's
`BlockDecoder` with `rule=`, runs them: `remask.diffusion.methods.dinfer`), and the calls around
them of the loops that take `decoder=` (how a rule plugs in: `CommitRule` in `diffusion/parts/step.py`). On SDAR's
and LLaDA2.0's own loops a rule chooses each step's commits instead of their remasking strategy, greedily.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F

from remask.kernels.dinfer import credit_confidence, dinfer_select

from .checks import Checked, check_instance, check_real, checked
from .step import CommitRule

__all__ = ["CommitRule", "CreditDecoding", "HierarchicalDecoding", "IterationSmoothing", "ThresholdDecoding", "is_rule",
           "rule_types", "rule_commit", "commit_block", "check_rule_on_loop"]


def rule_types() -> tuple[type, ...]:
    """Every commit rule class with a `name`, in definition order (the names these messages list; the
    methods' registry, `diffusion/methods/registry.py`, is what resolves a name)."""
    def named(cls: type) -> Iterator[type]:
        for rule in cls.__subclasses__():
            if rule.__dict__.get("name"):
                yield rule
            yield from named(rule)

    return tuple(named(CommitRule))


def is_rule(decoder: Any) -> bool:
    """Whether `decoder` is a commit rule (`CommitRule`)."""
    return isinstance(decoder, CommitRule)


def rule_commit(block: torch.Tensor, logits: torch.Tensor, mask_id: int, rule: CommitRule,
                state: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(commit, tokens) `[B, L]` of `rule` on a block and its logits; `state`: the rule's `new_state()`."""
    if not is_rule(rule):
        raise ValueError(f"rule must be a remask commit rule ({', '.join(t.__name__ for t in rule_types())}), got "
                         f"{type(rule).__name__}")
    _check_block(block, logits)
    return rule.commit(block, logits, mask_id, state)


def _check_block(block: torch.Tensor, logits: torch.Tensor) -> None:
    if block.dim() != 2 or logits.dim() != 3 or logits.shape[:2] != block.shape:
        raise ValueError(f"a block [B, L] and its logits [B, L, V], got {tuple(block.shape)} and {tuple(logits.shape)}")


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
    """Refuse by name what `decoder=rule` on `family`'s loop does not read: a rule setting that draws
    (`CommitRule.check_greedy`), a temperature above 0 (rules are greedy), iteration smoothing (dInfer's loop only:
    `BlockDecoder(rule=...)`) and `unread`, the replaced settings given (name → value)."""
    name = type(rule).__name__
    rule.check_greedy(family)
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


@dataclass(frozen=True)
class IterationSmoothing(Checked):
    """dInfer's iteration smoothing (`IterationSmooth`, `IterSmoothWithVicinityCache`): the model is
    fed embeddings. After each forward, every position still masked gets ``E[mask] + w ·
    softmax(logits) @ E``, every other one its plain embedding. With the iteration count n (over
    the sequence, cache-building forwards included), ``w = min(cont_weight_init +
    cont_weight_growth · n, cont_weight)`` and the threshold is ``max(1 − n · threshold_decay,
    threshold)``. Set on a decoder: ``ThresholdDecoding(smoothing=IterationSmoothing())``."""

    cont_weight: float = checked(0.3, check_real, low=0)
    cont_weight_init: float = checked(0.15, check_real, low=0)
    cont_weight_growth: float = checked(0.02, check_real, low=0)
    threshold_decay: float = checked(0.02, check_real, low=0)

    def at(self, n: int, threshold: float) -> tuple[float, float]:
        """Iteration n's (weight, threshold), for a rule of threshold `threshold` (upstream's expressions)."""
        weight = min(self.cont_weight_init + self.cont_weight_growth * n, self.cont_weight)
        return weight, max(1 - n * self.threshold_decay, threshold)

    @staticmethod
    @torch.no_grad()
    def embed(table: torch.nn.Embedding, ids: torch.Tensor, mask_id: int, logits: torch.Tensor | None = None,
              weight: float = 0.0) -> torch.Tensor:
        """Plain embeddings of `ids`; with `logits`, masked positions add `weight` times the expected
        embedding of their prediction (dInfer's H2Embed, tau 1)."""
        out = table(ids)
        if logits is None:
            return out
        expected = torch.softmax(logits, dim=-1) @ table.weight
        return torch.where((ids == mask_id).unsqueeze(-1), weight * expected + out, out)


class _DInferRule(CommitRule):
    """dInfer's decode, shared by its three rules: the rule's `_select` commits into a copy of the
    block (the logits in float32, as dInfer's decode reads them), then `_fallback`. Its `smoothing` (None, an
    `IterationSmoothing` or its fields as a dict) is checked after its fields."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.smoothing, dict):   # its fields as a dict (the JSON form)
            try:
                object.__setattr__(self, "smoothing", IterationSmoothing(**self.smoothing))
            except TypeError as e:
                raise ValueError(f"smoothing: {e}") from None
        check_instance("smoothing", self.smoothing, IterationSmoothing, "a remask.IterationSmoothing")

    def commit(self, block: torch.Tensor, logits: torch.Tensor, mask_id: int,
               state: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        _check_block(block, logits)
        proposal, before = block.clone(), block == mask_id
        logits = logits if logits.dtype == torch.float32 else logits.to(torch.float32)
        self._select(proposal, logits, before, mask_id, state)
        _fallback(proposal, before, logits, mask_id)
        return before & (proposal != mask_id), proposal


@dataclass(frozen=True)
class ThresholdDecoding(_DInferRule):
    """dInfer's `ThresholdParallelDecoder` at temperature 0.

    Per row: x0 = argmax, confidence = its float32 softmax probability; x0 = mask token is no
    candidate; every masked candidate with confidence ≥ ``min(threshold, max_confidence − 1e-5)``
    is committed. Not ``generate(threshold=)`` (Fast-dLLM's), which commits exactly the top
    position when none passes, keeps mask-token predictions and compares float64 confidences.
    """

    name = "threshold"
    threshold: float = checked(0.9, check_real, low=0, high=1, low_open=True)
    smoothing: IterationSmoothing | None = None

    def _select(self, proposal: torch.Tensor, logits: torch.Tensor, before: torch.Tensor, mask_id: int,
                state: Any) -> None:
        x0 = logits.argmax(dim=-1)
        p = F.softmax(logits.to(torch.float32), dim=-1).gather(-1, x0.unsqueeze(-1)).squeeze(-1)
        dinfer_select(proposal, x0, p, mask_id, "threshold", self.threshold)


@dataclass(frozen=True)
class CreditDecoding(_DInferRule):
    """dInfer's `CreditThresholdParallelDecoder`: the threshold rule on credit-fused logits.

    A block keeps a float32 credit C `[B, L, V]` (zeros on entering it); at every decode: C ←
    decay_beta · C (except the first), C[b, l, top1] += p_top1 ** boost_gamma on the masked
    positions (raw logits' softmax), then the threshold rule on ``logits + credit_alpha · log(1 + C)``.
    """

    name = "credit"
    threshold: float = checked(0.9, check_real, low=0, high=1, low_open=True)
    credit_alpha: float = checked(0.7, check_real, low=0)
    boost_gamma: float = checked(0.2, check_real, low=0)
    decay_beta: float = checked(0.8, check_real, low=0, high=1)
    smoothing: IterationSmoothing | None = None

    def new_state(self) -> dict[str, Any]:
        """The per-block credit: the matrix C (made at the first decode, remade when the block's shape changes) and
        the decodes counted since."""
        return {"matrix": None, "calls": 0}

    stacks_state = True

    def commit_rows(self, block: torch.Tensor, logits: torch.Tensor, mask_id: int, states: Sequence[Any],
                    sizes: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        # the requests' credits stacked: a block's first decode skips the decay of its zeros, which changes no bit
        shape = (logits.shape[1], logits.shape[2])
        credit = torch.cat([s["matrix"] if s["matrix"] is not None and s["matrix"].shape == (n, *shape)
                            else logits.new_zeros((n, *shape), dtype=torch.float32) for s, n in zip(states, sizes)])
        out = self.commit(block, logits, mask_id, {"matrix": credit, "calls": 1})
        for state, matrix in zip(states, credit.split(list(sizes))):
            state["matrix"], state["calls"] = matrix, state["calls"] + 1
        return out

    def _select(self, proposal: torch.Tensor, logits: torch.Tensor, before: torch.Tensor, mask_id: int,
                state: dict[str, Any] | None) -> None:
        if state is None:
            raise ValueError("CreditDecoding keeps a credit state over a block's steps: pass state=rule.new_state()")
        if state["matrix"] is None or state["matrix"].shape != logits.shape:
            state["matrix"], state["calls"] = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device), 0
        # update the credit and take (x0, confidence) of the credit-fused logits (one launch on GPU)
        x0, conf = credit_confidence(logits, state["matrix"], before, state["calls"] == 0, self.credit_alpha,
                                     self.boost_gamma, self.decay_beta)
        state["calls"] += 1
        dinfer_select(proposal, x0, conf, mask_id, "threshold", self.threshold)


@dataclass(frozen=True)
class HierarchicalDecoding(_DInferRule):
    """dInfer's `HierarchyDecoder` at temperature 0.

    Confidence = softmax probability of the argmax. In every maximal run of masked positions the
    most confident (all that tie) are committed if > `low_threshold`; so is every position >
    `threshold` and the single most confident masked one (first among equals). None switches a
    threshold off (as upstream). Upstream decodes one row; here each row on its own.
    """

    name = "hierarchical"
    threshold: float | None = checked(0.9, check_real, low=0, high=1, allow_none=True)
    low_threshold: float | None = checked(0.4, check_real, low=0, high=1, allow_none=True)
    smoothing: IterationSmoothing | None = None

    def __post_init__(self) -> None:
        super().__post_init__()   # its fields, then its smoothing (`_DInferRule`)
        if self.smoothing is not None and self.threshold is None:
            # upstream computes max(1 - n * decay, None) and raises a TypeError
            raise ValueError("threshold: iteration smoothing decays the threshold towards the decoder's own; "
                             "HierarchicalDecoding(threshold=None) has none")

    def _select(self, proposal: torch.Tensor, logits: torch.Tensor, before: torch.Tensor, mask_id: int,
                state: Any) -> None:
        x0 = logits.argmax(dim=-1)
        p = F.log_softmax(logits, dim=-1).gather(-1, x0.unsqueeze(-1)).squeeze(-1).exp()
        # a committed mask-token prediction leaves the position masked, as upstream
        dinfer_select(proposal, x0, p, mask_id, "hierarchy", self.threshold, self.low_threshold)


def _fallback(x_block: torch.Tensor, before: torch.Tensor, logits: torch.Tensor, mask_id: int) -> None:
    """Rows that committed nothing while masks remain (every candidate predicted the mask token:
    upstream repeats the step forever) commit their most confident masked position with its best
    non-mask token."""
    masked = x_block == mask_id
    stuck = masked.any(dim=1) & (masked == before).all(dim=1)
    if not bool(stuck.any()):
        return
    rows = stuck.nonzero().squeeze(1)
    lg = logits[rows].to(torch.float32).clone()
    lg[..., mask_id] = -math.inf
    p, tok = F.softmax(lg, dim=-1).max(dim=-1)
    p = torch.where(masked[rows], p, -math.inf)
    pos = p.argmax(dim=1)
    x_block[rows, pos] = tok[torch.arange(len(rows)), pos]

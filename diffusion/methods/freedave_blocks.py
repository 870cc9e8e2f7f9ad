"""FreeDave for block-causal models (SDAR, SDAR-MoE, LLaDA2.0, Fast-dLLM v2): the family's own greedy
one-token-per-step block loop with FreeDave's draft-and-verify (arXiv 2510.00294, upstream
`block_decode_with_block_attention_FreeDave`): a block's first forward gives the first predictions;
each round drafts K next states (draft k: the rule applied k + 1 times with the predictions held)
and forwards them at once, one row each against the shared cache (never copied: `BlockBatch`,
Fast-dLLM v2's `RowBatch`); the longest chain draft k+1 == target k (the rule on draft k's own
logits) is committed, its logits the next predictions; when the rule's next state fills the block
it is committed without a forward (upstream's last step) and the loop stores the block.

Token for token the family's loop (SDAR: ``low_confidence_static``, ``denoising_steps=block_length``;
LLaDA2.0: ``steps=block_length, threshold=1.0``); FreeDave++ (``confidence_threshold=τ``) its threshold
rule at τ (equal under ``match_rule="exact"``). Exact because each draft's forward computes what the
loop's single forward computes: GEMMs per draft (`remask.kernels.batch_invariant`), attention per row
over its cache, MoE row by row.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Generator

import torch

from .freedave import FreeDave, _verify
from ..parts.checks import check_instance
from ..parts.rules import CommitRule, rule_types
from ..parts.stats import GenerationStats
from ..parts.stepper import ForwardRequest


@dataclass(eq=False)
class Predictions:
    """What the last forward predicted for the current block `[1, L]`: tokens and confidences."""

    x0: torch.Tensor
    conf: torch.Tensor
    logits: Any = None   # under a structure: the forward's logits `[1, L, V]` (the filter's lookahead)


@dataclass(eq=False)
class Drafts:
    """A FreeDave forward's `kind`: a round's drafts `[K, L]`, or None: the block as it is."""

    drafts: torch.Tensor | None = None


class BlockFreeDave:
    """Mixin over a family's `BlockLoop`. The family supplies `_fd_loop()` (whether its steps commit one
    token, the steps' setting, whether FreeDave can draft its rule, the refusal if not) and
    `_fd_select(masked, conf)` (its selection on a `[1, L]` row with a count of 1); where it differs,
    `_fd_pending(state)` (its own prefill or store forward is due), `_fd_scores`, `_fd_committed(state)`
    (an in-block stop), `_fd_block_done(state)` and `_fd_forwards` (Fast-dLLM v2's conventions).
    `state.predictions` is None at a block's start."""

    freedave: FreeDave
    mask_id: int
    block_length: int

    def __init__(self, freedave: Any, **kwargs: Any) -> None:
        """`decoder=FreeDave` on the family's loop: greedy, one token per step, a rule FreeDave can draft,
        `draft_steps` within the block; each refusal names the setting."""
        super().__init__(**kwargs)
        check_instance("decoder", freedave, FreeDave, "a remask FreeDave config", allow_none=False)
        freedave.check_request(block_length=self.block_length)
        family, (one_per_step, steps_name, rule_ok, rule) = self.family, self._fd_loop()
        if self.temperature != 0:
            raise ValueError(f"temperature: {family}'s loop with decoder=FreeDave decodes greedily (temperature 0), "
                             f"got {self.temperature}")
        if not one_per_step:
            raise ValueError(f"{steps_name}: {family}'s loop with decoder=FreeDave commits one token per step "
                             f"({steps_name} == block_length)")
        if not rule_ok:
            raise ValueError(f"{rule} with decoder=FreeDave")
        if freedave.confidence_threshold is not None:
            raise ValueError(f"confidence_threshold: on {family}'s loop FreeDave drafts the loop's own rule; set its "
                             f"threshold there, not in FreeDave")
        self.freedave = freedave

    def _forward(self, state: Any) -> Generator[ForwardRequest, Any, tuple[torch.Tensor | None, Any]]:
        """The step's forward: the family's own, the block's first (the block as it is), or a round's drafts."""
        if self._fd_pending(state):
            state.predictions = None
            return (yield from super()._forward(state))   # type: ignore[misc]
        start, end = self._span(state)
        block = state.x[:, start:end]
        if state.predictions is None:   # the block's first forward: the block as it is
            return (yield from self._fd_forwards(state, block)), Drafts()
        pred = state.predictions
        K = min(self.freedave.draft_steps, int((block == self.mask_id).sum()))
        # draft k: the rule applied k + 1 times with these predictions (draft 0 is the next state)
        drafts = [self._fd_rule(block, pred.x0, pred.conf)]
        for _ in range(K - 1):
            drafts.append(self._fd_rule(drafts[-1], pred.x0, pred.conf))
        drafts = torch.cat(drafts)    # [K, L]
        return (yield from self._fd_forwards(state, drafts)), Drafts(drafts)

    def commit(self, state: Any, logits: torch.Tensor | None, kind: Any, generator: torch.Generator | None = None,
               stats: GenerationStats | None = None) -> None:
        if not isinstance(kind, Drafts):   # the family's own forward
            super().commit(state, logits, kind, generator, stats)   # type: ignore[misc]
            return
        start, end = self._span(state)
        block = state.x[:, start:end]   # a view: commits write into x
        constraint = getattr(state, "constraint", None)
        if constraint is not None:   # structured output: every draft's frontier row masked before the rule
            from ..parts.constrain_loops import mask_frontier_rows

            logits = mask_frontier_rows(constraint, logits, start, end)
        if kind.drafts is None:
            self._count(stats, 1, state)
            x0, conf = self._fd_scores(logits)
            state.predictions = Predictions(x0, conf, logits if constraint is not None else None)
        else:
            prior = block.clone()
            self._verify(state, block, kind.drafts, logits, stats)
            if constraint is not None:
                self._fd_filter(state, constraint, prior, start, end)
            self._fd_committed(state)
            if state.done:
                return
        # the rule's next state fills the block: committed from the predictions (no forward)
        nxt = self._fd_rule(block, state.predictions.x0, state.predictions.conf)
        if not bool((nxt == self.mask_id).any()):
            before = int((block == self.mask_id).sum())
            prior = block.clone()
            block.copy_(nxt)
            if stats is not None:
                stats.step(before)
            if constraint is not None:
                self._fd_filter(state, constraint, prior, start, end)
            full = not bool((block == self.mask_id).any())   # else a structure's filter took tokens back: more rounds
            if full:
                state.predictions = None
            self._fd_committed(state)
            if full and not state.done:
                self._fd_block_done(state)

    def _fd_pending(self, state: Any) -> bool:   # the `StoreKVLoop`'s prefill or store
        return not state.stored or self._block_full(state)

    def _fd_scores(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from ..families.sdar import sample_block

        return sample_block(logits, 0.0, self.top_k, self.top_p, None, self.mask_id)[:2]

    def _fd_committed(self, state: Any) -> None:
        """After a commit: the family's in-block stop, if it has one (sets `state.done`)."""

    def _fd_block_done(self, state: Any) -> None:
        """After the block is full (default: the loop's next step stores it and moves on)."""

    def _fd_filter(self, state: Any, constraint: Any, prior: torch.Tensor, start: int, end: int) -> None:
        """Structured output: the block as the round left it, filtered (the predictions: the lookahead)."""
        from ..parts.constrain_loops import filter_block

        pred = state.predictions
        filter_block(constraint, state.x, prior, pred.x0, pred.logits, start, end)

    def _verify(self, state: Any, block: torch.Tensor, drafts: torch.Tensor, logits: torch.Tensor,
                stats: GenerationStats | None) -> None:
        """Each draft's target from its own logits; the longest verified chain committed, its logits
        the next predictions."""
        K = drafts.shape[0]
        masks = int((block == self.mask_id).sum())
        self._count(stats, K, state)
        dx0, dconf = self._fd_scores(logits)
        targets = self._fd_rule(drafts, dx0, dconf)
        best = int(_verify(drafts[None], targets[None], torch.tensor([K], device=block.device), self.mask_id,
                           self.freedave.match_rule)[0])
        block.copy_(drafts[best:best + 1])
        lookahead = logits[best:best + 1] if getattr(state, "constraint", None) is not None else None
        state.predictions = Predictions(dx0[best:best + 1], dconf[best:best + 1], lookahead)
        if stats is not None:
            stats.step(masks - int((block == self.mask_id).sum()))

    def _fd_rule(self, tokens: torch.Tensor, x0: torch.Tensor, conf: torch.Tensor) -> torch.Tensor:
        """The loop's commit on each row of `tokens` `[N, L]` with a count of 1 (its `_fd_select`)."""
        out = tokens.clone()
        for n in range(out.shape[0]):
            row = out[n:n + 1]
            transfer = self._fd_select(row == self.mask_id, conf[n:n + 1])
            row[transfer] = x0[n:n + 1][transfer]
        return out

    def _fd_forwards(self, state: Any, blocks: torch.Tensor) -> Generator[ForwardRequest, Any, torch.Tensor]:
        """Logits `[K, L, V]` of K versions of the current block for the `store_kv` models (SDAR,
        LLaDA2): without the cache the sequence up to the block under `state.attention`; with it one
        row each reading the one cache (`sdar.block_request`), each row's linears as alone."""
        from ..families.sdar import block_request

        K, L = blocks.shape
        start, end = self._span(state)
        if not self.use_cache:
            seqs = state.x[:, :end].repeat(K, 1)
            seqs[:, start:end] = blocks
            mask = state.attention[..., :end, :end]
            logits = yield ForwardRequest.call(seqs, dict(attention_mask=mask.expand(K, *mask.shape[1:]),
                                                          position_ids=state.position_ids[:, :end].expand(K, -1)),
                                               rows_alone=True)
            return logits[:, -L:]
        return (yield block_request(blocks, state.position_ids[:, start:end], state.cache, False))


def split_freedave(decoder: Any, rules: bool) -> tuple[FreeDave, float | None]:
    """An engine request's `decoder=FreeDave` sets the loop's rule: (the FreeDave without its
    `confidence_threshold`, that threshold; None: one token per step). `rules`: the family also
    takes dInfer's rules (named in the refusal)."""
    check_instance("decoder", decoder, FreeDave, "remask.FreeDave, ThresholdDecoding, CreditDecoding or "
                   "HierarchicalDecoding (the decoders block-causal models take)" if rules else
                   "remask.FreeDave (the decoder block-causal models take)")
    return replace(decoder, confidence_threshold=None), decoder.confidence_threshold


def check_block_decoder(decoder: Any) -> None:
    """`decoder=` on a block-causal family's drop-in function: FreeDave or one of dInfer's rules."""
    check_instance("decoder", decoder, (FreeDave, CommitRule), "remask.FreeDave or a commit rule ("
                   + ", ".join(t.__name__ for t in rule_types()) + ": the decoders block-causal models take)")

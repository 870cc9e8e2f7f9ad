"""FreeDave's draft-and-verify (arXiv 2510.00294), written once for both its users: a round's core over N rows of a
block (`Predictions` held from the last forward, `verify_drafts`: the longest verified chain and the accepted draft's
predictions held) serves `methods/freedave.py`'s batched decoder (LLaDA, Dream) and `DraftVerify` below, each
supplying its drafts, forwards, scoring and rule (`draft_chain`: the family's rule applied k times, `DraftVerify`'s;
the batched decoder drafts its one-token step by one sort, `freedave.make_drafts`, at an eighth of the CPU time).

Draft-and-verify as a block loop's commit part (FreeDave on SDAR, SDAR-MoE, LLaDA2.0, Fast-dLLM v2): the
family's own greedy one-token-per-step block loop with FreeDave's draft-and-verify (arXiv 2510.00294, upstream
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

from dataclasses import dataclass
from typing import Any, Callable, Generator

import torch

from .checks import Checked
from .constrain import before_rule
from .constrain_loops import filter_block
from .stats import GenerationStats
from .stepper import ForwardRequest


class DraftConfig(Checked):
    """The base of a draft-and-verify method's config (`remask.FreeDave`): `draft_steps`, `match_rule`,
    `confidence_threshold` and `check_request(block_length=...)`; a block loop given one drafts with `DraftVerify`."""


@dataclass(eq=False)
class Predictions:
    """What a forward predicted for N rows of a block `[N, L]`: tokens and confidences (the predictions a round's
    drafts are made from: FreeDave's, `freedave._Decoder` and `DraftVerify` alike)."""

    x0: torch.Tensor
    conf: torch.Tensor
    logits: Any = None   # under a structure: the forward's logits `[N, L, V]` (the filter's lookahead)

    def rows(self, index: torch.Tensor) -> "Predictions":
        """The predictions of rows `index`."""
        return Predictions(self.x0[index], self.conf[index], None if self.logits is None else self.logits[index])

    def hold(self, rows: torch.Tensor, new: "Predictions") -> None:
        """Rows `rows` hold `new` (one row each) from now on."""
        self.x0[rows], self.conf[rows] = new.x0, new.conf
        if self.logits is not None:
            self.logits[rows] = new.logits


def draft_chain(first: torch.Tensor, pred: Predictions, rule: Callable[[torch.Tensor, Predictions], torch.Tensor],
                K: int) -> torch.Tensor:
    """A round's drafts `[N, K, L]` for N rows of a block: draft 0 `first`, draft k + 1 `rule` applied to draft k
    with the predictions held, `pred` (a row's chain stops changing once its block is full)."""
    drafts = [first]
    for _ in range(K - 1):
        drafts.append(rule(drafts[-1], pred))
    return torch.stack(drafts, dim=1)


def verify_drafts(drafts: torch.Tensor, new: Predictions, targets: torch.Tensor, counts: torch.Tensor, mask_id: int,
                  rule: str) -> tuple[torch.Tensor, Predictions]:
    """A round's verdict on the drafts `[A, K, L]` (`counts` `[A]` of them real per row) from what their forward
    predicted, `new` (`A·K` rows, K per row), and their targets `[A·K, L]` (the rule on each draft with its own
    predictions): each row's accepted draft, the end of its longest chain, as an index into the `A·K` rows, and its
    predictions (the next round's: no forward spent twice). Upstream's chain: from best = 0, repeatedly move to the
    largest j > best (j < counts[a]) whose draft agrees with target[best] (``"subset"``: every decoded position of
    the draft equals the target there; ``"exact"``: equal) until nothing moves."""
    A, K, L = drafts.shape
    best = torch.zeros(A, dtype=torch.long, device=drafts.device)          # (one draft: no move)
    same = drafts[:, None, :, :] == targets.view(A, K, L)[:, :, None, :]   # [A, i, j, L]
    if rule == "subset":
        same = same | (drafts[:, None, :, :] == mask_id)
    agree = same.all(dim=-1)                                               # agree[a, i, j]
    j = torch.arange(K, device=drafts.device)
    agree &= (j[None, :, None] < j[None, None, :]) & (j[None, None, :] < counts[:, None, None])
    for _ in range(K - 1):
        row = agree.gather(1, best.view(A, 1, 1).expand(A, 1, K)).squeeze(1)
        cand = torch.where(row, j.expand(A, K), -1).max(dim=1).values
        best = torch.maximum(best, cand)
    pick = torch.arange(A, device=drafts.device) * K + best
    return pick, new.rows(pick)


class DraftVerify:
    """A block loop's commit part (`BlockLoop.drafts`). The loop supplies `_fd_loop()` (whether its steps commit
    one token, the steps' setting, whether FreeDave can draft its rule, the refusal if not), `_select(masked,
    conf, 1)` (its selection on a `[1, L]` row with a count of 1), `_fd_pending(state)` (its own prefill or store
    forward is due), `_sample` (its sampler: greedy here), `_fd_forwards`, `_fd_committed(state)` (an in-block stop) and
    `_fd_block_done(state)`. `state.predictions` is None at a block's start."""

    def __init__(self, loop: Any, config: Any) -> None:
        """`decoder=FreeDave` on the family's loop: greedy, one token per step, a rule FreeDave can draft,
        `draft_steps` within the block; each refusal names the setting."""
        config.check_request(block_length=loop.block_length)
        family, (one_per_step, steps_name, rule_ok, rule) = loop.family, loop._fd_loop()
        if loop.temperature != 0:
            raise ValueError(f"temperature: {family}'s loop with decoder=FreeDave decodes greedily (temperature 0), "
                             f"got {loop.temperature}")
        if not one_per_step:
            raise ValueError(f"{steps_name}: {family}'s loop with decoder=FreeDave commits one token per step "
                             f"({steps_name} == block_length)")
        if not rule_ok:
            raise ValueError(f"{rule} with decoder=FreeDave")
        if config.confidence_threshold is not None:
            raise ValueError(f"confidence_threshold: on {family}'s loop FreeDave drafts the loop's own rule; set its "
                             f"threshold there, not in FreeDave")
        self.loop, self.config, self.mask_id = loop, config, loop.mask_id

    def forward(self, state: Any) -> Generator[ForwardRequest, Any, tuple[torch.Tensor | None, Any]]:
        """The step's forward: the block's first (the block as it is), or a round's drafts."""
        start, end = self.loop._span(state)
        block = state.x[:, start:end]
        if state.predictions is None:   # the block's first forward: the block as it is
            return (yield from self.loop._fd_forwards(state, block)), None
        K = min(self.config.draft_steps, int((block == self.mask_id).sum()))
        # draft k: the rule applied k + 1 times with these predictions (draft 0 is the next state)
        drafts = draft_chain(self.rule(block, state.predictions), state.predictions, self.rule, K)[0]    # [K, L]
        return (yield from self.loop._fd_forwards(state, drafts)), drafts

    def commit(self, state: Any, logits: torch.Tensor, drafts: torch.Tensor | None,
               stats: GenerationStats | None = None) -> None:
        """The forward's predictions held (the block's first), or the round verified: each draft's target from its
        own logits, the longest verified chain committed, its logits the next predictions."""
        loop = self.loop
        start, end = loop._span(state)
        block = state.x[:, start:end]   # a view: commits write into x
        # structured output: every draft's frontier row masked before the rule (each a version of row 0's window)
        rows = None if state.constraint is None else state.constraint.rows([0] * logits.shape[0])
        logits, _ = before_rule(rows, logits, block, start, end, 0)
        if stats is not None:   # K versions of the block (without a cache: each the sequence to its end)
            stats.forward(logits.shape[0], loop.block_length if loop.use_cache else end)
        new = Predictions(*loop._sample(logits, 0.0, None)[:2], logits if rows is not None else None)
        if drafts is None:
            state.predictions = new
        else:
            count = torch.tensor([len(drafts)], device=block.device)
            pick, state.predictions = verify_drafts(drafts[None], new, self.rule(drafts, new), count,
                                                    self.mask_id, self.config.match_rule)
            self._write(state, block, drafts[pick], stats)
            loop._fd_committed(state)
            if state.done:
                return
        # the rule's next state fills the block: committed from the predictions (no forward)
        nxt = self.rule(block, state.predictions)
        if not bool((nxt == self.mask_id).any()):
            self._write(state, block, nxt, stats)
            full = not bool((block == self.mask_id).any())   # else a structure's filter took tokens back: more rounds
            if full:
                state.predictions = None
            loop._fd_committed(state)
            if full and not state.done:
                loop._fd_block_done(state)

    def _write(self, state: Any, block: torch.Tensor, tokens: torch.Tensor, stats: GenerationStats | None) -> None:
        """Commit `tokens` to the block (a view of `state.x`); under a structure the block as it left it filtered
        (the predictions: the lookahead)."""
        prior, masks = block.clone(), int((block == self.mask_id).sum())
        block.copy_(tokens)
        if stats is not None:
            stats.step(masks - int((block == self.mask_id).sum()))
        if state.constraint is not None:
            filter_block(state.constraint, state.x, prior, state.predictions.x0, state.predictions.logits,
                         *self.loop._span(state))

    def rule(self, tokens: torch.Tensor, pred: Predictions) -> torch.Tensor:
        """The loop's commit on each row of `tokens` `[N, L]` with a count of 1 (its `_select`) from its
        predictions (`pred`'s row)."""
        out = tokens.clone()
        for row, conf, x0 in zip(out.split(1), pred.conf.split(1), pred.x0.split(1)):
            transfer = self.loop._select(row == self.mask_id, conf, 1)
            row[transfer] = x0[transfer]
        return out

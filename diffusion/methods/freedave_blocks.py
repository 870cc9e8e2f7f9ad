"""FreeDave for block-causal models (SDAR, SDAR-MoE, LLaDA2.0, Fast-dLLM v2): the family's own block
loop at one token per step, with fewer forwards.

A block-causal family decodes block after block against the cache of the finished ones (its decoder
in `diffusion/families/sdar.py` / `diffusion/families/llada2.py`). Its one-token-per-step greedy loop forwards the
current block, commits the most confident masked position (the family's own rule, count 1), and
repeats until the block is full, then stores the block. `BlockFreeDave` runs that loop with
FreeDave's draft-and-verify (arXiv 2510.00294, upstream `block_decode_with_block_attention_FreeDave`):

* block start: one forward of the block as it is — its logits are the first predictions;
* each round: draft k = the rule applied k + 1 times with the predictions held (draft 0 is exactly
  the next state; for a one-token rule, the k + 1 most confident predictions); all K drafts are forwarded at once against the shared cache
  (one row each, the cache read by every row, never copied: `remask.caches.BlockBatch`, Fast-dLLM
  v2's `RowBatch`); each
  draft's own logits give its target (the rule applied to it); the longest chain draft k+1 ==
  target k is committed and its logits are the next round's predictions (no forward spent twice);
* when the rule's next state fills the block it is committed without a forward (upstream's last
  step), and the family's loop stores the block and moves on.

Token for token the family's loop with `temperature=0` and one token per step (SDAR:
``remasking_strategy="low_confidence_static", denoising_steps=block_length``; LLaDA2.0:
``steps=block_length, threshold=1.0``). FreeDave++ (``confidence_threshold=τ``) follows the threshold
rule instead (SDAR: ``low_confidence_dynamic`` with ``confidence_threshold=τ``; LLaDA2.0:
``threshold=τ``; equal under ``match_rule="exact"``). Exact because each draft's forward computes
what the loop's single forward computes for that state: GEMMs per draft (the batched GEMM of
`remask.engine.batch_invariant`), attention per row over the row's cache, MoE layers row by row.

No forward is computed here: each step's forward is a `ForwardRequest` (`_forward`, a sub-generator:
the family's own — prefill, store — or FreeDave's, `_fd_forwards`) and `commit` takes its logits
(`stepper.ForwardThenCommit`): the drop-in loops answer it alone (`stepper.drive`), the engine
stacks it with the other requests' block forwards of the step into one call (each request's rows
against its own cache: the request's cache argument is a `BlockBatch` / `RowBatch` of its rows).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generator

import torch

from .freedave import FreeDave, _verify
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
    """Which FreeDave forward a step ran (its `kind`): the block as it is (`drafts` None: the first
    predictions) or a round's drafts `[K, L]`."""

    drafts: torch.Tensor | None = None


class BlockFreeDave:
    """Mixin over a block-causal decoder (`SDARDecoder`, `LLaDA2Decoder`, `FastDLLMV2Decoder`: a
    `BlockLoop`, its step a `_forward` and a `commit`). The family supplies `_fd_pending(state)` (a
    prefill or store forward is due: its own forward and commit run), `_fd_scores(logits)` (greedy
    tokens and confidences `[N, L]`), `_fd_select(masked, conf)` (its selection on one `[1, L]` row
    with a count of 1; or a whole `_fd_rule`) and `_fd_block_done(state)` (after the block is full);
    `_fd_committed(state)` optionally (an in-block stop), `_fd_forwards` where its model takes other
    conventions (Fast-dLLM v2). The state carries `predictions` (None at a block's start)."""

    freedave: FreeDave
    mask_id: int
    block_length: int

    def _span(self, state: Any) -> tuple[int, int]:
        return state.block * self.block_length, (state.block + 1) * self.block_length

    def _forward(self, state: Any) -> Generator[ForwardRequest, Any, tuple[torch.Tensor | None, Any]]:
        """The step's forward: the family's own (`_fd_pending`), the block's first (the block as it
        is), or a round's K drafts of the next states, all in one forward."""
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
                if bool((block == self.mask_id).any()):   # the filter took tokens back: more rounds
                    self._fd_committed(state)
                    return
            state.predictions = None
            self._fd_committed(state)
            if not state.done:
                self._fd_block_done(state)

    def _fd_committed(self, state: Any) -> None:
        """After a commit: the family's in-block stop, if it has one (sets `state.done`)."""

    def _fd_filter(self, state: Any, constraint: Any, prior: torch.Tensor, start: int, end: int) -> None:
        """Structured output: the block as the round left it, filtered (`parts/constrain_loops.py`)
        with the predictions' tokens and logits as the lookahead."""
        from ..parts.constrain_loops import filter_block

        pred = state.predictions
        filter_block(constraint, state.x, prior, pred.x0, pred.logits, start, end)

    def _count(self, stats: GenerationStats | None, rows: int, state: Any) -> None:
        if stats is not None:
            stats.forward(rows, self.block_length if self.use_cache else self._span(state)[1])

    def _verify(self, state: Any, block: torch.Tensor, drafts: torch.Tensor, logits: torch.Tensor,
                stats: GenerationStats | None) -> None:
        """A round's verification: each draft's target from its own logits, the longest verified
        chain committed, its logits the next predictions."""
        K = drafts.shape[0]
        masks = int((block == self.mask_id).sum())
        self._count(stats, K, state)
        dx0, dconf = self._fd_scores(logits)
        targets = self._fd_rule(drafts, dx0, dconf)
        best = int(_verify(drafts[None], targets[None], torch.tensor([K], device=block.device), self.mask_id,
                           self.freedave.match_rule)[0])
        block.copy_(drafts[best:best + 1])
        state.predictions = Predictions(dx0[best:best + 1], dconf[best:best + 1],
                                        logits[best:best + 1] if getattr(state, "constraint", None) is not None else None)
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
        """Logits `[K, L, V]` of K versions of the current block, as a sub-generator (``logits =
        yield from ...``) of one `ForwardRequest`, for models taking remask's block-causal
        conventions (`store_kv`, `BlockBatch`; SDAR, LLaDA2): without the cache, the sequence up to
        the block under `state.attention`; with it, the loop's own block forward for each version,
        one row each reading the one cache (`sdar.block_request`). Several drafts ask for each
        row's linears as alone (`rows_alone`)."""
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


def check_freedave_loop(freedave: Any, family: str, *, temperature: float, one_per_step: bool, steps_name: str,
                        rule_ok: bool, rule: str, block_length: int) -> None:
    """`decoder=FreeDave` on a block-causal family's loop: greedy, one token per step, a rule FreeDave
    can draft, `draft_steps` within the family's block (each refusal names the setting)."""
    from ..parts.checks import check_instance

    check_instance("decoder", freedave, FreeDave, "a remask FreeDave config", allow_none=False)
    freedave.check_request(block_length=block_length)
    if temperature != 0:
        raise ValueError(f"temperature: {family}'s loop with decoder=FreeDave decodes greedily (temperature 0), "
                         f"got {temperature}")
    if not one_per_step:
        raise ValueError(f"{steps_name}: {family}'s loop with decoder=FreeDave commits one token per step "
                         f"({steps_name} == block_length)")
    if not rule_ok:
        raise ValueError(f"{rule} with decoder=FreeDave")
    if freedave.confidence_threshold is not None:
        raise ValueError(f"confidence_threshold: on {family}'s loop FreeDave drafts the loop's own rule; set its "
                         f"threshold there, not in FreeDave")

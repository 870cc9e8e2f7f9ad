"""FreeDave for block-causal models (SDAR, SDAR-MoE, LLaDA2.0, Fast-dLLM v2): the family's own block
loop at one token per step, with fewer forwards.

A block-causal family decodes block after block against the cache of the finished ones (its decoder
in `diffusion/sdar.py` / `diffusion/llada2.py`). Its one-token-per-step greedy loop forwards the
current block, commits the most confident masked position (the family's own rule, count 1), and
repeats until the block is full, then stores the block. `BlockFreeDave` runs that loop with
FreeDave's draft-and-verify (arXiv 2510.00294, upstream `block_decode_with_block_attention_FreeDave`):

* block start: one forward of the block as it is — its logits are the first predictions;
* each round: draft k = the rule applied k + 1 times with the predictions held (draft 0 is exactly
  the next state; for a one-token rule, the k + 1 most confident predictions); all K drafts are forwarded at once against the shared cache
  (one row each, the cache read by every row, never copied: `remask.caches.BlockBatch`); each
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

No forward is computed here: FreeDave's forwards are `ForwardRequest`s (`_fd_forwards`, a
sub-generator) answered by `stepper.drive` inside the family's step (its loop is a step method whose
own forwards — prefill, store — are its file's). They carry the request's own cache (or a
`BlockBatch` over it), so the engine runs each request's drafts in their own model call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generator

import torch

from .freedave import FreeDave, _per_sequence, _verify
from .stats import GenerationStats
from .stepper import ForwardRequest, drive


@dataclass(eq=False)
class Predictions:
    """What the last forward predicted for the current block `[1, L]`: tokens and confidences."""

    x0: torch.Tensor
    conf: torch.Tensor


class BlockFreeDave:
    """Mixin over a block-causal decoder (`SDARDecoder`, `LLaDA2Decoder`, `FastDLLMV2Decoder`). The
    family supplies `_fd_pending(state)` (a prefill or store forward, or the next block, is due: its
    own step runs), `_fd_scores(logits)` (greedy tokens and confidences `[N, L]`), `_fd_select(masked,
    conf)` (its selection on one `[1, L]` row with a count of 1; or a whole `_fd_rule`),
    `_fd_cached_mask(state)` (the mask of its own cached block forward; or a whole `_fd_forward`)
    and `_fd_block_done(state)` (after the block is full); `_fd_committed(state)` optionally (an
    in-block stop). The state carries `predictions` (None at a block's start)."""

    freedave: FreeDave
    mask_id: int
    block_length: int

    def shared_forward_key(self, state: Any) -> None:
        return None   # each request runs its own draft forwards

    def _span(self, state: Any) -> tuple[int, int]:
        return state.block * self.block_length, (state.block + 1) * self.block_length

    def step(self, model: torch.nn.Module, state: Any, generator: torch.Generator | None = None,
             stats: GenerationStats | None = None) -> None:
        if state.done:
            return
        if self._fd_pending(state):
            state.predictions = None
            super().step(model, state, generator, stats)   # type: ignore[misc]
            return
        start, end = self._span(state)
        block = state.x[:, start:end]   # a view: commits write into x
        if state.predictions is None:   # the block's first forward: the block as it is
            logits = self._fd_forward(model, state, block)
            self._count(stats, 1, state)
            x0, conf = self._fd_scores(logits)
            state.predictions = Predictions(x0, conf)
        else:
            self._round(model, state, block, stats)
            self._fd_committed(state)
            if state.done:
                return
        # the rule's next state fills the block: committed from the predictions (no forward)
        nxt = self._fd_rule(block, state.predictions.x0, state.predictions.conf)
        if not bool((nxt == self.mask_id).any()):
            before = int((block == self.mask_id).sum())
            block.copy_(nxt)
            if stats is not None:
                stats.step(before)
            state.predictions = None
            self._fd_committed(state)
            if not state.done:
                self._fd_block_done(state)

    def _fd_committed(self, state: Any) -> None:
        """After a commit: the family's in-block stop, if it has one (sets `state.done`)."""

    def _count(self, stats: GenerationStats | None, rows: int, state: Any) -> None:
        if stats is not None:
            stats.forward(rows, self.block_length if self.use_cache else self._span(state)[1])

    def _round(self, model: torch.nn.Module, state: Any, block: torch.Tensor, stats: GenerationStats | None) -> None:
        """One verification forward: drafts of the next states, the longest verified chain committed."""
        pred = state.predictions
        masks = int((block == self.mask_id).sum())
        K = min(self.freedave.draft_steps, masks)
        # draft k: the rule applied k + 1 times with these predictions (draft 0 is the next state)
        drafts = [self._fd_rule(block, pred.x0, pred.conf)]
        for _ in range(K - 1):
            drafts.append(self._fd_rule(drafts[-1], pred.x0, pred.conf))
        drafts = torch.cat(drafts)    # [K, L]
        logits = self._fd_forward(model, state, drafts)
        self._count(stats, K, state)
        dx0, dconf = self._fd_scores(logits)
        targets = self._fd_rule(drafts, dx0, dconf)
        best = int(_verify(drafts[None], targets[None], torch.tensor([K], device=block.device), self.mask_id,
                           self.freedave.match_rule)[0])
        block.copy_(drafts[best:best + 1])
        state.predictions = Predictions(dx0[best:best + 1], dconf[best:best + 1])
        if stats is not None:
            stats.step(masks - int((block == self.mask_id).sum()))

    def _per_draft(self, rows: int, length: int):
        """Each draft's GEMMs as the problem it poses alone (`[length, K]`)."""
        return _per_sequence(length, enabled=rows > 1)

    def _fd_rule(self, tokens: torch.Tensor, x0: torch.Tensor, conf: torch.Tensor) -> torch.Tensor:
        """The loop's commit on each row of `tokens` `[N, L]` with a count of 1 (its `_fd_select`)."""
        out = tokens.clone()
        for n in range(out.shape[0]):
            row = out[n:n + 1]
            transfer = self._fd_select(row == self.mask_id, conf[n:n + 1])
            row[transfer] = x0[n:n + 1][transfer]
        return out

    def _fd_forward(self, model: torch.nn.Module, state: Any, blocks: torch.Tensor) -> torch.Tensor:
        """Logits `[K, L, V]` of K versions of the current block: `_fd_forwards`' request answered
        alone (`stepper.drive`). A family whose model takes other conventions overrides this
        (Fast-dLLM v2) or `_fd_forwards`."""
        return drive(self._fd_forwards(state, blocks), model)

    def _fd_forwards(self, state: Any, blocks: torch.Tensor) -> Generator[ForwardRequest, Any, torch.Tensor]:
        """`_fd_forward` as a sub-generator (``logits = yield from ...``): one `ForwardRequest`, for
        models taking remask's block-causal conventions (`store_kv`, `BlockBatch`; SDAR, LLaDA2):
        without the cache, the sequence up to the block under `state.attention`; with it, the loop's
        own forward for one version (`_fd_cached_mask`), else one row per version reading the same
        cache. Several drafts ask for each row's linears as alone (`rows_alone`: the batched GEMM of
        `_per_draft`). The request carries the request's own cache (a `DynamicCache` / paged
        `BlockKVCache`, or a `BlockBatch` over it): it does not pack with other requests'."""
        from remask.caches.block import BlockBatch

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
        positions = state.position_ids[:, start:end]
        if K == 1:
            return (yield ForwardRequest.call(blocks, dict(attention_mask=self._fd_cached_mask(state),
                                                           position_ids=positions),
                                              cache=state.cache, use_cache=True, store_kv=False))
        return (yield ForwardRequest.call(blocks, dict(attention_mask=None, position_ids=positions.expand(K, -1)),
                                          cache=BlockBatch([state.cache] * K, [False] * K), rows_alone=True,
                                          use_cache=True, store_kv=False))


def check_freedave_loop(freedave: Any, family: str, *, temperature: float, one_per_step: bool, steps_name: str,
                        rule_ok: bool, rule: str, block_length: int) -> None:
    """`decoder=FreeDave` on a block-causal family's loop: greedy, one token per step, a rule FreeDave
    can draft, `draft_steps` within the family's block (each refusal names the setting)."""
    from .checks import check_instance

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

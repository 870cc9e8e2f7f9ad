"""FreeDave: lossless parallel decoding by free draft-and-verification (arXiv 2510.00294).

One-token-per-step greedy decoding commits, at every step, the single most confident masked
position of the current block. FreeDave runs the same decoding with fewer model forwards: from the
predictions it already holds for the current state it drafts the next K states a one-token step
could reach (draft k = the state plus the k+1 most confident predictions, cumulative), runs the
model once over all K drafts, applies the one-token rule to each draft with its own logits
(target k), and keeps the longest chain in which each draft is the target of the one before
(draft k+1 == target k). The last draft of that chain is committed and its logits are the
predictions of the next round, so no forward is spent twice. Draft 0 is exactly the next state
(the rule applied to exact logits), so every round advances at least one token, and the committed
sequence is the one-token-per-step sequence, token for token.

Baselines (what `freedave_generate` equals, token for token, with the same cache schedule):

* LLaDA-format models (unshifted logits): ``remask.generate(model, prompt, steps=gen_length,
  gen_length=..., block_length=..., use_cache=...)`` — LLaDA's low-confidence remasking with one
  commit per step. With ``confidence_threshold=τ`` and ``match_rule="exact"``:
  ``remask.generate(..., threshold=τ)`` (Fast-dLLM's threshold rule).
* Dream (logits shifted by one position): Fast-dLLM's Dream block decoder, which commits each
  block's first position from the block-start forward and then one token per step:
  ``remask.diffusion_generate(model, prompt, max_new_tokens=gen_length, steps=gen_length,
  alg="confidence_threshold", threshold=1.0, block_length=..., use_cache=...)`` (a threshold of 1.0
  commits only the most confident position unless another one's probability rounds to exactly 1.0,
  where the two rules could part); with ``confidence_threshold=τ``, ``match_rule="exact"``: the same
  call with ``threshold=τ``. This is FreeDave's own Dream convention (`block_decode_with_full_attention`).

Cache schedule (as the baselines): every block starts with a full forward (``use_cache`` "prefix"
/ "dual": it builds the cache) whose logits are the first predictions; the verification forwards
of the block run against that cache: ``"prefix"`` feeds each draft's block and everything after
it, ``"dual"`` only the draft's block, None a full sequence per draft.

Draft modes (one model call per verification either way):

* ``"batch_expanding"``: the drafts are K rows of a batch; the cache is copied along the batch.
* ``"tree_attention"`` (upstream's name: drafts along one sequence under a tree mask): the drafts
  are K rows of a batch too, but the cache is shared, never copied: each draft's queries attend to
  the cached prefix / suffix and to their own draft only (`_TreeCache`). Each draft is computed
  as alone either way, so the layout changes no bit.

No forward is computed here: the loop is a step generator (`diffusion/parts/stepper.py`) that yields a
`ForwardRequest` for each forward (the block start through `BlockForward.refresh`). A verification
forward is a plain request (`rows_alone`, the block's cache copied or shared): the engine packs the
forwards of its FreeDave requests into one model call per step.

Exactness: a draft must get the bits the baseline's single-sequence forward gives its state. GEMMs
are therefore run per draft (`remask.engine.batch_invariant`'s batched GEMM: each draft the
problem it poses alone: the request's `rows_alone`, answered by `batch_invariant_linear` in the
drop-in driver and by the engine's batch invariance), and the shared cache is not a masked
attention over all drafts' keys (an online softmax over a longer, partly masked key list rounds
differently): each draft's queries are attended, in one batched SDPA call, against exactly the key
list the baseline attends — [prefix | own draft | suffix] — gathered per layer from the shared
cache (transient, one layer at a time; the cache itself is never copied).

FreeDave++ (``confidence_threshold=τ``): draft 0 is the threshold rule's next state, later drafts
add the most confident remaining predictions one at a time, targets apply the threshold rule.
Upstream verifies with its ``"subset"`` rule (a draft is accepted when its tokens are a subset of
the target's), which is not lossless w.r.t. threshold decoding (a draft may commit fewer tokens than
the threshold step would); ``match_rule="exact"`` accepts only drafts equal to the target and is
lossless. Without a threshold both rules accept the same drafts.

Greedy only (temperature 0). Batches of any size: each row keeps its own chain length.

Structured output (`structure=`, `diffusion/parts/constrain.py`): the one-token step becomes the
constrained step F — the state's frontier masked before scoring, the rule's commit, the commit
filter (its matcher a clone per draft) — and a state carries its matcher (the start state advanced
over its contiguous committed run: `CommitFilter.sync`). Draft 0 is F of the state, drafts k ≥ 1
guesses as before; target k is F of draft k with draft k's own logits; the chain rule is unchanged.
So every accepted draft is a state of the constrained one-token decoding, and FreeDave stays exact
w.r.t. it: `remask.generate(..., steps=gen_length, structured_outputs=...)` (LLaDA; the same cache
schedule), token for token (tested). Dream's baseline is the constrained block decoder at
`threshold=1.0` (its block-start commit filtered too). docs/quirks.md has the departure.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generator

import torch

from remask.caches import KVCache
from remask.caches.kv import attention
from remask.kernels import unmask
from remask.models.spec import ModelSpec, get_spec

from ..parts.cache import BlockForward, cache_mode, valid_positions
from ..parts.checks import (check_choice, check_config_bounds, check_instance, check_int, check_length, check_mask_id,
                     check_model_kind, check_prompt, check_real, check_stats, warn_if_longer_than_trained,
                     warn_if_padded_without_mask)
from ..families.llada import validate_block_args
from ..parts.scoring import score_rows
from remask.models.parallel import full_logits

from ..parts.stats import GenerationStats
from ..parts.stepper import ForwardRequest, Progress, StepGenerator, drive

DRAFT_MODES = ("tree_attention", "batch_expanding")
MATCH_RULES = ("subset", "exact")
FREEDAVE_CACHES = (None, "prefix", "dual")


@dataclass(frozen=True)
class FreeDave:
    """FreeDave's settings.

    draft_steps: drafts verified per forward (K ≥ 1; 1 = plain one-token-per-step decoding).
    draft_mode: ``"tree_attention"`` (drafts along the sequence, shared cache) or
        ``"batch_expanding"`` (drafts along the batch, cache copied per draft).
    confidence_threshold: None (FreeDave, lossless w.r.t. one token per step) or τ in (0, 1]
        (FreeDave++: drafts and targets from Fast-dLLM's threshold rule).
    match_rule: ``"subset"`` (upstream's verification) or ``"exact"`` (draft == target; lossless
        w.r.t. threshold decoding under FreeDave++). The same without a threshold.
    """

    draft_steps: int = 4
    draft_mode: str = "tree_attention"
    confidence_threshold: float | None = None
    match_rule: str = "subset"

    def __post_init__(self) -> None:
        check_int("draft_steps", self.draft_steps, minimum=1)
        check_choice("draft_mode", self.draft_mode, DRAFT_MODES)
        check_real("confidence_threshold", self.confidence_threshold, low=0, high=1, low_open=True, allow_none=True)
        check_choice("match_rule", self.match_rule, MATCH_RULES)

    def check_request(self, *, gen_length: int | None = None, block_length: int | None = None,
                      steps: int | None = None, prompt_length: int | None = None) -> None:
        """The work bound of a request (docs/parameters.md, "Work bounds"): a round drafts at most
        as many states as the block has masked positions, so `draft_steps` past the block length
        acts as the block length. `block_length` None: not known yet (a block-causal family decodes
        the model's block); checked where the loop is built."""
        if block_length is not None:
            check_config_bounds(self, "decoder", {"draft_steps": (block_length, "the block length")})


class _TreeCache(KVCache):
    """The block's cache shared by the drafts (never copied): the drafts run as rows, K per row of
    the batch (row a·K + k: draft k of `rows[a]`), and each draft's queries attend to [cached prefix
    | its own keys | cached suffix] of its row's cache — the key list of the baseline's
    single-draft forward — gathered per layer (transient, one layer at a time), all drafts in one
    batched attention call. It writes nothing."""

    def __init__(self, base: KVCache, rows: torch.Tensor | None, prefix: int, suffix_start: int,
                 total: int, drafts: int) -> None:
        super().__init__()
        self.base, self.rows, self.prefix, self.suffix_start = base, rows, prefix, suffix_start
        self.total, self.drafts = total, drafts

    def get_seq_length(self, layer: int = 0) -> int:
        return self.total

    def _side(self, t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        part = t[:, :, lo:hi]
        if self.rows is not None:
            part = part.index_select(0, self.rows)
        return part.repeat_interleave(self.drafts, dim=0)

    def _keys(self, cached: list[torch.Tensor], layer: int, own: torch.Tensor) -> torch.Tensor:
        parts = []
        if self.prefix > 0:
            parts.append(self._side(cached[layer], 0, self.prefix))
        parts.append(own)
        if self.suffix_start < self.total:
            parts.append(self._side(cached[layer], self.suffix_start, self.total))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               mask: torch.Tensor | None) -> torch.Tensor:
        """`q`, `k`, `v` `[A·K, H, L, D]`: each draft's own; `mask` (if any) per draft row."""
        keys = self._keys(self.base.keys, layer, k)
        values = self._keys(self.base.values, layer, v)
        if mask is not None:
            mask = mask.expand(q.shape[0], *mask.shape[1:])
        return attention(q, keys, values, mask)


def _select_rows(value: Any, rows: torch.Tensor | None, batch: int) -> Any:
    if rows is None or not torch.is_tensor(value) or value.shape[0] != batch:
        return value
    return value.index_select(0, rows)


def _rows_alone(forward: Generator[ForwardRequest, Any, Any], alone: bool) -> Generator[ForwardRequest, Any, Any]:
    """`forward` (a sub-generator of requests) with each request's rows computed as alone when
    `alone` (`ForwardRequest.rows_alone`: the rows of a batch get the bits each gets by itself)."""
    answer = None
    while True:
        try:
            request = forward.send(answer)
        except StopIteration as stop:
            return stop.value
        if alone and isinstance(request, ForwardRequest):
            request.rows_alone = True
        answer = yield request


class _Forwards:
    """The block-start forward (baseline `BlockForward.refresh`, each row's linears as alone for
    batches) and the verification forward over drafts, as sub-generators of `ForwardRequest`s."""

    def __init__(self, model, spec: ModelSpec, use_cache: str | None, forward_inputs: dict[str, Any],
                 attention_mask: torch.Tensor | None, total: int, draft_mode: str) -> None:
        self.spec, self.mode, self.draft_mode = spec, use_cache, draft_mode
        self.forward_inputs, self.total = forward_inputs, total
        self.block = BlockForward(model, spec, use_cache, forward_inputs, valid_positions(attention_mask, total))

    @property
    def cache_nbytes(self) -> int:
        return self.block.cache_nbytes

    def refresh(self, x: torch.Tensor, start: int, end: int) -> Generator[ForwardRequest, Any, torch.Tensor]:
        return (yield from _rows_alone(self.block.refresh(x, start, end), x.shape[0] > 1))

    def drafts(self, x: torch.Tensor, rows: torch.Tensor | None, drafts: torch.Tensor, start: int,
               end: int) -> Generator[ForwardRequest, Any, tuple[torch.Tensor, int, int]]:
        """Logits of every draft `[A·K, L, V]` (draft-minor), the block's first row in them, and L
        (positions fed per draft). `drafts` `[A, K, block]` are the blocks of the rows `rows` of `x`
        (None: all rows).

        One plain request of A·K rows (draft-minor), each row's linears as alone (`rows_alone`: the
        GEMM problems `[L, hidden]`), against the block's cache: copied along the batch
        (``"batch_expanding"``, a `KVCache`) or shared (``"tree_attention"``, `_TreeCache`). Either
        packs with other requests' forwards in the engine.
        """
        A, K, _ = drafts.shape
        B, T = x.shape
        mode = self.mode
        fed, fed_end = (0, T) if mode is None else (start, T if mode == "prefix" else end)
        L = fed_end - fed
        sel = x if rows is None else x.index_select(0, rows)
        seqs = sel[:, fed:fed_end].unsqueeze(1).repeat(1, K, 1)
        seqs[:, :, start - fed:end - fed] = drafts
        inputs = self.forward_inputs if mode is None else self.spec.inputs_for_positions(self.forward_inputs, start,
                                                                                         fed_end)
        inputs = {k: _select_rows(v, rows, B) for k, v in inputs.items()}
        inputs = {k: v.repeat_interleave(K, dim=0) if torch.is_tensor(v) else v for k, v in inputs.items()}
        kw: dict[str, Any] = {}
        base = self.block.cache
        if mode is not None:   # without a cache both modes are the same full forward per draft
            if self.draft_mode == "batch_expanding":
                cache = KVCache()
                expand = (lambda t: t.index_select(0, rows)) if rows is not None else (lambda t: t)
                cache.keys = [expand(t).repeat_interleave(K, dim=0) for t in base.keys]
                cache.values = [expand(t).repeat_interleave(K, dim=0) for t in base.values]
            else:
                cache = _TreeCache(base, rows, start, T if mode == "prefix" else end, T, K)
            cache.write_start = fed
            kw = dict(cache=cache, cache_position=torch.arange(fed, fed_end, device=x.device))
        # `spec`: the family's logit shift within each draft's row (`ModelSpec.logits`)
        logits = yield ForwardRequest.call(seqs.reshape(A * K, L), inputs, spec=self.spec, rows_alone=True, **kw)
        return logits, start - fed, L


# --- the decoding loop --------------------------------------------------------------------------

def _verify(drafts: torch.Tensor, targets: torch.Tensor, counts: torch.Tensor, mask_id: int,
            rule: str) -> torch.Tensor:
    """Upstream's chain: from best = 0, repeatedly move to the largest j > best (j < counts[a])
    whose draft agrees with target[best] (``"subset"``: every decoded position of the draft equals
    the target there; ``"exact"``: equal) until nothing moves. `drafts`, `targets` `[A, K, L]`."""
    A, K, _ = drafts.shape
    best = torch.zeros(A, dtype=torch.long, device=drafts.device)
    if K == 1:
        return best
    same = drafts[:, None, :, :] == targets[:, :, None, :]          # [A, i, j, L]
    if rule == "subset":
        same = same | (drafts[:, None, :, :] == mask_id)
    agree = same.all(dim=-1)                                          # agree[a, i, j]
    j = torch.arange(K, device=drafts.device)
    agree &= (j[None, :, None] < j[None, None, :]) & (j[None, None, :] < counts[:, None, None])
    for _ in range(K - 1):
        row = agree.gather(1, best.view(A, 1, 1).expand(A, 1, K)).squeeze(1)
        cand = torch.where(row, j.expand(A, K), -1).max(dim=1).values
        best = torch.maximum(best, cand)
    return best


def make_drafts(base: torch.Tensor, x0: torch.Tensor, conf: torch.Tensor, K: int, mask_id: int) -> torch.Tensor:
    """`[N, K, block]`: draft k = `base` plus its k most confident masked predictions (ties: lower
    position first)."""
    mask = base == mask_id
    scores = torch.where(mask, conf.to(torch.float64), -torch.inf)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(
        order).contiguous())
    k = torch.arange(K, device=base.device)
    take = mask[:, None, :] & (rank[:, None, :] < k[None, :, None])
    return torch.where(take, x0[:, None, :], base[:, None, :])


class _Decoder:
    def __init__(self, spec: ModelSpec, config: FreeDave, block_length: int, conf_dtype: torch.dtype | None) -> None:
        self.spec, self.config, self.block_length = spec, config, block_length
        self.conf_dtype = conf_dtype   # None: the logits' dtype

    def score(self, logits: torch.Tensor, local: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x0 and confidence of the block rows of `logits` `[N, L, V]` → `[N, block]` each (the
        baselines' scoring: `score_rows`, greedy, never the mask token, rounded as they round)."""
        N, L, _ = logits.shape
        bl = self.block_length
        rows = (torch.arange(N, device=logits.device)[:, None] * L + local
                + torch.arange(bl, device=logits.device)).reshape(-1)
        x0, conf = score_rows(logits, rows, exclude_id=self.spec.mask_id)
        return x0.view(N, bl), conf.view(N, bl).to(self.conf_dtype or logits.dtype)

    def rule(self, tokens: torch.Tensor, x0: torch.Tensor, conf: torch.Tensor) -> torch.Tensor:
        """The baseline's step on `tokens` `[N, block]` from its own predictions (a new tensor)."""
        out = tokens.clone()
        mask = out == self.spec.mask_id
        if self.config.confidence_threshold is None:
            unmask(out, mask, x0, conf, k=1)
        else:
            unmask(out, mask, x0, conf, threshold=self.config.confidence_threshold)
        return out

    def make_drafts(self, base: torch.Tensor, x0: torch.Tensor, conf: torch.Tensor, K: int) -> torch.Tensor:
        return make_drafts(base, x0, conf, K, self.spec.mask_id)

    # --- structured output: the constrained step F (module docstring) ---------------------------
    def score_masked(self, cf: Any, logits: torch.Tensor, local: int, start: int,
                     end: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x0, confidence and the block's logits `[N, block, V]`, each row's frontier (by `cf`'s
        matchers) masked to what its structure allows before scoring."""
        lg = full_logits(logits)[:, local:local + self.block_length]
        lg = cf.mask_frontier(lg, start, end, 0).contiguous()
        x0, conf = self.score(lg, 0)
        return x0, conf, lg

    def constrained_step(self, cf: Any, canvas: torch.Tensor, start: int, end: int, x0: torch.Tensor,
                         conf: torch.Tensor, lg: torch.Tensor) -> None:
        """F on the rows of `canvas` `[N, T]` in place (their matchers `cf` advance): the rule on the
        block, then the commit filter."""
        blk = canvas[:, start:end]
        prior = blk.clone()
        blk.copy_(self.rule(blk, x0, conf))
        cf.filter(canvas, prior, x0, lg, start, end, 0)

    def block_structured(self, forwards: _Forwards, x: torch.Tensor, start: int, end: int, prompt_len: int,
                         stats: GenerationStats | None, cf: Any) -> StepGenerator:
        """`block` under a structure (`cf`: the rows' `CommitFilter`): drafts and targets are
        states of the constrained step F."""
        spec, mask_id, K_max, bl = self.spec, self.spec.mask_id, self.config.draft_steps, self.block_length
        B, T = x.shape
        blk = x[:, start:end]   # a view: commits write into x
        logits = yield from forwards.refresh(x, start, end)
        if stats is not None:
            stats.forward(B, T, forwards.cache_nbytes)
        x0, conf, lg = self.score_masked(cf, logits, start, start, end)
        del logits
        fresh = torch.ones(B, dtype=torch.bool, device=x.device)
        if spec.logit_shift:   # Dream: the block's first position from this forward, filtered
            before = int((blk == mask_id).sum())
            prior = blk.clone()
            blk[:, 0] = torch.where(blk[:, 0] == mask_id, x0[:, 0], blk[:, 0])
            cf.filter(x, prior, x0, lg, start, end, 0)
            fresh[:] = False
            if stats is not None:
                stats.step(before - int((blk == mask_id).sum()))
        yield self._progress(x, blk, start, end, prompt_len)
        while True:
            # never a block without holes whose tokens the matcher has not consumed (a subset-rule
            # draft could leave one): they are undecided again
            for b, open_ in enumerate(cf.unsettled(x, start, end)):
                if open_ and not bool((blk[b] == mask_id).any()):
                    blk[b, cf.frontier(b) - start:] = mask_id
            masks = (blk == mask_id).sum(dim=1)
            active = masks > 0
            if not bool(active.any()):
                return
            before = int(masks.sum())
            f = (fresh & active).nonzero().squeeze(1)
            if len(f):   # draft 0 = F(state), always accepted: committed now, the real matchers advance
                canvas = x.index_select(0, f)
                self.constrained_step(cf.rows(f.tolist()), canvas, start, end, x0[f], conf[f], lg[f])
                x[f] = canvas
            base = blk.clone()
            left = (base == mask_id).sum(dim=1)
            run = active & (left > 0)
            if bool(run.any()):
                rows = run.nonzero().squeeze(1)
                counts = torch.where(fresh[rows], left[rows] + 1, left[rows]).clamp(min=1, max=K_max)
                K = int(counts.max())
                drafts = self.make_drafts(base[rows], x0[rows], conf[rows], K)
                logits, local, L = yield from forwards.drafts(x, None if len(rows) == B else rows, drafts, start,
                                                              end)
                if stats is not None:
                    stats.forward(len(rows) * K, L, forwards.cache_nbytes)
                A = len(rows)
                rep = rows.repeat_interleave(K)
                canvas = x.index_select(0, rep)
                canvas[:, start:end] = drafts.reshape(A * K, bl)
                dcf = cf.clone_rows(rep.tolist())
                dcf.sync(canvas)   # each draft's matcher at its own frontier
                dx0, dconf, dlg = self.score_masked(dcf, logits, local, start, end)
                del logits
                targets = canvas.clone()
                self.constrained_step(dcf.clone_rows(range(A * K)), targets, start, end, dx0, dconf, dlg)
                best = _verify(canvas[:, start:end].view(A, K, bl), targets[:, start:end].view(A, K, bl), counts,
                               mask_id, self.config.match_rule)
                pick = torch.arange(A, device=x.device) * K + best
                x[rows] = canvas.index_select(0, pick)
                for r, p in zip(rows.tolist(), pick.tolist()):
                    cf.matchers[r] = dcf.matchers[p]
                x0[rows], conf[rows], lg[rows] = dx0[pick], dconf[pick], dlg[pick]
                fresh[rows] = True
            if stats is not None:
                stats.step(before - int((blk == mask_id).sum()))
            yield self._progress(x, blk, start, end, prompt_len)


    def block(self, forwards: _Forwards, x: torch.Tensor, start: int, end: int, prompt_len: int,
              stats: GenerationStats | None) -> StepGenerator:
        """Decode `x[:, start:end]` in place: a step generator (its forwards as `ForwardRequest`s)
        yielding a `Progress` after each forward (`final`: the generated positions before this
        block, or through `end` once it is decoded)."""
        spec, mask_id, K_max = self.spec, self.spec.mask_id, self.config.draft_steps
        B, T = x.shape
        blk = x[:, start:end]   # a view: commits write into x
        logits = yield from forwards.refresh(x, start, end)
        if stats is not None:
            stats.forward(B, T, forwards.cache_nbytes)
        # The block-start logits are the first predictions (upstream's "stale logits").
        x0, conf = self.score(logits, start)
        fresh = torch.ones(B, dtype=torch.bool, device=x.device)
        if spec.logit_shift:
            # Dream: the block's first position is committed from this forward; the predictions are
            # then stale (made before it), so draft 0 is the state itself.
            before = int((blk == mask_id).sum())
            blk[:, 0] = x0[:, 0]
            fresh[:] = False
            if stats is not None:
                stats.step(before - int((blk == mask_id).sum()))
        del logits
        yield self._progress(x, blk, start, end, prompt_len)
        while True:
            masks = (blk == mask_id).sum(dim=1)
            active = masks > 0
            if not bool(active.any()):
                return
            before = int(masks.sum())
            base = blk.clone()
            if bool(fresh.any()):
                f = fresh.nonzero().squeeze(1)
                base[f] = self.rule(blk[f], x0[f], conf[f])
            # A fresh row whose next state finishes the block needs no forward (upstream: the last step).
            free = active & fresh & ~(base == mask_id).any(dim=1)
            blk[free] = base[free]
            run = active & ~free
            if bool(run.any()):
                rows = run.nonzero().squeeze(1)
                counts = masks[rows].clamp(max=K_max)
                K = int(counts.max())
                drafts = self.make_drafts(base[rows], x0[rows], conf[rows], K)
                logits, local, L = yield from forwards.drafts(x, None if len(rows) == B else rows, drafts, start,
                                                              end)
                if stats is not None:
                    stats.forward(len(rows) * K, L, forwards.cache_nbytes)
                dx0, dconf = self.score(logits, local)
                del logits
                flat = drafts.reshape(-1, self.block_length)
                targets = self.rule(flat, dx0, dconf).view_as(drafts)
                best = _verify(drafts, targets, counts, mask_id, self.config.match_rule)
                pick = torch.arange(len(rows), device=x.device) * K + best
                blk[rows] = flat.index_select(0, pick)
                x0[rows] = dx0.index_select(0, pick)
                conf[rows] = dconf.index_select(0, pick)
                fresh[rows] = True
            if stats is not None:
                stats.step(before - int((blk == mask_id).sum()))
            if bool(run.any()):
                yield self._progress(x, blk, start, end, prompt_len)

    def _progress(self, x: torch.Tensor, blk: torch.Tensor, start: int, end: int, prompt_len: int) -> Progress:
        done = not bool((blk == self.spec.mask_id).any())
        return Progress(x, (end if done else start) - prompt_len)


@torch.no_grad()
def freedave_generate(
    model: torch.nn.Module,
    prompt: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    config: FreeDave | None = None,
    steps: int | None = None,
    gen_length: int = 128,
    block_length: int = 128,
    use_cache: str | None = None,
    mask_id: int | None = None,
    stats: GenerationStats | None = None,
    structure: Any = None,
    end_ids: Any = (),
) -> torch.LongTensor:
    """FreeDave decoding (greedy): the tokens of one-token-per-step decoding with fewer forwards.

    Args:
        model: a LLaDA-format or Dream model (see the module docstring for the baseline each equals).
        prompt: `[B, P]` token ids, left-padded when rows differ in length; attention_mask `[B, P]`.
        config: a `FreeDave` (default `FreeDave()`: 4 drafts, tree attention, no threshold).
        steps: None, or `gen_length` (one token per step; FreeDave has no other schedule).
        gen_length, block_length: `gen_length % block_length == 0`.
        use_cache: None, "prefix" or "dual" (Fast-dLLM v1's caches, refreshed at every block start).
        mask_id: override the model's mask token. stats: a `GenerationStats` to fill (`nfe`:
            block-start forwards plus verification forwards; `tokens_per_step`: per round).

    Returns:
        LongTensor `[B, P + gen_length]`, as `remask.generate`.
    """
    return drive(freedave_steps(model, prompt, attention_mask, config=config, steps=steps, gen_length=gen_length,
                                block_length=block_length, use_cache=use_cache, mask_id=mask_id, stats=stats,
                                structure=structure, end_ids=end_ids), model)


def freedave_steps(
    model: torch.nn.Module,
    prompt: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    config: FreeDave | None = None,
    steps: int | None = None,
    gen_length: int = 128,
    block_length: int = 128,
    use_cache: str | None = None,
    mask_id: int | None = None,
    stats: GenerationStats | None = None,
    structure: Any = None,
    end_ids: Any = (),
) -> StepGenerator:
    """`freedave_generate` as a step generator (`remask.diffusion.stepper`): the arguments are
    checked here, at the call; the generator yields a `Progress` after every model forward (block
    start and verification), with `final` the decoded blocks, and returns the `[B, P + gen_length]`
    tokens of `freedave_generate`."""
    if config is None:
        config = FreeDave()
    check_instance("config", config, FreeDave, "a remask FreeDave config", allow_none=False)
    check_int("mask_id", mask_id, minimum=0, allow_none=True)
    spec = get_spec(model, mask_id=mask_id)
    check_model_kind(spec, diffusion=True, entry="freedave_generate")
    check_mask_id(spec)
    if spec.noise != "mask":
        raise ValueError("freedave_generate decodes mask-diffusion models (LLaDA, Dream)")
    check_int("gen_length", gen_length, minimum=1)
    check_int("block_length", block_length, minimum=1)
    check_int("steps", steps, minimum=1, allow_none=True)
    if steps is not None and steps != gen_length:
        raise ValueError(f"steps must be None or gen_length ({gen_length}): FreeDave decodes one token per step, "
                         f"got {steps}")
    validate_block_args(gen_length, block_length, gen_length)
    config.check_request(gen_length=gen_length, block_length=block_length)
    mode = cache_mode(use_cache)
    if mode not in FREEDAVE_CACHES:
        raise ValueError(f"use_cache must be one of {list(FREEDAVE_CACHES)} for freedave_generate, got {use_cache!r}")
    check_prompt(model, prompt, attention_mask, spec=spec, mask_in_prompt="refuse")
    check_length(spec, prompt.shape[1] + gen_length, "prompt length + gen_length")
    check_stats("stats", stats)
    warn_if_padded_without_mask(prompt, attention_mask, spec.pad_id)
    warn_if_longer_than_trained(spec, gen_length)
    from ..parts.constrain import CommitFilter, end_ids_of

    constraint = CommitFilter.start(structure, end_ids_of(spec, end_ids), prompt.shape[0], spec.mask_id,
                                    prompt.shape[1], gen_length)
    return _freedave_loop(model, prompt, attention_mask, spec, config, gen_length, block_length, mode, stats,
                          constraint)


@torch.no_grad()
def _freedave_loop(model: torch.nn.Module, prompt: torch.Tensor, attention_mask: torch.Tensor | None,
                   spec: ModelSpec, config: FreeDave, gen_length: int, block_length: int, mode: str | None,
                   stats: GenerationStats | None, constraint: Any = None) -> StepGenerator:
    if stats is not None:
        stats.start()
    B, P = prompt.shape
    T = P + gen_length
    x = torch.full((B, T), spec.mask_id, dtype=torch.long, device=prompt.device)
    x[:, :P] = prompt
    forwards = _Forwards(model, spec, mode, spec.forward_inputs(attention_mask, T), attention_mask, T,
                         config.draft_mode)
    # The baselines' confidence dtypes: LLaDA's loop keeps float64 under a threshold (Fast-dLLM's
    # precision) and the logits' dtype otherwise; Dream's block decoder the logits' dtype.
    conf_dtype = torch.float64 if (config.confidence_threshold is not None and not spec.logit_shift) else None
    decoder = _Decoder(spec, config, block_length, conf_dtype)
    for block in range(gen_length // block_length):
        start = P + block * block_length
        if constraint is None:
            yield from decoder.block(forwards, x, start, start + block_length, P, stats)
        elif not all(constraint.finished):
            yield from decoder.block_structured(forwards, x, start, start + block_length, P, stats, constraint)
    if stats is not None:
        stats.stop(B * gen_length)
    return x

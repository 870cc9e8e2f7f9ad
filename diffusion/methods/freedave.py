"""FreeDave: lossless parallel decoding by free draft-and-verification (arXiv 2510.00294).

One-token-per-step greedy decoding commits, per step, the most confident masked position of the
current block. FreeDave gets the same tokens with fewer forwards: from the predictions it holds for
the current state it drafts the next K states (draft k: the state plus its k+1 most confident
predictions), runs the model once over all K drafts, applies the one-token rule to each with its
own logits (target k), and commits the last draft of the longest chain with draft k+1 == target k,
whose logits are the next round's predictions (no forward spent twice). Draft 0 is exactly the next
state, so every round advances at least one token. The round's verdict (`verify_drafts`, the held `Predictions`)
is `parts/drafts.py`'s, shared with the block-causal loops' FreeDave (`DraftVerify`); the drafts here come from one
sort (`make_drafts`), not the rule applied k times (`draft_chain`: 8× the CPU time per round, measured).

Baselines, equal token for token under the same cache schedule (a full forward at every block
start, building the "prefix" / "dual" cache, its logits the first predictions; verification
forwards feed each draft's block and all after it, its block, or its whole sequence):

* LLaDA-format models: ``remask.generate(model, prompt, steps=gen_length, gen_length=...,
  block_length=..., use_cache=...)``; with ``confidence_threshold=τ`` and ``match_rule="exact"``:
  ``remask.generate(..., threshold=τ)`` (Fast-dLLM's threshold rule).
* Dream (shifted logits): Fast-dLLM's Dream block decoder, committing each block's first position
  from the block-start forward, then one token per step: ``remask.diffusion_generate(model, prompt,
  max_new_tokens=gen_length, steps=gen_length, alg="confidence_threshold", threshold=1.0,
  block_length=..., use_cache=...)`` (1.0 commits only the top position unless another one's
  probability rounds to exactly 1.0, where the two could part); with τ and "exact": ``threshold=τ``.
  This is FreeDave's own Dream convention (`block_decode_with_full_attention`).

Draft modes: ``"batch_expanding"`` runs the drafts as K batch rows, the cache copied along them;
``"tree_attention"`` (upstream: drafts along one sequence under a tree mask) as K rows too, the cache
shared (`remask.caches.TreeKVCache`). Either is one plain `ForwardRequest` per verification, which the engine packs
with its other FreeDave requests' forwards into one model call per step.

Exactness: a draft gets the bits the baseline's single-sequence forward gives its state. GEMMs run
per draft (`rows_alone`: `batch_invariant_linear` in the drop-in driver, the engine's batch
invariance), and the shared cache is no masked attention over all drafts' keys (an online softmax
over a longer, partly masked key list rounds differently): each draft's queries attend, in one
batched SDPA call, exactly the baseline's keys [prefix | own draft | suffix], gathered per layer.

FreeDave++ (``confidence_threshold=τ``): draft 0 is the threshold rule's next state, later drafts add
the most confident remaining predictions one at a time, targets apply the threshold rule. Upstream's
``"subset"`` verification (a draft's tokens a subset of the target's) is not lossless w.r.t.
threshold decoding (a draft may commit fewer tokens than the step would); ``"exact"`` is. Without a
threshold both accept the same drafts. Greedy only; each row of a batch keeps its own chain length.

Structured output (`structure=`, `diffusion/parts/constrain.py`): the one-token step becomes the
constrained step F (the frontier masked before scoring, the rule, the commit filter with a matcher
clone per draft), and a state carries its matcher (`CommitFilter.sync`); draft 0 is F of the state,
target k is F of draft k with its own logits, the chain rule unchanged. So FreeDave equals
`remask.generate(..., steps=gen_length, structured_outputs=...)` (LLaDA) token for token (tested);
Dream's baseline is the constrained block decoder at `threshold=1.0` (its block-start commit filtered
too). docs/quirks.md has the departure.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Generator

import torch

from remask.caches import KVCache
from remask.caches.tree import TreeKVCache
from remask.kernels import unmask
from remask.models.parallel import full_logits
from remask.models.spec import ModelSpec

from ..families.llada import validate_block_args
from ..parts.cache import BlockForward, cache_mode, valid_positions
from ..parts.checks import (check_choice, check_config, check_config_bounds, check_int, check_length,
                            check_method_call, check_real, checked, warn_if_longer_than_trained,
                            warn_if_padded_without_mask)
from ..parts.constrain import CommitFilter, end_ids_of
from ..parts.drafts import DraftConfig, Predictions, verify_drafts
from ..parts.scoring import score_rows
from ..parts.stats import GenerationStats
from ..parts.step import masked_canvas
from ..parts.stepper import ForwardRequest, Progress, StepGenerator, Together, drop_in

FREEDAVE_CACHES = (None, "prefix", "dual")


@dataclass(frozen=True)
class FreeDave(DraftConfig):
    """FreeDave's settings (module docstring). draft_steps: drafts verified per forward (K ≥ 1; 1 =
    one token per step). draft_mode: ``"tree_attention"`` (shared cache) or ``"batch_expanding"``
    (cache copied per draft). confidence_threshold: None (FreeDave) or τ in (0, 1] (FreeDave++).
    match_rule: ``"subset"`` (upstream's) or ``"exact"`` (draft == target; lossless under FreeDave++).
    """

    draft_steps: int = checked(4, check_int, minimum=1)
    draft_mode: str = checked("tree_attention", check_choice, choices=("tree_attention", "batch_expanding"))
    confidence_threshold: float | None = checked(None, check_real, low=0, high=1, low_open=True, allow_none=True)
    match_rule: str = checked("subset", check_choice, choices=("subset", "exact"))

    def check_request(self, *, gen_length: int | None = None, block_length: int | None = None,
                      steps: int | None = None, prompt_length: int | None = None) -> None:
        """The work bound of a request (docs/parameters.md, "Work bounds"): a round drafts at most the
        block's masked positions. `block_length` None: not known yet (a block-causal family decodes
        the model's block); checked where the loop is built."""
        if block_length is not None:
            check_config_bounds(self, "decoder", {"draft_steps": (block_length, "the block length")})


def _draft_rows(value: Any, rows: torch.Tensor | None, batch: int, K: int) -> Any:
    """A tensor's rows `rows` (None: all; only a tensor of the `batch`'s rows is selected), each repeated `K` times
    (once per draft); anything else as it is."""
    if not torch.is_tensor(value):
        return value
    if rows is not None and value.shape[0] == batch:
        value = value.index_select(0, rows)
    return value.repeat_interleave(K, dim=0)


# --- the decoding loop --------------------------------------------------------------------------

def make_drafts(base: torch.Tensor, x0: torch.Tensor, conf: torch.Tensor, K: int, mask_id: int) -> torch.Tensor:
    """`[N, K, block]`: draft k = `base` plus its k most confident masked predictions (ties: lower position first,
    as the one-token step orders them): the one-token step applied k times, in one sort."""
    mask = base == mask_id
    scores = torch.where(mask, conf.to(torch.float64), -torch.inf)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    rank = order.argsort(dim=1)   # each position's place in that order (the inverse permutation)
    k = torch.arange(K, device=base.device)
    take = mask[:, None, :] & (rank[:, None, :] < k[None, :, None])
    return torch.where(take, x0[:, None, :], base[:, None, :])


def _padded(t: torch.Tensor, K: int, fill: float | int) -> torch.Tensor:
    """`t` `[A, k, ...]` padded with `fill` to `[A, K, ...]`."""
    return t if t.shape[1] == K else torch.cat([t, t.new_full((t.shape[0], K - t.shape[1], *t.shape[2:]), fill)], 1)


def _verdicts(mask_id: int, block_length: int, threshold: float | None, conf_dtype: torch.dtype | None,
              match_rule: str, items: list[tuple]) -> list[tuple[torch.Tensor, Predictions, torch.Tensor]]:
    """Rounds' verdicts (without a structure) from their drafts' forwards, each item `(logits [A·K, L, V], the
    block's first row in them, drafts [A, K, block], counts [A])`: the drafts' predictions (the baselines' scoring),
    each draft's target (the one-token step, or FreeDave++'s threshold rule, with its own predictions) and
    `verify_drafts`; returns each item's accepted draft (an index into its A·K rows), its predictions and its target
    `[A, block]` (the step from it: the next round's draft 0). Several
    items (requests of one setting, `Together`) in one scoring, one step and one verdict over their stacked rows,
    the drafts padded to the most any has (a padded draft is never reached: a chain stays below its row's count)."""
    x0, conf = _scored([(lg, local) for lg, local, _, _ in items], mask_id, block_length)
    conf = conf.to(conf_dtype or items[0][0].dtype)
    drafts = [d for _, _, d, _ in items]
    targets = torch.cat([d.reshape(-1, block_length) for d in drafts]).clone()
    unmask(targets, targets == mask_id, x0, conf, k=1 if threshold is None else None, threshold=threshold)
    K = max(d.shape[1] for d in drafts)
    sizes = [d.shape[0] * d.shape[1] for d in drafts]
    pad = lambda t, fill: torch.cat([_padded(part.view(d.shape), K, fill).reshape(-1, block_length)  # noqa: E731
                                     for part, d in zip(t.split(sizes), drafts)])
    pick, accepted = verify_drafts(torch.cat([_padded(d, K, mask_id) for d in drafts]),
                                   Predictions(pad(x0, mask_id), pad(conf, 0)), pad(targets, mask_id),
                                   torch.cat([c for *_, c in items]), mask_id, match_rule)
    out, at = [], 0
    for d, own in zip(drafts, targets.split(sizes)):   # each item's pick in its own A·K rows
        A, k = d.shape[:2]
        best = pick[at:at + A] - torch.arange(at, at + A, device=pick.device) * K
        mine = torch.arange(A, device=pick.device) * k + best
        out.append((mine, accepted.rows(slice(at, at + A)), own[mine]))
        at += A
    return out


def _scored(parts: list[tuple[torch.Tensor, int]], mask_id: int, block_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x0 and confidence `[ΣN, block]` of the block rows of each `(logits [N, L, V], first block row)` (`score_rows`,
    greedy, never the mask token; several logits flattened into one call)."""
    first, offset, bl = [], 0, block_length
    for logits, local in parts:
        N, L = logits.shape[:2]
        first.append(offset + local + L * torch.arange(N, device=logits.device))
        offset += N * L
    rows = (torch.cat(first)[:, None] + torch.arange(bl, device=parts[0][0].device)).reshape(-1)
    flat = parts[0][0] if len(parts) == 1 else torch.cat([lg.reshape(-1, lg.shape[-1]) for lg, _ in parts])
    x0, conf = score_rows(flat, rows, exclude_id=mask_id)
    return x0.view(-1, bl), conf.view(-1, bl)


class _Decoder:
    """A request's FreeDave loop; its forwards (sub-generators of `ForwardRequest`s) are the block
    start (baseline `BlockForward.refresh`, rows as alone for batches) and the drafts' verification."""

    def __init__(self, spec: ModelSpec, config: FreeDave, block_length: int, use_cache: str | None,
                 attention_mask: torch.Tensor | None, prompt_len: int, total: int, stats: GenerationStats,
                 batch: int = 1) -> None:
        self.spec, self.config, self.block_length, self.mode = spec, config, block_length, use_cache
        self.prompt_len, self.stats = prompt_len, stats
        # the block start's forward: a batch's rows as alone (each row the bits of its own forward)
        self.block_forward = BlockForward(spec, use_cache, spec.forward_inputs(attention_mask, total),
                                          valid_positions(attention_mask, total), rows_alone=batch > 1)
        # The baselines' confidence dtypes: LLaDA's loop keeps float64 under a threshold (Fast-dLLM's
        # precision) and the logits' dtype (None) otherwise; Dream's block decoder the logits' dtype.
        self.conf_dtype = torch.float64 if config.confidence_threshold is not None and not spec.logit_shift else None
        settings = (spec.mask_id, block_length, config.confidence_threshold, self.conf_dtype, config.match_rule)
        # a round's verdict without a structure: the engine gives those of one setting in one call (`Together`)
        self.verdicts_key, self.verdicts = (_verdicts, *settings), partial(_verdicts, *settings)

    def verify(self, canvas: torch.Tensor, rows: torch.Tensor, B: int, start: int,
               end: int) -> Generator[ForwardRequest, Any, tuple[torch.Tensor, int]]:
        """The logits `[A·K, L, V]` of the drafts `canvas` `[A·K, T]` (draft-minor: K per row of `rows`, of the
        batch's B) and the block's first row in them: one plain request, each row's linears as alone
        (`rows_alone`), against the block's cache copied or shared."""
        K, T, mode = canvas.shape[0] // len(rows), canvas.shape[1], self.mode
        rows = None if len(rows) == B else rows
        fed, fed_end = (0, T) if mode is None else (start, T if mode == "prefix" else end)
        base, cache = self.block_forward.cache, None   # without a cache both modes are the same full forward
        if mode is not None and self.config.draft_mode == "batch_expanding":
            cache = KVCache()
            cache.keys = [_draft_rows(t, rows, B, K) for t in base.keys]
            cache.values = [_draft_rows(t, rows, B, K) for t in base.values]
        elif mode is not None:
            cache = TreeKVCache(base, rows, start, fed_end, T, K)
        inputs = {k: _draft_rows(v, rows, B, K) for k, v in self.block_forward.forward_inputs.items()}
        # the block loop's forward of the drafts' rows (`spec`: the family's logit shift within each draft's row)
        forward = BlockForward(self.spec, mode, inputs, None, rows_alone=True)
        logits = yield from forward.span(canvas, fed, fed_end, cache)
        self.stats.forward(len(canvas), fed_end - fed, self.block_forward.cache_nbytes)
        return logits, start - fed

    def _start(self, x: torch.Tensor, start: int, end: int,
               cf: Any) -> Generator[Any, Any, tuple[Predictions, torch.Tensor]]:
        """The baseline's block-start forward (`BlockForward.refresh`, a batch's rows computed as alone; its logits
        the first predictions: upstream's "stale logits"), then a `Progress`; returns the predictions (the block's
        logits under a structure) and which rows' predictions are fresh: Dream commits the block's first position
        from them, so none are."""
        blk, mask_id = x[:, start:end], self.spec.mask_id
        pred = self.score_masked(cf, (yield from self.block_forward.refresh(x, start, end)), start, start, end)
        self.stats.forward(*x.shape, self.block_forward.cache_nbytes)
        fresh = torch.full((x.shape[0],), not self.spec.logit_shift, dtype=torch.bool, device=x.device)
        if self.spec.logit_shift:
            before, prior = int((blk == mask_id).sum()), blk.clone()
            blk[:, 0] = torch.where(blk[:, 0] == mask_id, pred.x0[:, 0], blk[:, 0])
            if cf is not None:
                cf.filter(x, prior, pred.x0, pred.logits, start, end, 0)
            self.stats.step(before - (blk == mask_id).sum())   # a device count: no host sync
        yield Progress(x, (start if bool((blk == mask_id).any()) else end) - self.prompt_len)
        return pred, fresh

    def score_masked(self, cf: Any, logits: torch.Tensor, local: int, start: int, end: int) -> Predictions:
        """The predictions for the block rows of `logits` `[N, L, V]` (from row `local`): x0 and confidence
        `[N, block]` each (the baselines' scoring: `score_rows`, greedy, never the mask token, rounded as they round)
        and, under a structure (`cf`: the rows' `CommitFilter`), the block's logits `[N, block, V]`, each row's
        frontier masked to what its structure allows before scoring (None without one)."""
        bl, lg = self.block_length, None
        if cf is not None:
            lg = logits = cf.mask_frontier(full_logits(logits)[:, local:local + bl], start, end, 0).contiguous()
            local = 0
        x0, conf = _scored([(logits, local)], self.spec.mask_id, bl)
        return Predictions(x0, conf.to(self.conf_dtype or logits.dtype), lg)

    def constrained_step(self, cf: Any, canvas: torch.Tensor, start: int, end: int, pred: Predictions) -> None:
        """The step F on the rows of `canvas` `[N, T]` in place: the baseline's step on the block from its own
        predictions, then (under a structure) the commit filter, whose matchers `cf` advance."""
        blk, threshold = canvas[:, start:end], self.config.confidence_threshold
        prior, out = blk.clone(), blk.clone()
        unmask(out, out == self.spec.mask_id, pred.x0, pred.conf, k=1 if threshold is None else None,
               threshold=threshold)
        blk.copy_(out)
        if cf is not None:
            cf.filter(canvas, prior, pred.x0, pred.logits, start, end, 0)

    @torch.no_grad()
    def run(self, x: torch.Tensor, gen_length: int, constraint: Any) -> StepGenerator:
        """Decode the canvas `x` block by block (a block is skipped once every row's structure has finished)."""
        self.stats.start()
        for start in range(self.prompt_len, self.prompt_len + gen_length, self.block_length):
            if constraint is None or not all(constraint.finished):
                yield from self.block(x, start, start + self.block_length, constraint)
        self.stats.stop(x.shape[0] * gen_length)
        return x

    def block(self, x: torch.Tensor, start: int, end: int, cf: Any = None) -> StepGenerator:
        """Decode `x[:, start:end]` in place, a `Progress` after each forward (`final`: the positions
        before this block, or through `end` once it is decoded). Under a structure (`cf`: the rows'
        `CommitFilter`) drafts and targets are states of the constrained step F (module docstring)."""
        mask_id, K_max, bl = self.spec.mask_id, self.config.draft_steps, self.block_length
        blk = x[:, start:end]   # a view: commits write into x
        held, fresh = yield from self._start(x, start, end, cf)
        stepped = None   # [B, block]: the last verdict's rows' next state (the step from their accepted drafts)
        while True:
            # never a block without holes whose tokens the matcher has not consumed (a subset-rule
            # draft could leave one): they are undecided again
            for b, open_ in enumerate([] if cf is None else cf.unsettled(x, start, end)):
                if open_ and not bool((blk[b] == mask_id).any()):
                    blk[b, cf.frontier(b) - start:] = mask_id
            masks = (blk == mask_id).sum(dim=1)
            active = masks > 0
            if not bool(active.any()):
                return
            before = int(masks.sum())
            f = (fresh & active).nonzero().squeeze(1)
            if len(f) and stepped is not None:   # (no structure: only the last verdict's rows can be fresh here)
                blk[f] = stepped[f]
            elif len(f):   # draft 0 = F(state), always accepted: committed now (the real matchers advance)
                canvas = x.index_select(0, f)
                self.constrained_step(None if cf is None else cf.rows(f.tolist()), canvas, start, end, held.rows(f))
                x[f] = canvas
            left = (blk == mask_id).sum(dim=1)
            # a row whose next state finished the block needs no forward (upstream: the last step)
            run = active & (left > 0)
            if bool(run.any()):
                rows = run.nonzero().squeeze(1)
                # (without a structure: as many drafts as masks before draft 0, FreeDave++'s included)
                counts = masks[rows] if cf is None else torch.where(fresh[rows], left[rows] + 1, left[rows])
                counts = counts.clamp(min=1, max=K_max)
                drafts = make_drafts(blk[rows], held.x0[rows], held.conf[rows], int(counts.max()), mask_id)
                A, K, _ = drafts.shape
                rep = rows.repeat_interleave(K)
                canvas = x.index_select(0, rep)
                canvas[:, start:end] = drafts.reshape(A * K, bl)
                logits, local = yield from self.verify(canvas, rows, x.shape[0], start, end)
                if cf is None:
                    pick, accepted, targets = yield Together(self.verdicts_key, self.verdicts,
                                                             (logits, local, drafts, counts))
                    stepped = blk.clone()
                    stepped[rows] = targets
                else:
                    dcf = cf.clone_rows(rep.tolist())
                    dcf.sync(canvas)   # each draft's matcher at its own frontier
                    new = self.score_masked(dcf, logits, local, start, end)
                    targets = canvas.clone()
                    self.constrained_step(dcf.clone_rows(range(A * K)), targets, start, end, new)
                    pick, accepted = verify_drafts(drafts, new, targets[:, start:end], counts, mask_id,
                                                   self.config.match_rule)
                del logits
                x[rows] = canvas.index_select(0, pick)
                if cf is not None:
                    for r, p in zip(rows.tolist(), pick.tolist()):
                        cf.matchers[r] = dcf.matchers[p]
                held.hold(rows, accepted)
                fresh[rows] = True
            self.stats.step(before - (blk == mask_id).sum())
            if cf is not None or bool(run.any()):
                yield Progress(x, (start if bool((blk == mask_id).any()) else end) - self.prompt_len)


def freedave_steps(spec: ModelSpec, prompt: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                   config: FreeDave | None = None, steps: int | None = None, gen_length: int = 128,
                   block_length: int = 128, use_cache: str | None = None, mask_id: int | None = None,
                   stats: GenerationStats | None = None, structure: Any = None, end_ids: Any = ()) -> StepGenerator:
    """`freedave_generate` as a step generator (`remask.diffusion.parts.stepper`), its arguments checked at
    the call: it yields a `Progress` after every forward (block start and verification; `final`: the
    decoded blocks) and returns the tokens of `freedave_generate`."""
    check_int("mask_id", mask_id, minimum=0, allow_none=True)
    config = check_config("config", config, FreeDave, "a remask FreeDave config")
    spec, stats = check_method_call(spec, prompt, attention_mask, stats, "freedave_generate", mask_id=mask_id)
    if spec.noise != "mask":
        raise ValueError("freedave_generate decodes mask-diffusion models (LLaDA, Dream)")
    validate_block_args(gen_length, block_length, gen_length)   # steps = gen_length: one token per step
    check_int("steps", steps, minimum=1, allow_none=True)
    if steps is not None and steps != gen_length:
        raise ValueError(f"steps must be None or gen_length ({gen_length}): FreeDave decodes one token per step, "
                         f"got {steps}")
    config.check_request(gen_length=gen_length, block_length=block_length)
    mode = cache_mode(use_cache)
    if mode not in FREEDAVE_CACHES:
        raise ValueError(f"use_cache must be one of {list(FREEDAVE_CACHES)} for freedave_generate, got {use_cache!r}")
    check_length(spec, prompt.shape[1] + gen_length, "prompt length + gen_length")
    warn_if_padded_without_mask(prompt, attention_mask, spec.pad_id)
    warn_if_longer_than_trained(spec, gen_length)
    constraint = CommitFilter.start(structure, end_ids_of(spec, end_ids), prompt.shape[0], spec.mask_id,
                                    prompt.shape[1], gen_length)
    decoder = _Decoder(spec, config, block_length, mode, attention_mask, prompt.shape[1],
                       prompt.shape[1] + gen_length, stats, prompt.shape[0])
    return decoder.run(masked_canvas(prompt, gen_length, spec.mask_id), gen_length, constraint)


@drop_in(freedave_steps, hidden=())
def freedave_generate() -> torch.LongTensor:
    """FreeDave decoding (greedy): the tokens of one-token-per-step decoding with fewer forwards.

    `model`: LLaDA-format or Dream (the module docstring has the baseline each equals); `prompt`
    `[B, P]`, left-padded with `attention_mask` when rows differ; `config` (default `FreeDave()`);
    `steps`: None or `gen_length` (no other schedule); `gen_length % block_length == 0`; `use_cache`:
    None, "prefix" or "dual" (Fast-dLLM v1's, refreshed at every block start); `stats`: `nfe` the
    block-start plus verification forwards, `tokens_per_step` per round. Returns `[B, P + gen_length]`.
    """

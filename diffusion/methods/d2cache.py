"""d2Cache for LLaDA (Kamichanw/d2Cache `src/cache/d2cache.py::d2Cache`, run by its default decoding loop
`src/generation/vanilla.py::vanilla_generate`; docs/decoders.md): greedy low-confidence decoding,
optionally with the certainty prior, where each step after the first recomputes only chosen rows.

Decoding rule (the reference's `vanilla` strategy, `alg="maskgit_plus"`, temperature 0): blocks left to
right; each step commits `gen_length // steps` positions of the current block (fewer when it has fewer
masks left) with the highest softmax max-probability, times the certainty density of the decoded
positions when `prior_sigma` is set; a committed mask-id argmax leaves the position masked (upstream).

Cache rule: the first forward computes every position and keeps every layer's keys and values; every
later forward recomputes only the rows `_Selector` chose at the end of the previous step, whose fresh
keys/values overwrite the cache in place, all queries attending over the whole cached sequence. Rows
not recomputed get all-zero logits (as upstream: argmax token 0, confidence 1/V). Rows of a batch with
different counts are topped up to the largest count, as upstream: a batch's rows are coupled (also
through the global maximum of the block bias), so a row in a batch may decode differently than alone.
`D2KVCache` computes attention eagerly (the rollout needs the weights) in the reference's order of
operations, so float32 logits are the reference's.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache, partial
from itertools import accumulate
from typing import Any, Callable

import torch

from remask.caches import D2KVCache, key_bias
from remask.models.spec import ModelSpec

from ..parts.cache import valid_positions
from ..parts.checks import (NoWorkBound, check_bools, check_config, check_int, check_ints, check_method_call,
                            check_real, checked)
from ..parts.constrain import CommitFilter, end_ids_of
from ..parts.constrain_loops import open_frontiers
from ..parts.scoring import score_tokens
from ..parts.selection import topk_commit
from ..parts.stats import GenerationStats
from ..parts.step import masked_canvas
from ..parts.stepper import ForwardRequest, Progress, StepGenerator, Together, drop_in, row_by_row


@dataclass(frozen=True)
class D2Cache(NoWorkBound):
    """d2Cache's parameters (upstream `d2Cache.__init__` defaults; `configs/cache/d2cache.yaml` and
    `configs/gen_args.py` run it with `inflate_w=0` and one block over the whole generation).

    No work bound (`NoWorkBound`): `current_k` reads "at most" (a step selects at most the `gen_length` masked
    positions: `min(current_k, G)`) and an `inflate_w` past the sequence fills every gap; neither costs more work
    (upstream takes any)."""

    rollout_p: float = checked(0.1, check_real, low=0.0, high=1.0)
    current_k: int = checked(32, check_int, minimum=1)
    sigma: float = checked(10.0, check_real, low=0.0, low_open=True)
    inflate_w: int = checked(4, check_int, minimum=0)


def certainty_density(decoded: torch.Tensor, sigma: float) -> torch.Tensor:
    """Gaussian-smoothed density `[B, L]` of `decoded` `[B, L]` (bool): sum of exp(-d²/2σ²) over decoded
    positions, over the kernel's total mass. Outside the row the signal is 1 on the left (the prompt) and
    repeats the last position on the right. Computed by FFT convolution on a 6L circle in float32, as the
    reference does, so that near-equal scores order the same way."""
    (B, L), device = decoded.shape, decoded.device
    signal = torch.ones((B, 3 * L), device=device)
    signal[:, L:2 * L] = decoded.float()
    signal[~decoded[:, -1], 2 * L:] = 0.0
    signal = torch.cat([signal, torch.zeros((B, 3 * L), device=device)], dim=1)
    kernel, total = _density_kernel(B, L, sigma, device)
    weighted = torch.fft.ifft(torch.fft.fft(signal, n=6 * L) * kernel, n=6 * L).real
    return weighted[:, L:2 * L] / total


@lru_cache(maxsize=64)
def _density_kernel(B: int, L: int, sigma: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`certainty_density`'s parts that depend on the shape alone (the same ops as every call, once per shape: the
    same bits): the Gaussian's FFT and the kernel's total mass `[B, L]` (clamped)."""
    offsets = torch.cat((torch.arange(3 * L, device=device), torch.arange(-3 * L, 0, device=device)))
    kernel = torch.fft.fft(torch.exp(-(offsets ** 2) / (2 * sigma ** 2)), n=6 * L)
    total = torch.fft.ifft(torch.fft.fft(torch.ones((B, 6 * L), device=device), n=6 * L) * kernel, n=6 * L).real
    return kernel, total[:, L:2 * L].clamp_min(1e-8)


def nucleus(scores: torch.Tensor, p: float, allowed: torch.Tensor) -> torch.Tensor:
    """Positions `[B, L]` (bool) among `allowed` whose normalised `scores`, taken largest first, stay within
    cumulative mass `p`; always the largest one."""
    scores = torch.where(allowed, scores, 0.0)
    probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-9)
    ordered, order = torch.sort(probs, dim=-1, descending=True)
    keep = torch.cumsum(ordered, dim=-1) <= p
    keep[:, 0] = True
    keep &= torch.gather(allowed, 1, order)
    return torch.zeros_like(allowed).scatter_(1, order, keep)


def inflate(selected: torch.Tensor, width: int) -> torch.Tensor:
    """`selected` `[B, T]` plus every position between two selected ones at most `width` apart."""
    if width <= 0:
        return selected
    B, T = selected.shape
    idx = torch.arange(T, device=selected.device).expand(B, T)
    prev = torch.cummax(torch.where(selected, idx, -1), dim=1).values
    nxt = torch.cummin(torch.where(selected, idx, T).flip(1), dim=1).values.flip(1)
    return selected | ((nxt - prev <= width) & (prev >= 0) & (nxt < T))


def top_up(rows: torch.Tensor, priority: torch.Tensor, count: int) -> torch.Tensor:
    """Add to each row of `rows` `[B, T]` its highest-`priority` unselected positions up to `count`."""
    need = (count - rows.sum(dim=-1)).clamp(min=0)
    if int(need.sum()) == 0:
        return rows
    rows = rows.clone()
    order = torch.topk(torch.where(rows, -torch.inf, priority), k=int(need.max()), dim=-1).indices
    take = torch.arange(order.shape[1], device=rows.device)[None] < need[:, None]
    rows[torch.arange(rows.shape[0], device=rows.device)[:, None].expand_as(order)[take], order[take]] = True
    return rows


class _Selector:
    """The rows each forward recomputes (chosen at the previous step's end: `_settle`; upstream `top_up_mask`): rows
    with fewer are topped up by masked positions' step-1 score first, then rollout importance."""

    def __init__(self, config: D2Cache) -> None:
        self.config = config
        self.first_conf: torch.Tensor | None = None   # [B, G] step-1 confidence (never refreshed upstream)
        self.next_rows: torch.Tensor | None = None    # [B, T]
        self.importance: torch.Tensor | None = None   # [B, T]
        self.density: torch.Tensor | None = None      # [B, G] biased step-end scores

    def rows_for(self, active: torch.Tensor) -> torch.Tensor | None:
        if self.next_rows is None:
            return None
        rows = self.next_rows[active]
        if rows.shape[0] == 1:   # a row alone has the most: nothing to top up
            return rows
        G = self.density.shape[1]
        priority = torch.where(rows, -torch.inf, self.importance[active])
        priority[:, -G:] += priority.max() + self.density[active]
        return top_up(rows, priority, int(rows.sum(dim=-1).max()))   # rows with fewer topped up to the most

    def keep(self, active: torch.Tensor, rows: torch.Tensor, importance: torch.Tensor, scores: torch.Tensor) -> None:
        """Store what the step's end chose for the `active` rows."""
        if self.next_rows is None or len(active) == len(rows):   # every row (the first step: block 0 is all masks)
            self.next_rows, self.importance, self.density = rows, importance, scores
        else:
            self.next_rows[active], self.importance[active], self.density[active] = rows, importance, scores


@dataclass(eq=False)
class _Step:
    """One group's step after its forward, for `_settle`: its `selector`, its `active` rows `[N]`, their canvas `x`
    `[Ba, T]` before the step, `logits` `[Ba, G, V]` of the generated positions, `open_` `[Ba, G]` (masked before
    the step), `block` `[Ba, G]` (the block's masked positions), the cache's attention `rollout` `[Ba, T, T]` and a
    structure's `keep(new, x0)` (the positions it kept committed; None: no structure)."""

    selector: _Selector
    active: torch.Tensor
    x: torch.Tensor
    logits: torch.Tensor
    open_: torch.Tensor
    block: torch.Tensor
    rollout: torch.Tensor
    keep: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None


def _settle(per_step: int, prior_sigma: float | None, allow_mask: bool, mask_id: int,
            items: list[tuple[_Step]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Score, commit and choose the next forward's rows (upstream `d2Cache.on_step_end`) for one group's step, or for
    the steps of several one-row groups at once (`Together`: each row as alone, stacked along the batch); returns
    each step's `(new canvas [Ba, T], committed [Ba, G])`. One group couples its rows as upstream (the block bias's
    maximum over them); stacked one-row groups take each their own."""
    steps = [item[0] for item in items]
    cfg, alone = steps[0].selector.config, len(steps) == 1
    bounds = list(accumulate((s.x.shape[0] for s in steps), initial=0))
    stack = lambda get: torch.cat([get(s) for s in steps])   # noqa: E731
    logits, open_, open_block = stack(lambda s: s.logits), stack(lambda s: s.open_), stack(lambda s: s.block)
    new = stack(lambda s: s.x[:, -s.open_.shape[1]:]).clone()
    G, device = open_.shape[1], open_.device
    # greedy: the softmax's most probable token (the mask token allowed, as upstream, or its runner-up)
    x0, conf = score_tokens(logits, sampler="categorical", exclude_id=None if allow_mask else mask_id)
    conf = torch.where(open_, conf, -torch.inf)
    scores = conf if prior_sigma is None else conf * certainty_density(~open_, prior_sigma)
    left = open_block.clone()   # cleared where committed
    topk_commit(new, left, x0, scores, open_block.sum(dim=1).clamp(max=per_step), G, 0)
    committed = open_block & ~left
    out = []
    for s, a, b in zip(steps, bounds, bounds[1:]):
        row = s.x.clone()
        row[:, -G:] = new[a:b]
        if s.keep is not None:   # what the structure accepts (it advances its matchers)
            committed[a:b] = s.keep(row, x0[a:b])
        out.append((row, committed[a:b]))
        if s.selector.first_conf is None:   # step-1 confidence (never refreshed upstream)
            s.selector.first_conf = conf[a:b]
    still_masked = torch.cat([row[:, -G:] for row, _ in out]) == mask_id
    # 1. up to current_k masked positions of highest step-1 confidence × certainty density, from the block's first
    # open position to a boundary covering current_k masks (a multiple of the block's open count: upstream narrows
    # the block mask in place), the open block positions first
    size = open_block.sum(dim=1, keepdim=True)
    enough = torch.cumsum(still_masked.int(), dim=1) >= cfg.current_k
    end = torch.argmax(enough.int(), dim=1, keepdim=True)
    end[~enough.any(dim=1, keepdim=True)] = G - 1
    end = (end // size + 1) * size - 1
    begin = torch.argmax(open_block.int(), dim=1, keepdim=True)
    cols = torch.arange(G, device=device)
    window = (cols >= begin) & (cols <= end)
    scores = stack(lambda s: s.selector.first_conf[s.active]) * certainty_density(~still_masked, cfg.sigma)
    scores = torch.where(open_block, scores + (scores.max() if alone else scores.amax(dim=1, keepdim=True)), scores)
    top = torch.topk(torch.where(window & still_masked, scores, -torch.inf), k=min(cfg.current_k, G), dim=-1).indices
    # 2. and the positions just committed
    chosen = (torch.zeros_like(still_masked).scatter_(1, top, True) & still_masked) | committed
    by_length: dict[int, list[int]] = {}   # 3-4 over each one's whole sequence, the steps of one length stacked
    for j, s in enumerate(steps):
        by_length.setdefault(s.x.shape[1], []).append(j)
    for T, members in by_length.items():
        spans = [slice(bounds[j], bounds[j + 1]) for j in members]
        picked = torch.cat([chosen[span] for span in spans])
        rows = torch.cat([torch.zeros((len(picked), T - G), dtype=torch.bool, device=device), picked], dim=1)
        # 3. the rollout-importance nucleus of the rest (the rollout summed over queries)
        importance = torch.cat([steps[j].rollout.sum(dim=1) for j in members])
        rows |= nucleus(importance, cfg.rollout_p, ~rows)
        # 4. fill short gaps
        rows, start = inflate(rows, cfg.inflate_w), 0
        for j, span in zip(members, spans):
            own = slice(start, start + span.stop - span.start)
            steps[j].selector.keep(steps[j].active, rows[own], importance[own], scores[span])
            start = own.stop
    return out


def d2cache_steps(spec: ModelSpec, prompt: torch.Tensor, *, config: D2Cache | None = None,
                  steps: int = 128, gen_length: int = 128, block_length: int = 128,
                  prior_sigma: float | None = 10.0, commit_mask_token: bool = True,
                  independent_rows: bool = True, attention_mask: torch.Tensor | None = None,
                  mask_id: int | None = None, stats: GenerationStats | None = None, structure: Any = None,
                  end_ids: Any = ()) -> StepGenerator:
    """`d2cache_generate` as a step generator (`remask.diffusion.parts.stepper`): the arguments are checked
    now; the generator yields a `ForwardRequest` per forward and a `Progress` after it (`final`: the
    decoded blocks) and returns `d2cache_generate`'s tensor. With `independent_rows` the rows run one
    after another, the canvas showing each row as it stands. `structure` (a compiled
    `remask.structured` structure) and `end_ids`: structured output (`diffusion/parts/constrain.py`;
    each row's frontier among the recomputed rows, a block run until settled: docs/quirks.md)."""
    config = check_config("config", config, D2Cache, "a remask D2Cache")
    spec, stats = check_method_call(spec, prompt, attention_mask, stats, mask_id=mask_id)
    check_ints(1, steps=steps, gen_length=gen_length, block_length=block_length)
    check_real("prior_sigma", prior_sigma, low=0.0, low_open=True, allow_none=True)
    check_bools(commit_mask_token=commit_mask_token, independent_rows=independent_rows)
    if gen_length % block_length:
        raise ValueError(f"gen_length ({gen_length}) must be a multiple of block_length ({block_length})")
    if gen_length % steps:
        raise ValueError(f"steps ({steps}) must divide gen_length ({gen_length})")
    per_step = gen_length // steps
    if block_length % per_step:
        raise ValueError(f"gen_length // steps ({per_step} positions per step) must divide block_length "
                         f"({block_length})")
    if spec.kind != "llada":
        raise ValueError(f"d2cache_generate decodes LLaDA; model is a {spec.kind} model")
    B, P = prompt.shape
    constraint = CommitFilter.start(structure, end_ids_of(spec, end_ids), B, spec.mask_id, P, gen_length)
    canvas = masked_canvas(prompt, gen_length, spec.mask_id)
    decode = partial(_group, canvas, config, gen_length, block_length, per_step, prior_sigma, commit_mask_token,
                     spec.mask_id, stats, constraint)
    # the batch decoded together, or with `independent_rows` each row alone, one after another
    return row_by_row(canvas, decode, valid_positions(attention_mask, P + gen_length), stats, B * gen_length,
                      None if independent_rows else [slice(None)])


@drop_in(d2cache_steps)
def d2cache_generate() -> torch.Tensor:
    """d2Cache decoding of LLaDA (greedy). Returns `[B, P + gen_length]`.

    Each step commits `gen_length // steps` positions (upstream `num_transfer_tokens`; it must divide
    `block_length`). `prior_sigma`: certainty-prior decoding (upstream `generation.sigma`; None: plain
    low-confidence). `commit_mask_token=False` commits the most probable other token where upstream
    commits a mask-id argmax. `independent_rows=True` (remask's default) decodes every row alone, so a
    batch equals its rows run one by one; False is upstream's coupled batch. `attention_mask` `[B, P]`
    (left padding): pad keys hidden, positions counted over real tokens, as the reference's LLaDA."""


@torch.no_grad()
def _group(canvas: torch.Tensor, config: D2Cache, G: int, block_length: int, per_step: int, prior_sigma: float | None,
           commit_mask_token: bool, mask_id: int, stats: GenerationStats, constraint: Any, group: slice,
           key_ok: torch.Tensor | None) -> StepGenerator:
    """The rows `canvas[group]` decoded together, in place (`key_ok`: theirs, False on the left pads; None: no
    padding): a `Progress` of them after each forward (`final`: their decoded blocks); returns them."""
    x = canvas[group]   # a view: the group's rows are decoded in the canvas
    (N, T), device = x.shape, x.device
    P = T - G
    positions = torch.arange(T, device=device)[None].expand(N, T)
    if key_ok is not None:   # pad keys hidden, positions counted over real tokens
        positions = (key_ok.cumsum(dim=-1) - 1).masked_fill(~key_ok, 0)
    cache, selector = D2KVCache(key_bias(key_ok, torch.float32)), _Selector(config)
    group_constraint = None if constraint is None else constraint.rows(range(canvas.shape[0])[group])
    final, cols = 0, torch.arange(P, T, device=device)
    for start in range(P, T, block_length):
        end, block_steps = start + block_length, 0
        while True:
            masked = x[:, P:] == mask_id
            # upstream narrows the block mask to its open positions: the block's masked ones (without a
            # structure a position never reopens; with one, a revoked position does)
            block = masked & (cols >= start) & (cols < end)
            active = block.any(dim=-1)
            Ba = int(active.sum())
            if Ba == 0:
                break
            block_steps += 1
            allow_mask = commit_mask_token and block_steps <= 4 * block_length   # guard against endless loops
            xa = x[active]
            if group_constraint is not None and selector.next_rows is not None:
                # each row's frontier is recomputed (the top-up below evens the counts again)
                for r, f in open_frontiers(group_constraint, active.nonzero().flatten().tolist(), T):
                    selector.next_rows[r, f] = True
            rows = selector.rows_for(active)
            if Ba == N:   # every row (a request alone: always): the cache itself, nothing gathered or written back
                sub = cache
            else:
                sub = D2KVCache(None if cache.key_bias is None else cache.key_bias[active])
                sub.k, sub.v = ({layer: t[active] for layer, t in kv.items()} for kv in (cache.k, cache.v))
            if rows is None:   # the first forward: every position (of every row: block 0 is all masks)
                sub.full()
                rows = torch.ones_like(xa, dtype=torch.bool)
            else:
                sub.partial(rows)
            n = int(rows[0].sum())
            part = yield ForwardRequest(xa[rows].view(Ba, n), cache=sub, per_row={
                "position_ids": positions[active][rows].view(Ba, n)})
            logits = part.new_zeros((Ba, T, part.shape[-1])).masked_scatter(rows[..., None], part)
            if sub is not cache:   # the active rows' K/V written back in place
                for whole, fresh in ((cache.k, sub.k), (cache.v, sub.v)):
                    for layer, t in fresh.items():
                        whole[layer][active] = t
            stats.forward(Ba, n, cache.nbytes)
            keep = None
            if group_constraint is not None:   # the frontier masked before the scores (parts/constrain.py)
                sub_constraint = group_constraint.rows(active.nonzero().flatten().tolist())
                logits = sub_constraint.mask_frontier(logits, P, T, P)
                keep = partial(_keep_accepted, sub_constraint, xa, logits, block[active], start, end, P, mask_id)
            step = _Step(selector, active, xa, logits[:, P:], masked[active], block[active], sub.rollout, keep)
            # one request's step (a group of one row, no structure) settles with the others' of one setting
            key = None if N > 1 or keep is not None else (_Step, config, G, per_step, prior_sigma, allow_mask, mask_id)
            new, committed = yield Together(key, partial(_settle, per_step, prior_sigma, allow_mask, mask_id), (step,))
            x[active] = new
            stats.step(committed.sum())
            if not bool((x[:, start:end] == mask_id).any()):
                final = end - P   # this block is done (earlier blocks are)
            yield Progress(x, final)
    return x


def _keep_accepted(constraint: Any, x: torch.Tensor, logits: torch.Tensor, open_block: torch.Tensor, start: int,
                   end: int, P: int, mask_id: int, new: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """Keep in `new` what the structure accepts and advance its matchers; the block's positions it kept committed."""
    constraint.filter(new, x[:, start:end], x0[:, start - P:end - P], logits, start, end, start)
    return open_block & (new[:, P:] != mask_id)

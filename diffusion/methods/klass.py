"""KLASS: KL-adaptive stability sampling (Kim et al., NeurIPS 2025, arXiv 2511.05664; shkim0116/KLASS).

A masked position is committed when it is both confident and stable: its argmax probability (float64
softmax) passes `conf_threshold` and the KL divergence of its predicted distribution from the previous
forward's, ``Σ p·(log(p + 1e-12) − log(p_prev + 1e-12))``, stayed below `kl_threshold` over the last
`kl_history_length` forwards (before any forward, p_prev = 0 and the history holds zeros).
`unmask_strategy`: "all" commits every ready position, "max_conf" the most confident, "min_kl" the one
of least KL, "random" one drawn (`torch.randint` over a row's ready positions, when more than one, from the
call's `generator`: KLASS's own loop only). A row with none ready falls back to its most confident masked positions.

As a commit rule (SDAR's and LLaDA2's loops, Elastic-Cache's window) it is Dream's: memory over one
block's forwards, ``confidence >= conf_threshold``, one position as the fallback. KLASS's own loop
(`klass_steps`; registry name "klass") is the official one of each layout, row by row as alone:
* LLaDA (`llada_klass.stable_confident_decode`): blocks of `block_length` after the prompt, each iterated
  while it holds a mask; a position is stable only from the block's `kl_history_length`-th forward on,
  ``confidence > conf_threshold``, and the fallback commits LLaDA's schedule count (`steps` over the
  blocks) by confidence. The KL memory runs across blocks: each forward scores the next block too.
* Dream (`dream_klass.py`'s `alg="klass"`): the same loop with Dream's rule (one block with
  ``block_length = max_new_tokens``, as upstream; `steps` is upstream's cap, which lifting never changes).
Departures (docs/quirks.md): a block is iterated until it holds no mask (upstream's LLaDA loop stops after
its `steps` share, Dream's after `steps`, masks left), one position a forward past the schedule; a
fallback takes at most the masks left (upstream's top-k overwrote decoded or prompt tokens); the mask
token is never proposed. `temperature` > 0 samples as upstream: LLaDA's
loop noises every forward's logits; Dream's commits greedy tokens and draws only in the fallback, which takes the
masked position whose token drawn from softmax(logits / T) is the most probable (`top_p` / `top_k` refused). The
draws ("random"'s too, after LLaDA's noise) come from the call's `generator`: rows of a batch one after another,
each request its own in the engine.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from remask.models.spec import ModelSpec

from ..families.llada import validate_block_args
from ..parts.checks import check_choice, check_config, check_int, check_method_call, check_real, checked
from ..parts.constrain import CommitFilter, before_rule, end_ids_of
from ..parts.scoring import draw_categorical, gumbel_max_scores
from ..parts.selection import schedule_counts
from ..parts.stats import GenerationStats
from ..parts.step import CommitRule, masked_canvas
from ..parts.stepper import ForwardRequest, Progress, StepGenerator, row_by_row

EPS = 1e-12   # upstream's: log(p + eps)


@dataclass(frozen=True)
class KLASS(CommitRule):
    """Commit the masked positions that are confident (≥ `conf_threshold`) and stable (KL below
    `kl_threshold` over the last `kl_history_length` forwards), by `unmask_strategy`; else the most
    confident one (module docstring). Greedy."""

    name = "klass"
    conf_threshold: float = checked(0.9, check_real)
    kl_threshold: float = checked(0.01, check_real)
    kl_history_length: int = checked(2, check_int, minimum=1)
    unmask_strategy: str = checked("all", check_choice, choices=("all", "max_conf", "min_kl", "random"))

    def check_greedy(self, loop: str) -> None:
        if self.unmask_strategy == "random":
            raise ValueError(f"unmask_strategy: 'random' draws from the call's generator in KLASS's own loop (LLaDA, "
                             f"Dream); {loop}'s loop runs commit rules greedily: use 'all', 'max_conf' or 'min_kl'")

    def new_state(self) -> "Stability":
        return Stability(self.kl_history_length if self.kl_threshold > 0 else 0)

    def commit(self, block: torch.Tensor, logits: torch.Tensor, mask_id: int,
               state: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`logits` `[B, n ≥ L, V]`: the block's positions first; the others (KLASS's loop: the next block)
        are scored for the KL memory only."""
        if not isinstance(state, Stability):
            raise ValueError("KLASS keeps a KL history over a block's forwards: pass state=rule.new_state()")
        L = block.shape[1]
        p = torch.softmax(logits.to(torch.float64), dim=-1)
        log_p = torch.log(p + EPS)
        kl = (p * (log_p - _carried(state.log_prev, log_p, math.log(EPS), log_p.dtype))).sum(dim=-1)
        passed = kl < self.kl_threshold
        streak = _carried(state.streak, passed, state.initial, torch.long)
        state.streak = torch.where(passed, (streak + 1).clamp(max=self.kl_history_length), 0)
        state.log_prev = log_p
        x0 = logits.index_fill(-1, torch.tensor([mask_id], device=logits.device), -math.inf).argmax(dim=-1)[:, :L]
        conf, kl = p[:, :L].gather(-1, x0.unsqueeze(-1)).squeeze(-1), kl[:, :L]
        masked = block == mask_id
        confident = conf > self.conf_threshold if state.llada else conf >= self.conf_threshold
        ready = confident & (state.streak[:, :L] >= self.kl_history_length) & masked
        if state.llada and state.calls < self.kl_history_length - 1:
            ready = torch.zeros_like(ready)   # LLaDA's loop: from the block's H-th forward on
        state.calls += 1
        if self.unmask_strategy != "all":
            key = {"max_conf": conf, "min_kl": -kl}.get(self.unmask_strategy)
            key = torch.where(ready, _drawn(state.generator, ready) if key is None else key, -math.inf)
            ready = ready & torch.zeros_like(ready).scatter(-1, key.argmax(dim=-1, keepdim=True), True)
        budget = torch.ones_like(masked[:, 0], dtype=torch.long) if state.budget is None else state.budget
        if state.layout is not None:   # upstream's LLaDA loop (one row): torch.topk over the canvas, its tie order
            T, start = state.layout
            canvas = torch.full((T,), -math.inf, dtype=conf.dtype, device=conf.device)
            canvas[start:start + L] = torch.where(masked[0], conf[0], -math.inf)
            picked = torch.topk(canvas, k=int(budget[0])).indices - start
            fallback = torch.zeros_like(masked).index_fill_(1, picked[(picked >= 0) & (picked < L)], True) & masked
        else:
            score = torch.where(masked, conf, -math.inf)
            if state.draw is not None and not bool(ready.any()):   # Dream's loop at T > 0: a drawn token's probability
                score = score.masked_scatter(masked, state.draw(logits[:, :L][masked]).to(score.dtype))
            ranks = score.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)   # each position's place
            fallback = (ranks < budget[:, None]) & masked
        commit = torch.where(ready.any(dim=-1, keepdim=True), ready, fallback)
        return commit, torch.where(commit, x0, block)


class Stability:
    """KLASS's memory (`KLASS.new_state()`): the previous forward's log(p + eps) `[B, n, V]`, each
    position's run of forwards (≤ H) whose KL stayed below the threshold, the forwards of the block; KLASS's
    loop sets `llada` (its LLaDA rule) and `budget` (the fallback's count per row, None: one)."""

    def __init__(self, initial_streak: int) -> None:
        self.initial, self.log_prev, self.streak = initial_streak, None, None
        self.calls, self.llada, self.budget, self.layout, self.draw, self.generator = 0, False, None, None, None, None

    def next_block(self, length: int) -> None:
        """Drop the finished block's positions: the memory of the positions after it stays."""
        self.log_prev = None if self.log_prev is None else self.log_prev[:, length:]
        self.streak = None if self.streak is None else self.streak[:, length:]
        self.calls = 0


def klass_steps(spec: ModelSpec, prompt: torch.Tensor, *, config: KLASS | None = None,
                steps: int | None = None, gen_length: int = 128, block_length: int = 128,
                attention_mask: torch.Tensor | None = None, mask_id: int | None = None,
                stats: GenerationStats | None = None, structure: Any = None, end_ids: Any = (),
                temperature: float = 0.0, generator: torch.Generator | None = None) -> StepGenerator:
    """KLASS's loop (module docstring) as a step generator, its arguments checked at the call: a
    `ForwardRequest` per forward (the block and the next, against the whole canvas), a `Progress` after
    each; returns `[B, P + gen_length]`. `steps`: LLaDA's schedule (None: `gen_length`). `temperature` > 0
    (LLaDA's loop): upstream's noise, each forward's logits → ``exp(logits) / (−log u)^temperature`` with float64
    uniforms u over the whole canvas drawn from `generator`, and every rule reads the softmax of those; (Dream's
    loop) each fallback's `torch.multinomial` over the masked positions' softmax(logits / T) (`_sampled_confidence`)."""
    config = check_config("decoder", config, KLASS, "a remask.KLASS")
    steps = gen_length if steps is None else steps
    validate_block_args(gen_length, block_length, steps)
    check_real("temperature", temperature, low=0)
    spec, stats = check_method_call(spec, prompt, attention_mask, stats, generator=generator, mask_id=mask_id)
    x = masked_canvas(prompt, gen_length, spec.mask_id)
    P, T, mask_id, ends = prompt.shape[1], x.shape[1], spec.mask_id, end_ids_of(spec, end_ids)
    steps_per_block = steps * block_length // gen_length

    @torch.no_grad()
    def decode_row(rows: slice, mask: torch.Tensor | None) -> StepGenerator:
        """The KLASS loop of `x[rows]`, one row alone (upstream's LLaDA loop is one row; its Dream fallback mixes
        rows), the structure held by `parts/constrain.py`'s filter."""
        row, constraint = x[rows], CommitFilter.start(structure, ends, 1, mask_id, P, T - P)
        inputs = spec.forward_inputs(mask, T)
        state = config.new_state()
        state.llada = not spec.logit_shift
        if temperature > 0 and not state.llada:
            state.draw = partial(_sampled_confidence, temperature, generator)
        state.generator = generator   # unmask_strategy="random"
        for start in range(P, T, block_length):
            block, hi = row[:, start:start + block_length], min(start + 2 * block_length, T)
            schedule = schedule_counts(block == mask_id, steps_per_block) if state.llada else None
            step = 0
            while bool((block == mask_id).any()):
                state.budget = schedule[:, step] if schedule is not None and step < steps_per_block else None
                state.layout = (T, start) if state.llada else None
                logits = yield ForwardRequest.call(row, inputs, spec=spec, rows=slice(start, hi))
                if temperature > 0 and state.llada:   # LLaDA's noise, over every position (the rule reads two blocks)
                    u = torch.rand((1, T, logits.shape[-1]), dtype=torch.float64, device=logits.device,
                                   generator=generator)
                    logits = gumbel_max_scores(logits, temperature, noise=u[:, start:hi])
                # the frontier masked before the rule scores (and keeps its KL memory)
                logits, prior = before_rule(constraint, logits, block, start, start + block_length, 0)
                commit, tokens = config.commit(block, logits, mask_id, state)
                block[commit] = tokens[commit]
                if constraint is not None:   # keep what the structure accepts; an end token fills the rest
                    constraint.filter(row, prior, tokens, logits, start, start + block_length, 0)
                    commit = (prior == mask_id) & (block != mask_id)
                stats.forward(1, T)
                stats.step(commit.sum())
                step += 1
                yield Progress(row, start - P)
            state.next_block(block_length)
        return row

    return row_by_row(x, decode_row, attention_mask, stats, prompt.shape[0] * gen_length)


def _carried(kept: torch.Tensor | None, like: torch.Tensor, fill: float, dtype: torch.dtype) -> torch.Tensor:
    """The memory `kept` of the previous forward's positions (None: no forward yet) for `like`'s positions, in
    `like`'s shape: `fill` where no forward scored them yet (log(eps) for log(p_prev + eps), the initial streak)."""
    out = torch.full(like.shape, fill, dtype=dtype, device=like.device)
    if kept is not None:
        n = min(kept.shape[1], like.shape[1])
        out[:, :n] = kept[:, :n]
    return out


def _sampled_confidence(temperature: float, generator: torch.Generator | None, logits: torch.Tensor) -> torch.Tensor:
    """Upstream's Dream fallback score (`sample_tokens`): per row of `logits` `[n, V]` (the masked positions), the
    probability under softmax(logits / T) of a token drawn from it (one `torch.multinomial`, as `Categorical`)."""
    probs = torch.softmax(logits / temperature, dim=-1)
    return probs.gather(-1, draw_categorical(probs, generator, renormalize=True)[:, None])[:, 0]


def _drawn(generator: torch.Generator | None, ready: torch.Tensor) -> torch.Tensor:
    """Upstream's "random" (both loops): in each row with more than one ready position, rows in turn, the one at
    ``torch.randint(0, n, (1,))`` among its n (in position order) scores 1, the others 0."""
    key, device = torch.zeros(ready.shape, device=ready.device), None if generator is None else generator.device
    for b, row in enumerate(ready):
        where = row.nonzero()[:, 0]
        if len(where) > 1:
            key[b, where[torch.randint(0, len(where), (1,), generator=generator, device=device)]] = 1
    return key

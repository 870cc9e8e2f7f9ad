"""dKV-Cache (horseee/dKV-Cache; docs/decoders.md) for LLaDA and Dream: one loop (`_loop`: the cached
forwards, the reloads, the delay) with each family's part (`_LLaDARule`, `_DreamRule`: its spans and
schedule, scoring and commit, logit shift and delay rule).

LLaDA (`generation_utils/llada_dkv_cache_decode.py` and `llada_dkv_cache_greedy.py`, with
`models/modeling_llada_dkv_cache_decode.py`): LLaDA's block schedule with a delayed K/V cache,
dropped at each block's start. With R = `cache_reloading_step`, dKV-Cache-Decode (LLaDA's top-k
commits, `low_confidence` or `random`) runs
- step 0: a full forward, nothing cached;
- step 1 and every step i with i % R == 0: a full forward that (re)builds the cache: the keys and
  values of every position decoded before this step (prompt included);
- any other step i: a forward of only the positions still masked after step i − 2, attending over
  themselves and the cache; the cache then takes the positions decoded at step i − 1 from this
  forward (a token enters the cache one step after it is decoded: the delay, Dream's ``"right"``)
  and keeps the others. Skipped positions get confidence −inf.
dKV-Cache-Greedy decodes each block in an order drawn per block (one float32 `torch.rand` uniform per
position): steps i % R == 0 forward and cache everything; the others forward only the positions
chosen at step i − 1 (those decoded then and now, and the window) and cache them at once.

Keys attend in the reference's order (forwarded positions, then cached ones, each ascending), so
float32 logits are the reference's. `DelayedKVCache` plugs into the model's KV-cache seam (`attend`);
every forward is a `ForwardRequest` (`diffusion/parts/stepper.py`), packed with other sequences' in
the engine (`varlen.PackedAttention`).

Dream (`generation_utils/dream_generation_utils.py` `_sample` with its `models/modeling_dream.py`,
`dkv_dream_generate`): Dream's whole-canvas loop and commit rule (`DreamDecoder.commit`) with a
delayed K/V cache. `prev`: the positions the cache holds during a
step's forward; `store`: those it holds afterwards, at the start every position whose *next* token
is a prompt token (the logit shift: hidden state i scores token i + 1).
- A step with no cache (the first; with ``cache_type="decoded"`` also every step i with
  i % `cache_reloading_step` == 0) forwards the whole sequence and caches the store's positions.
- Any other step forwards only the positions outside `prev` (keys in the reference order above)
  and caches the store's positions, fresh where forwarded, else kept.
- After each step, ``"decoded"``: `prev` takes the store and the store is recomputed (the delay), by
  `shift_type`: ``"un"`` position i once token i + 1 is decoded (T − 1 follows token 0),
  ``"un_right"`` once tokens i and i + 1 are (T − 1 follows T − 2), ``"right"`` once token i is.
  ``"prefill"``: the first step's store stays cached for the whole generation.
In these terms (`_loop` runs both families) LLaDA's Decode is the ``"decoded"`` cache with
``"right"`` in each block, its first step a plain forward (no store yet); Greedy's `prev` is every
position but those chosen for the next forward, its store every position.

Positions without a forward have no logits (upstream fills −inf): under ``"right"`` a masked position
right after a cached one gets confidence NaN, which `torch.topk` ranks first, and id 0, as upstream.
Keys are cached after RoPE (upstream re-rotates cached pre-RoPE keys: the same numbers). Rows whose
counts differ (only ``"un_right"``) run one by one, each its own cache (upstream would fail there).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Generator, Iterator

import torch

from remask.caches import DelayedKVCache, key_bias
from remask.models.spec import ModelSpec, shift_logits

from ..families.dream import DreamDecoder, DreamGenerationConfig, _validate_config
from ..families.llada import REMASKING, validate_block_args
from ..parts.cache import valid_positions
from ..parts.checks import (NoWorkBound, check_bool, check_choice, check_config, check_generator, check_int,
                            check_length, check_method_call, checked)
from ..parts.constrain import CommitFilter, end_ids_of
from ..parts.constrain_loops import open_frontiers
from ..parts.scoring import score_tokens
from ..parts.selection import schedule_counts, topk_commit
from ..parts.stats import GenerationStats
from ..parts.step import masked_canvas
from ..parts.stepper import ForwardRequest, Progress, StepGenerator, drop_in

VARIANTS = ("decode", "greedy")
DREAM_CACHE_TYPES = ("decoded", "prefill")
DREAM_SHIFT_TYPES = ("un", "un_right", "right")
ALGORITHMS = ("origin", "maskgit_plus", "topk_margin", "entropy")   # Dream's


@dataclass(frozen=True)
class DKVCache(NoWorkBound):
    """dKV-Cache's parameters (the module docstring): `cache_reloading_step` (upstream's; its README
    uses 8 for Decode, the Greedy CLI `--cache-steps 2`), `variant` ``"decode"`` or ``"greedy"``
    (`remasking="random"` only) and Greedy's `window_size` (masked neighbours forwarded with each
    position decoded next). `commit_mask_token=True` reproduces upstream when the argmax is the mask
    token (committed, the position stays masked); by default the most probable other token is.
    Dream's sampler (`dkv_dream_generate`) reads two more fields, None for LLaDA:
    `cache_type` ``"decoded"`` (its default; rebuilt every `cache_reloading_step` steps, upstream's
    `cache_steps`) or ``"prefill"`` (the prompt cached once), and `shift_type` (``"decoded"`` only)
    ``"un"`` (its default), ``"un_right"`` or ``"right"``.

    No work bound (`NoWorkBound`): a `cache_reloading_step` past the steps per block reloads at a block's first
    step only, and Greedy's window takes at most the masked positions (`_window` stops when none is left); neither
    costs more work (upstream takes any)."""

    cache_reloading_step: int = checked(8, check_int, minimum=1)
    commit_mask_token: bool = checked(False, check_bool)
    variant: str = checked("decode", check_choice, choices=VARIANTS)
    window_size: int = checked(0, check_int, minimum=0)
    cache_type: str | None = checked(None, check_choice, choices=DREAM_CACHE_TYPES + (None,))
    shift_type: str | None = checked(None, check_choice, choices=DREAM_SHIFT_TYPES + (None,))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window_size and self.variant != "greedy":
            raise ValueError(f"window_size: only dKV-Cache-Greedy (variant='greedy') forwards a window, got "
                             f"{self.window_size} with variant={self.variant!r}")
        dream = self.dream_fields
        if dream and self.variant != "decode":
            raise ValueError(f"{dream[0]}: Dream's dKV-Cache (cache_type / shift_type) has no "
                             f"variant={self.variant!r}; it is dKV-Cache-Decode's (variant='decode')")
        if self.shift_type is not None and self.cache_type == "prefill":
            raise ValueError(f"shift_type: the prefill cache holds the prompt only; shift_type={self.shift_type!r} "
                             "applies to cache_type='decoded'")
        if self.commit_mask_token and dream:
            raise ValueError("commit_mask_token: Dream's sampler never commits the mask token in remask; "
                             f"commit_mask_token=True is LLaDA-only (got {dream[0]}={getattr(self, dream[0])!r})")

    @property
    def dream_fields(self) -> list[str]:
        """The Dream-only fields set (empty for a LLaDA configuration)."""
        return [name for name in ("cache_type", "shift_type") if getattr(self, name) is not None]


def _regroup(groups: list[list[int]], caches: list[DelayedKVCache], B: int, rebuild: bool, uniform: bool,
             key_ok: torch.Tensor | None, merge: bool = False) -> tuple[list[list[int]], list[DelayedKVCache]]:
    """The row groups forwarded together and their caches: one batched forward while every row forwards
    and caches as many positions (`uniform`), else one per row, each with its own cache. `rebuild`:
    new caches; else a batched cache is split when no longer `uniform` (with `merge`, joined again)."""
    if rebuild:
        groups = [list(range(B))] if uniform else [[b] for b in range(B)]
        return groups, [DelayedKVCache(None if key_ok is None else key_ok[g]) for g in groups]
    if len(groups) == 1 and B > 1 and not uniform:
        return [[b] for b in range(B)], [_joined([(caches[0], slice(b, b + 1))]) for b in range(B)]
    if merge and len(groups) > 1 and uniform:   # the rows' caches hold the same positions
        return [list(range(B))], [_joined([(c, slice(None)) for c in caches])]
    return groups, caches


def _joined(parts: list[tuple[DelayedKVCache, slice]]) -> DelayedKVCache:
    """One cache of the given rows of caches, stacked in order."""
    head = parts[0][0]
    out = DelayedKVCache(None if head.key_ok is None else torch.cat([c.key_ok[r] for c, r in parts]))
    out.cached = torch.cat([c.cached[r] for c, r in parts])
    out.k = {layer: torch.cat([c.k[layer][r] for c, r in parts]) for layer in head.k}
    out.v = {layer: torch.cat([c.v[layer][r] for c, r in parts]) for layer in head.v}
    return out


def _forward(x: torch.Tensor, positions: torch.Tensor, forwarded: torch.Tensor | None, cache: DelayedKVCache,
             store: torch.Tensor | None) -> Generator[ForwardRequest, Any, torch.Tensor]:
    """Logits `[B, n, V]` of the forwarded positions (all when `forwarded` is None): one `ForwardRequest`
    (``yield from``), the cache told its part before and taking its new positions after. `store`
    None: a plain forward (no cache; `cache.key_ok` hides the pad keys)."""
    if store is None:
        bias = key_bias(cache.key_ok, torch.float32)
        return (yield ForwardRequest(x, per_row={} if bias is None else {"attention_bias": bias}))
    if forwarded is None:
        cache.fill(store)
    else:
        cache.reuse(forwarded, store)
        x, positions = x[forwarded].view(x.shape[0], -1), positions[forwarded].view(x.shape[0], -1)
    logits = yield ForwardRequest(x, per_row={"position_ids": positions}, cache=cache)
    cache.finish()
    return logits


def _window(chosen: torch.Tensor, around: list[int], masked: torch.Tensor, size: int) -> None:
    """dKV-Cache-Greedy's window, in place on `chosen` `[T]`: for each position of `around` (in its
    order) the `size` nearest masked positions not chosen yet, alternating left and right."""
    T = chosen.shape[0]
    for pos in around:
        near = (at for d in range(1, T) for at in (pos - d, pos + d) if 0 <= at < T)   # nearest first, left first
        chosen[list(itertools.islice((at for at in near if not chosen[at] and masked[at]), size))] = True


def dkv_steps(spec: ModelSpec, prompt: torch.Tensor, *, config: DKVCache | None = None,
              steps: int = 128, gen_length: int = 128, block_length: int = 128,
              remasking: str = "low_confidence", attention_mask: torch.Tensor | None = None,
              generator: torch.Generator | None = None, mask_id: int | None = None,
              stats: GenerationStats | None = None, structure: Any = None, end_ids: Any = ()) -> StepGenerator:
    """`dkv_generate` as a step generator (`remask.diffusion.parts.stepper`): the arguments are checked now;
    the generator yields a `ForwardRequest` per forward and a `Progress` after it (`final`: the
    decoded blocks) and returns `dkv_generate`'s tensor. `structure` (a compiled `remask.structured`
    structure) and `end_ids`: structured output (`diffusion/parts/constrain.py`; how each variant
    holds it, extra steps and forwarded frontiers included: docs/quirks.md)."""
    config = check_config("config", config, DKVCache, "a remask DKVCache")
    spec, stats = check_method_call(spec, prompt, attention_mask, stats, mask_id=mask_id)
    if config.dream_fields:
        name = config.dream_fields[0]
        raise ValueError(f"{name}: a Dream-only field (dkv_dream_generate); LLaDA's dKV-Cache takes "
                         f"cache_reloading_step, variant, window_size, commit_mask_token (got {name}="
                         f"{getattr(config, name)!r})")
    _, steps_per_block = validate_block_args(gen_length, block_length, steps)
    check_choice("remasking", remasking, REMASKING)
    check_generator(generator, spec.device)
    if config.variant == "greedy" and remasking != "random":
        raise ValueError(f"remasking: dKV-Cache-Greedy decodes in a random order drawn per block "
                         f"(remasking='random'), got {remasking!r}")
    B, P = prompt.shape
    constraint = CommitFilter.start(structure, end_ids_of(spec, end_ids), B, spec.mask_id, P, gen_length)
    x = masked_canvas(prompt, gen_length, spec.mask_id, spec.device)
    rule = _LLaDARule(x, P, config, spec.mask_id, steps_per_block, block_length, remasking, generator, constraint)
    return _loop(rule, None, attention_mask, P, stats)


@drop_in(dkv_steps)
def dkv_generate() -> torch.Tensor:
    """dKV-Cache-Decode or -Greedy (greedy tokens). Returns `[B, P + gen_length]`.

    `remasking="random"` draws the uniforms as upstream (float32 `torch.rand`) from `generator` (None:
    torch's global generator). `attention_mask` `[B, P]` (left padding) hides pad keys (upstream has
    none). Rows whose forwarded sets differ in size (only with `commit_mask_token`) are forwarded one
    by one, each with its own cache."""


def dkv_dream_steps(spec: ModelSpec, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    *, config: DKVCache | None = None, steps: int = 512, max_new_tokens: int,
                    alg: str = "origin", alg_temp: float | None = None, temperature: float = 0.0,
                    top_p: float | None = None, top_k: int | None = None, eps: float = 1e-3,
                    mask_id: int | None = None, generator: torch.Generator | None = None,
                    stats: GenerationStats | None = None, structure: Any = None, end_ids: Any = ()) -> StepGenerator:
    """`dkv_dream_generate` as a step generator (`remask.diffusion.parts.stepper`): the arguments are
    checked now; the generator yields a `ForwardRequest` per forward, a `Progress` after it (`final`
    0: any masked position may be decoded at any step) and returns `dkv_dream_generate`'s tensor.
    `structure` (a compiled `remask.structured` structure) and `end_ids`: structured output, held in
    `DreamDecoder.commit` (the frontier's scorer always forwarded: docs/quirks.md)."""
    config = check_config("config", config, DKVCache, "a remask DKVCache")   # (cache_type None: "decoded")
    spec, stats = check_method_call(spec, input_ids, attention_mask, stats, "dkv_dream_generate", "input_ids",
                                    mask_id=mask_id)
    if config.variant != "decode":   # (a window_size is Greedy's)
        raise ValueError(f"variant: dKV-Cache's Dream sampler is the delayed (decode) cache; variant="
                         f"{config.variant!r} is LLaDA's dKV-Cache-Greedy (dkv_generate)")
    if config.commit_mask_token:
        raise ValueError("commit_mask_token: Dream's sampler never commits the mask token in remask; "
                         "commit_mask_token=True is LLaDA-only (dkv_generate)")
    if not spec.logit_shift:
        raise ValueError("model: dKV-Cache's Dream sampler caches by the logit shift (position i scores token "
                         "i + 1, ModelSpec.logit_shift); this model scores each position from itself — use "
                         "remask.diffusion.methods.dkv.dkv_generate (LLaDA's dKV-Cache)")
    check_int("max_new_tokens", max_new_tokens, minimum=1)
    T = input_ids.shape[1] + max_new_tokens
    gen = DreamGenerationConfig(temperature=temperature, top_p=top_p, top_k=top_k, max_length=T,
                                max_new_tokens=max_new_tokens, eps=eps, steps=steps, alg=alg, alg_temp=alg_temp,
                                mask_token_id=spec.mask_id, pad_token_id=spec.pad_id, eos_token_id=spec.eos_id)
    _validate_config(gen, spec)
    if alg not in ALGORITHMS:
        raise ValueError(f"alg must be one of {list(ALGORITHMS)} (dKV-Cache's Dream sampler), got {alg!r}")
    if temperature != 0:
        raise ValueError(f"temperature: dkv_dream_generate decodes greedily (temperature=0), got {temperature!r}")
    check_length(spec, T, "prompt + max_new_tokens")
    check_generator(generator, input_ids.device)

    decoder = DreamDecoder(spec, gen, reference_ties=True, structure=structure, end_ids=end_ids)
    state = decoder.start(input_ids, attention_mask)
    positions = state.forward_inputs.get("position_ids")   # Dream's own under left padding
    return _loop(_DreamRule(decoder, state, config, steps, generator),
                 positions if torch.is_tensor(positions) else None, attention_mask, state.prompt_len, stats)


@drop_in(dkv_dream_steps, structured="max_new_tokens")
def dkv_dream_generate() -> torch.Tensor:
    """dKV-Cache's Dream sampler (greedy tokens). Returns `[B, P + max_new_tokens]`.

    `config`: a `DKVCache` (`cache_type` None: ``"decoded"``; `shift_type` None: ``"un"``). The other
    arguments are Dream's `diffusion_generate`'s; `temperature` must be 0 (`top_p` / `top_k` still filter
    the confidences, as upstream); `alg="origin"` draws from `generator` (None: torch's global one, as
    upstream). The model must shift its logits (`ModelSpec.logit_shift`). `structured_outputs` (a
    `remask.StructuredOutputsParams` or its JSON; `tokenizer`: default the checkpoint's): see
    `dkv_dream_steps`."""


@torch.no_grad()
def _loop(rule: Any, positions: torch.Tensor | None, attention_mask: torch.Tensor | None, P: int,
          stats: GenerationStats) -> StepGenerator:
    """dKV-Cache's loop, both families (the module docstring); `rule` (`_LLaDARule`, `_DreamRule`) is what
    differs. Each span of `rule.spans()` (LLaDA's blocks, Dream's canvas; it yields the first `store`)
    starts new caches; then each step: every `rule.reload` steps (None: never) a full forward rebuilding
    the cache (`prev` None); under a structure, with `rule.frontier_forwarded`, the position scoring each
    row's frontier (`rule.shift` before it) forwarded; the forwards (rows batched while they forward and
    cache as many positions, `_regroup`) of every position outside `prev`, caching `store` (None: `prev`;
    both None: a plain forward); `rule.commit`; `rule.delay`.
    `positions`: the RoPE positions `[B, T]` (None: 0 … T − 1); the left pads' keys are hidden."""
    x, constraint = rule.x, rule.constraint
    B, T = x.shape
    if positions is None:
        positions = torch.arange(T, device=x.device)[None].expand(B, T)
    key_ok = valid_positions(attention_mask, T)   # False on the left pads
    stats.start()
    for store in rule.spans():
        prev, groups, caches = None, [], []
        for i in itertools.takewhile(lambda i: not rule.finished(i), itertools.count()):
            if rule.reload and i % rule.reload == 0:
                prev = None
            if constraint is not None and prev is not None and rule.frontier_forwarded:
                prev = prev.clone()
                for b, f in open_frontiers(constraint, range(B), T):
                    prev[b, max(f - rule.shift, 0)] = False
            forwarded, cached = None if prev is None else ~prev, prev if store is None else store
            # whether every row forwards and caches as many positions
            uniform = all(bool((s.sum(dim=1) == s[0].sum()).all()) for s in (cached, forwarded) if s is not None)
            groups, caches = _regroup(groups, caches, B, forwarded is None, uniform, key_ok, rule.merge)
            parts = []   # each forward's (rows, logits, forwarded positions)
            for g, cache in zip(groups, caches):
                fwd = None if forwarded is None else forwarded[g]
                if fwd is not None and not bool(fwd.any()):
                    continue   # nothing to forward (a structure ended the row)
                if parts:
                    yield Progress(x, rule.final)   # the previous row's forward (rows forwarded one by one)
                logits = yield from _forward(x[g], positions[g], fwd, cache, None if cached is None else cached[g])
                stats.forward(len(g), logits.shape[1], sum(c.nbytes for c in caches))
                parts.append((g, logits, fwd))
            # nothing forwarded: every row ended (a structure) or was decoded (Dream's steps outlasting
            # its masks, every position cached) — nothing to commit
            committed = rule.commit(i, parts) if parts else 0
            stats.step(committed)
            prev, store = rule.delay(prev, store)
            yield Progress(x, rule.final)
    stats.stop(B * (T - P))
    return x


class _Rule:
    """What both families' parts of `_loop` share: the delay (`shift_type`; LLaDA's: ``"right"``)."""

    # the delay's shift type; the logit shift (position i − shift scores token i); `Progress.final` (0: none yet)
    shift_type, shift, final = "right", 0, 0

    def delay(self, prev: torch.Tensor | None, store: torch.Tensor | None) -> tuple[torch.Tensor | None, Any]:
        """After a step: the positions cached during the next forward (this step's `store`; under a structure less
        the revoked ones) and after it, by `shift_type`."""
        decoded = self.x != self.mask_id
        if self.shift_type == "un":
            decoded = torch.cat([decoded[:, 1:], decoded[:, :1]], dim=1)
        elif self.shift_type == "un_right":
            both = decoded[:, :-1] & decoded[:, 1:]
            decoded = torch.cat([both, both[:, -1:]], dim=1)
        if self.constraint is not None and store is not None:
            store = store & decoded   # a revoked position (or its scorer) leaves the cached set
        return store, decoded


class _LLaDARule(_Rule):
    """LLaDA's part of `_loop`: its blocks, each with its schedule (`schedule_counts`) and new caches; the
    logits scored where forwarded (`score_tokens`; each position scores itself); Decode's top-k commit by
    confidence or uniforms (`topk_commit`) with the delayed cache (`_Rule.delay`, ``"right"``; its forwards
    hold every masked position, the frontier included), Greedy's commits in the block's drawn order, its
    next forward (the positions decoded then and now, and the window) cached at once."""

    def __init__(self, x: torch.Tensor, P: int, config: DKVCache, mask_id: int, steps: int, block_length: int,
                 remasking: str, generator: torch.Generator | None, constraint: Any) -> None:
        self.x, self.P, self.config, self.mask_id, self.steps = x, P, config, mask_id, steps
        self.block_length, self.remasking, self.generator = block_length, remasking, generator
        self.constraint, self.reload = constraint, config.cache_reloading_step
        self.greedy = self.merge = self.frontier_forwarded = config.variant == "greedy"
        self.everything = torch.ones_like(x, dtype=torch.bool)

    def spans(self) -> Iterator[torch.Tensor | None]:
        x, mask_id, constraint, (B, T) = self.x, self.mask_id, self.constraint, self.x.shape
        for start in range(self.P, T, self.block_length):
            end = start + self.block_length
            self.start, self.end = start, end
            if constraint is not None and not any(constraint.unsettled(x, start, end)):
                continue   # every row's answer is settled through this block (ended or decoded)
            self.counts = schedule_counts(x[:, start:end] == mask_id, self.steps)   # [B, steps]
            if self.greedy:
                self.done = torch.cat([self.counts.new_zeros((B, 1)), self.counts.cumsum(dim=1)], dim=1)
                order_p = torch.rand((B, T), generator=self.generator, device=x.device)
                order_p[:, end:] = order_p[:, :start] = -torch.inf   # outside the block: last in the order
                self.order = torch.sort(order_p, descending=True).indices
                self.rank = self.order.argsort(dim=1)   # each position's place in the order
            yield self.everything if self.greedy else None   # Decode's step 0: a plain forward

    def finished(self, i: int) -> bool:
        return i >= self.steps and (self.constraint is None
                                    or not any(self.constraint.unsettled(self.x, self.start, self.end)))

    def commit(self, i: int, parts: list[tuple]) -> int | torch.Tensor:
        x, mask_id, constraint, steps = self.x, self.mask_id, self.constraint, self.steps
        start, end, (B, T) = self.start, self.end, x.shape
        mask_index = x == mask_id
        x0 = torch.full_like(x, mask_id)
        x0_p = torch.full(x.shape, -torch.inf, dtype=torch.float64, device=x.device)
        window_logits = None   # under a structure: the block's logits [B, block_length, V] (the filter's)
        for g, logits, fwd in parts:
            where = self.everything[g] if fwd is None else fwd
            if constraint is not None:   # the frontier masked before the rule scores (parts/constrain.py)
                positions = where.nonzero()[:, 1].view(len(g), -1)
                logits = constraint.rows(g).mask_at(logits, positions)
                if window_logits is None:   # −inf where not forwarded
                    window_logits = logits.new_full((B, end - start, logits.shape[-1]), -torch.inf)
                block_logits = window_logits[g]
                block_logits[where[:, start:end]] = logits[(positions >= start) & (positions < end)]
                window_logits[g] = block_logits
            tokens, conf = score_tokens(logits, softmax_dtype=torch.float64,
                                        exclude_id=None if self.config.commit_mask_token else mask_id)
            x0[g] = x0[g].masked_scatter(where, tokens)
            if self.remasking == "random" and not self.greedy:
                conf = torch.rand(tokens.shape, generator=self.generator, device=x.device).to(torch.float64)
            x0_p[g] = x0_p[g].masked_scatter(where, conf)
        x0 = torch.where(mask_index, x0, x)
        prior = x[:, start:end].clone() if constraint is not None else None
        if self.greedy:   # the drawn order's places [done_i, done_i+1) now (none past the schedule: the filter
            done, rank = self.done, self.rank   # commits a structure's holes); forwarded next: [done_i, done_i+2)
            transfer = (rank >= done[:, min(i, steps), None]) & (rank < done[:, min(i + 1, steps), None])
            ahead = i < steps - 1   # (and the window), none after the block's last step
            self.chosen = torch.zeros_like(transfer) if not ahead \
                else (rank >= done[:, i, None]) & (rank < done[:, i + 2, None])
            for j in range(B if ahead and self.config.window_size > 0 else 0):
                _window(self.chosen[j], self.order[j, int(done[j, i + 1]):int(done[j, i + 2])].tolist(),
                        mask_index[j], self.config.window_size)
            x[transfer] = x0[transfer]
            committed = transfer.sum()
        else:
            x0_p[:, end:] = -torch.inf
            # past the schedule (a structure's filter left holes): one token a step
            k = self.counts[:, i] if i < steps else mask_index[:, start:end].any(dim=1).long()
            committed = topk_commit(x, mask_index, x0, x0_p, k, T, 0).sum()
        if constraint is not None:   # keep what the structure accepts, advance the matchers
            constraint.filter(x, prior, x0[:, start:end], window_logits, start, end, 0)
            now_masked = x[:, start:end] == mask_id
            committed = int((prior == mask_id).sum() - now_masked.sum())
            if self.greedy:   # the next forward also refreshes the filter's commits
                self.chosen[:, start:end] |= (prior == mask_id) & ~now_masked
        if i >= steps - 1:   # decoded through this block, less any position left masked (`commit_mask_token`)
            masked = x[:, self.P:end] == mask_id
            self.final = int(torch.where(masked.any(dim=1), masked.int().argmax(dim=1), end - self.P).min())
        return committed

    def delay(self, prev: torch.Tensor | None, store: torch.Tensor | None) -> tuple[torch.Tensor | None, Any]:
        return (~self.chosen, store) if self.greedy else super().delay(prev, store)


class _DreamRule(_Rule):
    """Dream's part of `_loop`: the whole canvas one span, first caching every position whose next token
    is a prompt token; `DreamDecoder.commit` on the step's logits (−inf where not forwarded, then shifted:
    hidden state i scores token i + 1); the delay by `shift_type` (``"prefill"``: the first store kept)."""

    shift, merge, frontier_forwarded = 1, False, True

    def __init__(self, decoder: DreamDecoder, state: Any, config: DKVCache, steps: int,
                 generator: torch.Generator | None) -> None:
        self.decoder, self.state, self.steps, self.generator = decoder, state, steps, generator
        self.x, self.constraint, self.mask_id = state.x, state.constraint, decoder.spec.mask_id
        self.prefill = config.cache_type == "prefill"
        self.reload = None if self.prefill else config.cache_reloading_step
        self.shift_type = config.shift_type or "un"

    def spans(self) -> Iterator[torch.Tensor]:
        decoded = self.x != self.mask_id   # the last position follows itself
        yield torch.cat([decoded[:, 1:], decoded[:, -1:]], dim=1)

    def finished(self, i: int) -> bool:
        # under a structure: once no mask is left (the schedule, then the decoder's extra steps)
        return self.state.done if self.constraint is not None else i >= self.steps

    def commit(self, i: int, parts: list[tuple]) -> int:
        x, mask_id, decoder = self.x, self.mask_id, self.decoder
        B, T = x.shape
        logits = parts[0][1].new_full((B, T, parts[0][1].shape[-1]), -torch.inf)   # −inf where not forwarded
        for g, part, fwd in parts:
            logits[g] = part if fwd is None else logits[g].masked_scatter(fwd[..., None], part)
        logits = shift_logits(logits)   # the logit shift (spec.logit_shift)
        before = int((x == mask_id).sum())
        decoder.commit(self.state, logits, generator=self.generator)   # writes x in place
        left = x == mask_id
        if self.constraint is None and i == self.steps - 1 and bool(left.any()):
            # Only positions without logits ("right"): upstream's last top-k takes every mask, NaN
            # confidences included, with the argmax of a NaN row (id 0), which `score` also gives.
            x[left] = decoder.score(logits, left.reshape(-1).nonzero().squeeze(1))[0]
        return before - int((x == mask_id).sum())

    def delay(self, prev: torch.Tensor | None, store: torch.Tensor | None) -> tuple[Any, Any]:
        if self.prefill:
            return (store, None) if prev is None else (prev, store)
        return super().delay(prev, store)

"""dKV-Cache (horseee/dKV-Cache; docs/decoders.md) for LLaDA and Dream: one cached forward
(`_forward_rows`) and one delay rule (`_delay`), with each family's commit rule and logit shift.

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

Positions without a forward have no logits (upstream fills −inf): under ``"right"`` a masked position
right after a cached one gets confidence NaN, which `torch.topk` ranks first, and id 0, as upstream.
Keys are cached after RoPE (upstream re-rotates cached pre-RoPE keys: the same numbers). Rows whose
counts differ (only ``"un_right"``) run one by one, each its own cache (upstream would fail there).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Generator

import torch
import torch.nn.functional as F

from remask.caches.position import DelayedKVCache
from remask.models.spec import get_spec

from ..families.dream import DreamDecoder, DreamGenerationConfig, _validate_config
from ..families.llada import validate_block_args
from ..parts.cache import valid_positions
from ..parts.checks import (check_bool, check_choice, check_generator, check_instance, check_int,
                            check_length, check_mask_id, check_model_kind, check_prompt, check_stats, model_device)
from ..parts.selection import schedule_counts
from ..parts.stats import GenerationStats
from ..parts.step import masked_canvas
from ..parts.stepper import ForwardRequest, Progress, StepGenerator, drive

REMASKING = ("low_confidence", "random")
VARIANTS = ("decode", "greedy")
DREAM_CACHE_TYPES = ("decoded", "prefill")
DREAM_SHIFT_TYPES = ("un", "un_right", "right")
ALGORITHMS = ("origin", "maskgit_plus", "topk_margin", "entropy")   # Dream's


@dataclass(frozen=True)
class DKVCache:
    """dKV-Cache's parameters (the module docstring): `cache_reloading_step` (upstream's; its README
    uses 8 for Decode, the Greedy CLI `--cache-steps 2`), `variant` ``"decode"`` or ``"greedy"``
    (`remasking="random"` only) and Greedy's `window_size` (masked neighbours forwarded with each
    position decoded next). `commit_mask_token=True` reproduces upstream when the argmax is the mask
    token (committed, the position stays masked); by default the most probable other token is.
    Dream's sampler (`dkv_dream_generate`) reads two more fields, None for LLaDA:
    `cache_type` ``"decoded"`` (its default; rebuilt every `cache_reloading_step` steps, upstream's
    `cache_steps`) or ``"prefill"`` (the prompt cached once), and `shift_type` (``"decoded"`` only)
    ``"un"`` (its default), ``"un_right"`` or ``"right"``."""

    cache_reloading_step: int = 8
    commit_mask_token: bool = False
    variant: str = "decode"
    window_size: int = 0
    cache_type: str | None = None
    shift_type: str | None = None

    def __post_init__(self) -> None:
        check_int("cache_reloading_step", self.cache_reloading_step, minimum=1)
        check_bool("commit_mask_token", self.commit_mask_token)
        check_choice("variant", self.variant, VARIANTS)
        check_int("window_size", self.window_size, minimum=0)
        if self.window_size and self.variant != "greedy":
            raise ValueError(f"window_size: only dKV-Cache-Greedy (variant='greedy') forwards a window, got "
                             f"{self.window_size} with variant={self.variant!r}")
        for name, choices in (("cache_type", DREAM_CACHE_TYPES), ("shift_type", DREAM_SHIFT_TYPES)):
            if getattr(self, name) is not None:
                check_choice(name, getattr(self, name), choices)
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

    def check_request(self, *, gen_length: int | None = None, block_length: int | None = None,
                      steps: int | None = None, prompt_length: int | None = None) -> None:
        """No work bound (docs/parameters.md, "Work bounds", "Not bounded"): a `cache_reloading_step`
        past the steps per block reloads at a block's first step only, and Greedy's window takes at
        most the masked positions (`_window` stops when none is left); neither costs more work
        (upstream takes any)."""


def _counts_equal(*sets: torch.Tensor) -> bool:
    """Whether every `[B, T]` set holds as many positions in each row (True for no set)."""
    return all(bool((s.sum(dim=1) == s[0].sum()).all()) for s in sets)


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
    B = x.shape[0]
    if store is None:
        bias = DelayedKVCache._bias(cache.key_ok, torch.float32)
        return (yield ForwardRequest(x, per_row={} if bias is None else {"attention_bias": bias}))
    if forwarded is None:
        cache.fill(store)
        logits = yield ForwardRequest(x, per_row={"position_ids": positions}, cache=cache)
    else:
        cache.reuse(forwarded, store)
        logits = yield ForwardRequest(x[forwarded].view(B, -1),
                                      per_row={"position_ids": positions[forwarded].view(B, -1)}, cache=cache)
    cache.finish()
    return logits


def _forward_rows(x: torch.Tensor, positions: torch.Tensor, forwarded: torch.Tensor | None, store: torch.Tensor | None,
                  groups: list[list[int]], caches: list[DelayedKVCache], key_ok: torch.Tensor | None,
                  stats: GenerationStats | None, final: int, take: Any,
                  merge: bool = False) -> Generator[Any, Any, tuple[list[list[int]], list[DelayedKVCache]]]:
    """One step's cached forwards (``yield from``), both families: the rows regrouped (`_regroup`; new
    caches when `forwarded` is None), each group's `_forward` of its `forwarded` positions (None: all)
    caching its `store` (None: no cache), handed at once to `take(g, logits, forwarded[g])`, a
    `Progress(x, final)` between groups. A row with nothing forwarded (a structure ended it) is skipped.
    Returns the groups and their caches."""
    uniform = _counts_equal(*(s for s in (store, forwarded) if s is not None))
    groups, caches = _regroup(groups, caches, x.shape[0], forwarded is None, uniform, key_ok, merge)
    first = True
    for g, cache in zip(groups, caches):
        fwd = None if forwarded is None else forwarded[g]
        if fwd is not None and not bool(fwd.any()):
            continue
        if not first:
            yield Progress(x, final)   # the previous row's forward (rows forwarded one by one)
        first = False
        logits = yield from _forward(x[g], positions[g], fwd, cache, None if store is None else store[g])
        if stats is not None:
            stats.forward(len(g), logits.shape[1], sum(c.nbytes for c in caches))
        take(g, logits, fwd)
    return groups, caches


def _store(x: torch.Tensor, mask_id: int, shift_type: str) -> torch.Tensor:
    """`[B, T]` positions cached after a step, by `shift_type` (LLaDA's: ``"right"``)."""
    decoded = x != mask_id
    if shift_type == "un":
        return torch.cat([decoded[:, 1:], decoded[:, :1]], dim=1)
    if shift_type == "un_right":
        both = decoded[:, :-1] & decoded[:, 1:]
        return torch.cat([both, both[:, -1:]], dim=1)
    return decoded   # "right"


def _delay(store: torch.Tensor | None, x: torch.Tensor, mask_id: int, shift_type: str,
           constrained: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The delay, after a step: the positions cached during the next forward (this step's `store`;
    under a structure less the revoked ones) and after it (`_store`)."""
    prev, store = store, _store(x, mask_id, shift_type)
    if constrained and prev is not None:
        prev = prev & store   # a revoked position (or its scorer) leaves the cached set
    return prev, store


def _constrained_logits(constraint: Any, g: list[int], logits: torch.Tensor, where: torch.Tensor, start: int,
                        end: int, window_logits: torch.Tensor | None, B: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A structured step's logits of the rows `g` (`logits` `[len(g), n, V]` of the positions
    `where` `[len(g), T]`): those logits with each row's frontier (if forwarded) masked, and
    `window_logits` `[B, end - start, V]` (made at the first group; −inf where not forwarded) with
    the rows' block positions written in — the filter's window logits."""
    positions = where.nonzero()[:, 1].view(len(g), -1)
    logits = constraint.rows(g).mask_at(logits, positions)
    if window_logits is None:
        window_logits = logits.new_full((B, end - start, logits.shape[-1]), -torch.inf)
    part = logits.new_full((len(g), end - start, logits.shape[-1]), -torch.inf)
    part[where[:, start:end]] = logits[(positions >= start) & (positions < end)]
    window_logits[g] = part
    return logits, window_logits


def _final(x: torch.Tensor, P: int, upto: int, mask_id: int) -> int:
    """Generated positions no later step changes once the first `upto` are decoded: `upto`, less
    any position left masked (only with `commit_mask_token`; a later block may still decode it),
    the minimum over rows."""
    masked = x[:, P:P + upto] == mask_id
    first = torch.where(masked.any(dim=1), masked.int().argmax(dim=1), upto)
    return int(first.min())


def _window(chosen: torch.Tensor, around: list[int], masked: torch.Tensor, size: int) -> None:
    """dKV-Cache-Greedy's window, in place on `chosen` `[T]`: for each position of `around` (in its
    order) the `size` nearest masked positions not chosen yet, alternating left and right."""
    T = chosen.shape[0]
    for pos in around:
        left, right, found, go_left = pos - 1, pos + 1, 0, True
        while found < size and (left >= 0 or right < T):
            at = left if go_left else right
            if 0 <= at < T and not chosen[at] and masked[at]:
                chosen[at] = True
                found += 1
            left, right = (left - 1, right) if go_left else (left, right + 1)
            go_left = not go_left


@torch.no_grad()
def dkv_generate(model: torch.nn.Module, prompt: torch.Tensor, *, config: DKVCache | None = None,
                 steps: int = 128, gen_length: int = 128, block_length: int = 128,
                 remasking: str = "low_confidence", attention_mask: torch.Tensor | None = None,
                 generator: torch.Generator | None = None, mask_id: int | None = None,
                 stats: GenerationStats | None = None) -> torch.Tensor:
    """dKV-Cache-Decode or -Greedy (greedy tokens). Returns `[B, P + gen_length]`.

    `remasking="random"` draws the uniforms as upstream (float32 `torch.rand`) from `generator` (None:
    torch's global generator). `attention_mask` `[B, P]` (left padding) hides pad keys (upstream has
    none). Rows whose forwarded sets differ in size (only with `commit_mask_token`) are forwarded one
    by one, each with its own cache."""
    return drive(dkv_steps(model, prompt, config=config, steps=steps, gen_length=gen_length,
                           block_length=block_length, remasking=remasking, attention_mask=attention_mask,
                           generator=generator, mask_id=mask_id, stats=stats), model)


def dkv_steps(model: torch.nn.Module, prompt: torch.Tensor, *, config: DKVCache | None = None,
              steps: int = 128, gen_length: int = 128, block_length: int = 128,
              remasking: str = "low_confidence", attention_mask: torch.Tensor | None = None,
              generator: torch.Generator | None = None, mask_id: int | None = None,
              stats: GenerationStats | None = None, structure: Any = None, end_ids: Any = ()) -> StepGenerator:
    """`dkv_generate` as a step generator (`remask.diffusion.parts.stepper`): the arguments are checked now;
    the generator yields a `ForwardRequest` per forward and a `Progress` after it (`final`: the
    decoded blocks) and returns `dkv_generate`'s tensor. `structure` (a compiled `remask.structured`
    structure) and `end_ids`: structured output (`diffusion/parts/constrain.py`; how each variant
    holds it, extra steps and forwarded frontiers included: docs/quirks.md)."""
    config = check_instance("config", DKVCache() if config is None else config, DKVCache, "a remask DKVCache",
                            allow_none=False)
    if config.dream_fields:
        name = config.dream_fields[0]
        raise ValueError(f"{name}: a Dream-only field (dkv_dream_generate); LLaDA's dKV-Cache takes "
                         f"cache_reloading_step, variant, window_size, commit_mask_token (got {name}="
                         f"{getattr(config, name)!r})")
    _, steps_per_block = validate_block_args(gen_length, block_length, steps)
    check_choice("remasking", remasking, REMASKING)
    check_stats("stats", stats)
    spec = get_spec(model) if mask_id is None else get_spec(model, mask_id=mask_id)
    check_mask_id(spec)
    check_prompt(model, prompt, attention_mask, spec=spec, mask_in_prompt="refuse")
    check_generator(generator, model_device(model))
    config.check_request(gen_length=gen_length, block_length=block_length, steps=steps)
    if config.variant == "greedy" and remasking != "random":
        raise ValueError(f"remasking: dKV-Cache-Greedy decodes in a random order drawn per block "
                         f"(remasking='random'), got {remasking!r}")
    from ..parts.constrain import CommitFilter, end_ids_of

    constraint = CommitFilter.start(structure, end_ids_of(spec, end_ids), prompt.shape[0], spec.mask_id,
                                    prompt.shape[1], gen_length)
    return _steps(model, prompt, config, spec.mask_id, steps_per_block, block_length, gen_length, remasking,
                  attention_mask, generator, stats, constraint)


@torch.no_grad()
def _steps(model, prompt: torch.Tensor, config: DKVCache, mask_id: int, steps_per_block: int, block_length: int,
           gen_length: int, remasking: str, attention_mask: torch.Tensor | None, generator: torch.Generator | None,
           stats: GenerationStats | None, constraint: Any = None) -> StepGenerator:
    """dKV-Cache's LLaDA loop, both variants (the module docstring; the arguments checked by
    `dkv_steps`; `constraint`: a `CommitFilter` or None)."""
    greedy, R, device = config.variant == "greedy", config.cache_reloading_step, model_device(model)
    B, P = prompt.shape
    T = P + gen_length
    x = masked_canvas(prompt, gen_length, mask_id, device)
    key_ok = valid_positions(attention_mask, T)   # False on the left pads
    positions = torch.arange(T, device=device)[None].expand(B, T)
    everything = torch.ones((B, T), dtype=torch.bool, device=device)
    final = 0
    if stats is not None:
        stats.start()
    for num_block in range(gen_length // block_length):
        start, end = P + num_block * block_length, P + (num_block + 1) * block_length
        if constraint is not None and not any(constraint.unsettled(x, start, end)):
            continue   # every row's answer is settled through this block (ended or decoded)
        counts = schedule_counts(x[:, start:end] == mask_id, steps_per_block)   # [B, steps]
        if greedy:
            done = torch.cat([counts.new_zeros((B, 1)), counts.cumsum(dim=1)], dim=1)
            order_p = torch.rand((B, T), generator=generator, device=device)
            order_p[:, end:] = -torch.inf
            order_p[:, :start] = -torch.inf
            order = torch.sort(order_p, descending=True).indices
        groups, caches = [], []
        # Decode: the decoded positions after step i-2 / after step i-1; Greedy: those step i forwards
        prv = cur = chosen = None
        for i in itertools.count():
            if i >= steps_per_block and (constraint is None or not any(constraint.unsettled(x, start, end))):
                break
            mask_index = x == mask_id
            cached_step = i % R != 0 and (greedy or i > 1)
            store = everything if greedy else cur   # None at Decode's step 0: a plain forward
            forwarded = (chosen if greedy else ~prv) if cached_step else None
            x0 = torch.full_like(x, mask_id)
            x0_p = torch.full(x.shape, -torch.inf, dtype=torch.float64, device=device)
            window_logits = None   # under a structure: the block's logits [B, block_length, V] (the filter's)

            def take(g: list[int], logits: torch.Tensor, fwd: torch.Tensor | None) -> None:
                nonlocal window_logits
                where = everything[g] if fwd is None else fwd
                if constraint is not None:   # the frontier masked before the rule scores (parts/constrain.py)
                    logits, window_logits = _constrained_logits(constraint, g, logits, where, start, end,
                                                                window_logits, B)
                tokens = torch.argmax(logits, dim=-1)
                p = F.softmax(logits.to(torch.float64), dim=-1) if remasking == "low_confidence" else None
                if not config.commit_mask_token and bool((tokens == mask_id).any()):
                    p = F.softmax(logits.to(torch.float64), dim=-1) if p is None else p
                    others = p.index_fill(-1, torch.tensor([mask_id], device=device), -1.0).argmax(dim=-1)
                    tokens = torch.where(tokens == mask_id, others, tokens)
                x0[g] = x0[g].masked_scatter(where, tokens)
                if not greedy:
                    conf = torch.gather(p, -1, tokens[..., None]).squeeze(-1) if remasking == "low_confidence" \
                        else torch.rand((len(g), logits.shape[1]), generator=generator, device=device).to(torch.float64)
                    x0_p[g] = x0_p[g].masked_scatter(where, conf)

            groups, caches = yield from _forward_rows(x, positions, forwarded, store, groups, caches, key_ok, stats,
                                                      final, take, merge=greedy)
            x0 = torch.where(mask_index, x0, x)
            transfer = torch.zeros_like(mask_index)
            if greedy:
                chosen = torch.zeros_like(mask_index)
                for j in range(B):
                    if i >= steps_per_block:
                        break   # past the schedule (a structure's holes): the filter commits the frontier
                    now = order[j, int(done[j, i]):int(done[j, i + 1])]
                    transfer[j, now] = True
                    if i < steps_per_block - 1:
                        ahead = order[j, int(done[j, i + 1]):int(done[j, i + 1]) + int(counts[j, i + 1])]
                        chosen[j, ahead] = True
                        chosen[j, now] = True
                        if config.window_size > 0:
                            _window(chosen[j], ahead.tolist(), mask_index[j], config.window_size)
            else:
                x0_p[:, end:] = -torch.inf
                confidence = torch.where(mask_index, x0_p, torch.full_like(x0_p, -torch.inf))
                for j in range(B):
                    # past the schedule (a structure's filter left holes): one token a step
                    k = int(counts[j, i]) if i < steps_per_block else int(bool(mask_index[j, start:end].any()))
                    transfer[j, torch.topk(confidence[j], k=k).indices] = True
            prior = x[:, start:end].clone() if constraint is not None else None
            x[transfer] = x0[transfer]
            committed = transfer.sum()
            if constraint is not None:   # keep what the structure accepts, advance the matchers
                constraint.filter(x, prior, x0[:, start:end], window_logits, start, end, 0)
                now_masked = x[:, start:end] == mask_id
                committed = int((prior == mask_id).sum() - now_masked.sum())
                if greedy:   # the next forward also refreshes the filter's commits and scores each frontier
                    chosen[:, start:end] |= (prior == mask_id) & ~now_masked
                    for j in range(B):
                        f = constraint.frontier(j)
                        if not constraint.matchers[j].ended and f < T:
                            chosen[j, f] = True
            if stats is not None:
                stats.step(committed)
            prv, cur = _delay(cur, x, mask_id, "right", constraint is not None)
            if i >= steps_per_block - 1:
                final = _final(x, P, end - P, mask_id)
            yield Progress(x, final)
    if stats is not None:
        stats.stop(B * gen_length)
    return x


@torch.no_grad()
def dkv_dream_generate(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                       *, config: DKVCache | None = None, steps: int = 512, max_new_tokens: int,
                       alg: str = "origin", alg_temp: float | None = None, temperature: float = 0.0,
                       top_p: float | None = None, top_k: int | None = None, eps: float = 1e-3,
                       mask_id: int | None = None, generator: torch.Generator | None = None,
                       stats: GenerationStats | None = None, structured_outputs: Any = None,
                       tokenizer: Any = None) -> torch.Tensor:
    """dKV-Cache's Dream sampler (greedy tokens). Returns `[B, P + max_new_tokens]`.

    `config`: a `DKVCache` (`cache_type` None: ``"decoded"``; `shift_type` None: ``"un"``). The other
    arguments are Dream's `diffusion_generate`'s; `temperature` must be 0 (`top_p` / `top_k` still filter
    the confidences, as upstream); `alg="origin"` draws from `generator` (None: torch's global one, as
    upstream). The model must shift its logits (`ModelSpec.logit_shift`). `structured_outputs` (a
    `remask.StructuredOutputsParams` or its JSON; `tokenizer`: default the checkpoint's): see
    `dkv_dream_steps`."""
    structure = None
    if structured_outputs is not None:
        from ..parts.constrain_loops import structure_for_call

        spec = get_spec(model) if mask_id is None else get_spec(model, mask_id=mask_id)
        structure = structure_for_call(structured_outputs, model, tokenizer, spec.mask_id, max_new_tokens)
    return drive(dkv_dream_steps(model, input_ids, attention_mask, config=config, steps=steps,
                                 max_new_tokens=max_new_tokens, alg=alg, alg_temp=alg_temp, temperature=temperature,
                                 top_p=top_p, top_k=top_k, eps=eps, mask_id=mask_id, generator=generator,
                                 stats=stats, structure=structure), model)


def dkv_dream_steps(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
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
    config = check_instance("config", DKVCache(cache_type="decoded") if config is None else config, DKVCache,
                            "a remask DKVCache", allow_none=False)
    if config.variant != "decode":   # (a window_size is Greedy's)
        raise ValueError(f"variant: dKV-Cache's Dream sampler is the delayed (decode) cache; variant="
                         f"{config.variant!r} is LLaDA's dKV-Cache-Greedy (dkv_generate)")
    if config.commit_mask_token:
        raise ValueError("commit_mask_token: Dream's sampler never commits the mask token in remask; "
                         "commit_mask_token=True is LLaDA-only (dkv_generate)")
    spec = get_spec(model) if mask_id is None else get_spec(model, mask_id=mask_id)
    check_model_kind(spec, diffusion=True, entry="dkv_dream_generate")
    check_mask_id(spec)
    if not spec.logit_shift:
        raise ValueError("model: dKV-Cache's Dream sampler caches by the logit shift (position i scores token "
                         "i + 1, ModelSpec.logit_shift); this model scores each position from itself — use "
                         "remask.diffusion.methods.dkv.dkv_generate (LLaDA's dKV-Cache)")
    check_int("max_new_tokens", max_new_tokens, minimum=1)
    check_prompt(model, input_ids, attention_mask, name="input_ids", spec=spec, mask_in_prompt="refuse")
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
    check_stats("stats", stats)
    check_generator(generator, input_ids.device)

    decoder = DreamDecoder(spec, gen, reference_ties=True, structure=structure, end_ids=end_ids)
    state = decoder.start(model, input_ids, attention_mask)
    return _dream_steps(decoder, state, config, steps, attention_mask, generator, stats)


@torch.no_grad()
def _dream_steps(decoder: DreamDecoder, state, config: DKVCache, steps: int, attention_mask: torch.Tensor | None,
                 generator: torch.Generator | None, stats: GenerationStats | None) -> StepGenerator:
    """dKV-Cache's Dream loop (the arguments checked by `dkv_dream_steps`)."""
    mask_id, R = decoder.spec.mask_id, config.cache_reloading_step
    cache_type, shift_type = config.cache_type or "decoded", config.shift_type or "un"
    x, constraint = state.x, state.constraint
    B, T = x.shape
    positions = state.forward_inputs.get("position_ids")
    if not torch.is_tensor(positions):
        positions = torch.arange(T, device=x.device)[None].expand(B, T)
    key_ok = valid_positions(attention_mask, T)
    decoded = x != mask_id   # the first store: positions whose next token is decoded (the last follows itself)
    store, prev = torch.cat([decoded[:, 1:], decoded[:, -1:]], dim=1), None
    groups, caches = [], []
    if stats is not None:
        stats.start()
    for i in itertools.count():
        if state.done if constraint is not None else i >= steps:
            break   # under a structure: once no mask is left (the schedule, then the decoder's extra steps)
        if cache_type == "decoded" and i % R == 0:
            prev = None   # rebuild: a full forward
        if constraint is not None and prev is not None:
            # the position scoring each row's frontier (the logit shift: the one before it) is forwarded
            prev = prev.clone()
            for b in range(B):
                f = constraint.frontier(b)
                if not constraint.matchers[b].ended and f < T:
                    prev[b, max(f - 1, 0)] = False
        logits = None

        def take(g: list[int], part: torch.Tensor, fwd: torch.Tensor | None) -> None:
            nonlocal logits
            if fwd is not None:   # −inf where not forwarded
                part = part.new_full((len(g), T, part.shape[-1]), -torch.inf).masked_scatter(fwd[..., None], part)
            if logits is None:
                logits = part.new_full((B,) + part.shape[1:], -torch.inf)
            logits[g] = part

        groups, caches = yield from _forward_rows(x, positions, None if prev is None else ~prev,
                                                  prev if store is None else store, groups, caches, key_ok, stats,
                                                  0, take)
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)   # the logit shift (spec.logit_shift)
        before = int((x == mask_id).sum())
        decoder.commit(state, logits, generator=generator)
        x = state.x
        left = x == mask_id
        if constraint is None and i == steps - 1 and bool(left.any()):
            # Only positions without logits ("right"): upstream's last top-k takes every mask, NaN
            # confidences included, with the argmax of a NaN row (id 0), which `score` also gives.
            x[left] = decoder.score(logits, left.reshape(-1).nonzero().squeeze(1))[0]
        if stats is not None:
            stats.step(before - int((x == mask_id).sum()))
        if cache_type == "prefill":
            if prev is None:
                prev, store = store, None
        else:
            prev, store = _delay(store, x, mask_id, shift_type, constraint is not None)
        yield Progress(x, 0)
    if stats is not None:
        stats.stop(B * (T - state.prompt_len))
    return x

"""dKV-Cache for LLaDA (horseee/dKV-Cache `generation_utils/llada_dkv_cache_decode.py` and
`llada_dkv_cache_greedy.py`, with `models/modeling_llada_dkv_cache_decode.py`; docs/decoders.md):
LLaDA's block schedule with a delayed K/V cache, dropped at each block's start. With
R = `cache_reloading_step`, dKV-Cache-Decode (LLaDA's top-k commits, `low_confidence` or `random`) runs
- step 0: a full forward, nothing cached;
- step 1 and every step i with i % R == 0: a full forward that (re)builds the cache: the keys and
  values of every position decoded before this step (prompt included);
- any other step i: a forward of only the positions still masked after step i − 2, attending over
  themselves and the cache; the cache then takes the positions decoded at step i − 1 from this
  forward (a token enters the cache one step after it is decoded: the delay) and keeps the others.
  Skipped positions get confidence −inf.
dKV-Cache-Greedy decodes each block in an order drawn per block (one float32 `torch.rand` uniform per
position): steps i % R == 0 forward and cache everything; the others forward only the positions
chosen at step i − 1 (those decoded then and now, and the window) and cache them at once.

Keys attend in the reference's order (forwarded positions, then cached ones, each ascending), so
float32 logits are the reference's. `DelayedKVCache` plugs into the model's KV-cache seam (`attend`);
every forward is a `ForwardRequest` (`diffusion/parts/stepper.py`), packed with other sequences' in
the engine (`varlen.PackedAttention`).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Generator

import torch
import torch.nn.functional as F

from remask.caches.position import DelayedKVCache
from remask.models.spec import get_spec

from ..families.llada import validate_block_args
from ..parts.cache import valid_positions
from ..parts.checks import (check_bool, check_choice, check_config_bounds, check_generator, check_instance, check_int,
                            check_mask_id, check_prompt, check_stats, model_device)
from ..parts.selection import schedule_counts
from ..parts.stats import GenerationStats
from ..parts.step import masked_canvas
from ..parts.stepper import ForwardRequest, Progress, StepGenerator, drive

REMASKING = ("low_confidence", "random")
VARIANTS = ("decode", "greedy")
DREAM_CACHE_TYPES = ("decoded", "prefill")
DREAM_SHIFT_TYPES = ("un", "un_right", "right")


@dataclass(frozen=True)
class DKVCache:
    """dKV-Cache's parameters (the module docstring): `cache_reloading_step` (upstream's; its README
    uses 8 for Decode, the Greedy CLI `--cache-steps 2`), `variant` ``"decode"`` or ``"greedy"``
    (`remasking="random"` only) and Greedy's `window_size` (masked neighbours forwarded with each
    position decoded next). `commit_mask_token=True` reproduces upstream when the argmax is the mask
    token (committed, the position stays masked); by default the most probable other token is.
    Dream's sampler (`remask.diffusion.methods.dkv_dream`) reads two more fields, None for LLaDA:
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
        """The work bounds of a LLaDA request (docs/parameters.md, "Work bounds"): the cache reloads
        at steps i % `cache_reloading_step` == 0 below the steps per block; the greedy window takes at
        most the `gen_length` masked positions. `block_length` / `steps` None: `gen_length`."""
        blocks = gen_length // (gen_length if block_length is None else block_length)
        per_block = (gen_length if steps is None else steps) // max(blocks, 1)
        check_config_bounds(self, "use_cache", {
            "cache_reloading_step": (per_block, "the steps per block: steps // blocks"),
            "window_size": (gen_length, "gen_length: the masked positions")})


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
            uniform = _counts_equal(*(s for s in (store, forwarded) if s is not None))
            groups, caches = _regroup(groups, caches, B, not cached_step, uniform, key_ok, merge=greedy)
            x0 = torch.full_like(x, mask_id)
            x0_p = torch.full(x.shape, -torch.inf, dtype=torch.float64, device=device)
            window_logits = None   # under a structure: the block's logits [B, block_length, V] (the filter's)
            gi = 0
            for cache, g in zip(caches, groups):
                rows = torch.tensor(g, device=device)
                fwd = None if forwarded is None else forwarded[rows]
                if fwd is not None and not bool(fwd.any()):
                    continue   # a row whose answer a structure ended: nothing left to score
                if gi:
                    yield Progress(x, final)   # the previous row's forward (rows forwarded one by one)
                gi += 1
                logits = yield from _forward(x[rows], positions[rows], fwd, cache,
                                             None if store is None else store[rows])
                n = logits.shape[1]
                if stats is not None:
                    stats.forward(len(g), n, cache.nbytes if greedy else sum(c.nbytes for c in caches))
                where = everything[rows] if fwd is None else fwd
                if constraint is not None:   # the frontier masked before the rule scores (parts/constrain.py)
                    logits, window_logits = _constrained_logits(constraint, g, logits, where, start, end,
                                                                window_logits, B)
                tokens = torch.argmax(logits, dim=-1)
                p = F.softmax(logits.to(torch.float64), dim=-1) if remasking == "low_confidence" else None
                if not config.commit_mask_token and bool((tokens == mask_id).any()):
                    p = F.softmax(logits.to(torch.float64), dim=-1) if p is None else p
                    others = p.index_fill(-1, torch.tensor([mask_id], device=device), -1.0).argmax(dim=-1)
                    tokens = torch.where(tokens == mask_id, others, tokens)
                x0[rows] = x0[rows].masked_scatter(where, tokens)
                if not greedy:
                    conf = torch.gather(p, -1, tokens[..., None]).squeeze(-1) if remasking == "low_confidence" \
                        else torch.rand((len(g), n), generator=generator, device=device).to(torch.float64)
                    x0_p[rows] = x0_p[rows].masked_scatter(where, conf)
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
            prv, cur = cur, x != mask_id
            if constraint is not None and prv is not None:
                prv = prv & cur   # a revoked position leaves the cache's sets: it is forwarded again
            if i >= steps_per_block - 1:
                final = _final(x, P, end - P, mask_id)
            yield Progress(x, final)
    if stats is not None:
        stats.stop(B * gen_length)
    return x

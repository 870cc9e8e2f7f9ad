"""dKV-Cache-Decode for LLaDA (horseee/dKV-Cache `generation_utils/llada_dkv_cache_decode.py` with
its `models/modeling_llada_dkv_cache_decode.py`): LLaDA's block schedule with a delayed K/V cache.

The decoding rule is LLaDA's (`steps` split over the blocks, the block's masks split evenly over
its steps, remainder first; commit the top-k by confidence, `low_confidence` or `random`). What
changes is what each forward computes. Inside a block, with R = `cache_reloading_step`:
- step 0: a full forward, nothing cached;
- step 1 and every step i with i % R == 0: a full forward that (re)builds the cache: the keys and
  values of every position decoded before this step (prompt included);
- any other step i: a forward of only the positions still masked after step i − 2 (every masked
  position of the whole generation plus the positions decoded at step i − 1), attending over
  themselves and the cached keys/values; the cache then takes the keys/values of the positions
  decoded at step i − 1 from this forward (a token enters the cache one step after it is decoded:
  the delay) and keeps the others. Skipped positions get confidence −inf.
The cache is dropped at each block's start. Keys attend in the reference's order (forwarded
positions, then cached ones, each ascending), so float32 logits are the reference's.

The cache (`DelayedKVCache`) plugs into remask's LLaDA through the model's KV-cache seam
(`attend`): no model code changes. Every forward is a `ForwardRequest` the driver computes
(`diffusion/parts/stepper.py`); in the engine the requests of several sequences share one packed model
call, each sequence attending through its own cache (`varlen.PackedAttention`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generator

import torch
import torch.nn.functional as F

from remask.caches.kv import KVCache, attention
from remask.models.spec import get_spec

from ..parts.cache import valid_positions
from ..parts.checks import (check_bool, check_choice, check_config_bounds, check_generator, check_int, check_mask_id,
                     check_prompt, check_stats, model_device)
from ..parts.stats import GenerationStats
from ..parts.stepper import ForwardRequest, Progress, StepGenerator, drive

REMASKING = ("low_confidence", "random")


VARIANTS = ("decode", "greedy")
DREAM_CACHE_TYPES = ("decoded", "prefill")
DREAM_SHIFT_TYPES = ("un", "un_right", "right")


@dataclass(frozen=True)
class DKVCache:
    """dKV-Cache's parameters: `cache_reloading_step` (upstream's; its README uses 8 for Decode,
    the Greedy CLI `--cache-steps 2`), `variant` ``"decode"`` (dKV-Cache-Decode: delayed caching,
    LLaDA's own schedule) or ``"greedy"`` (dKV-Cache-Greedy: `remasking="random"` only — the order
    is drawn once per block — each cached step forwards only the positions it decodes, those decoded
    the step before and `window_size` masked neighbours, and caches them at once).

    `commit_mask_token=True` reproduces upstream when the argmax is the mask token (it is committed,
    the position stays masked and may be returned masked); by default the most probable other token
    is committed instead.

    Dream (`remask.diffusion.dkv_dream.dkv_dream_generate`, upstream's Dream `_sample`) reads two more
    fields, None for LLaDA: `cache_type` ``"decoded"`` (the default there: decoded tokens are cached,
    the cache rebuilt every `cache_reloading_step` steps — upstream's `cache_steps`) or ``"prefill"``
    (the prompt is cached once, `cache_reloading_step` unused), and `shift_type` (``"decoded"`` only)
    ``"un"`` (the default: position i is cached once token i + 1 is decoded, the logit shift),
    ``"un_right"`` (once tokens i and i + 1 are) or ``"right"`` (once token i is)."""

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
        if self.cache_type is not None:
            check_choice("cache_type", self.cache_type, DREAM_CACHE_TYPES)
        if self.shift_type is not None:
            check_choice("shift_type", self.shift_type, DREAM_SHIFT_TYPES)
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
        """The work bounds of a LLaDA request (docs/parameters.md, "Work bounds"): the cache is
        reloaded at the block's steps i with i % `cache_reloading_step` == 0, i below the steps per
        block; the greedy window takes at most the `gen_length` masked positions. `block_length` /
        `steps` None: LLaDA's defaults (`gen_length`)."""
        blocks = gen_length // (gen_length if block_length is None else block_length)
        per_block = (gen_length if steps is None else steps) // max(blocks, 1)
        check_config_bounds(self, "use_cache", {
            "cache_reloading_step": (per_block, "the steps per block: steps // blocks"),
            "window_size": (gen_length, "gen_length: the masked positions")})


class DelayedKVCache(KVCache):
    """Keys/values (after RoPE) of a chosen set of positions per row, for dKV-Cache's forwards.

    Before each forward the decoder calls `fill(store)` (the forward covers every position; keep
    those in `store` `[B, T]`) or `reuse(forwarded, store)` (the forward covers the positions in
    `forwarded`; the others must be the cached ones; afterwards keep those in `store`, fresh where
    forwarded, else from the cache). `key_ok` `[B, T]` (False = padding key) hides keys."""

    def __init__(self, key_ok: torch.Tensor | None = None) -> None:
        super().__init__()
        self.key_ok = key_ok
        self.cached: torch.Tensor | None = None          # [B, T] bool: positions held
        self.k: dict[int, torch.Tensor] = {}             # layer -> [B, H, n_cached, D]
        self.v: dict[int, torch.Tensor] = {}
        self._mode: str | None = None
        self._forwarded: torch.Tensor | None = None
        self._store: torch.Tensor | None = None

    def get_seq_length(self, layer: int = 0) -> int:
        return 0   # positions are passed explicitly; nothing is appended

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in list(self.k.values()) + list(self.v.values()))

    def fill(self, store: torch.Tensor) -> None:
        self._mode, self._forwarded, self._store = "fill", None, store

    def reuse(self, forwarded: torch.Tensor, store: torch.Tensor) -> None:
        if self.cached is None or not bool((self.cached | forwarded).all()):
            raise RuntimeError("dKV cache: every position not forwarded must be cached")
        self._mode, self._forwarded, self._store = "reuse", forwarded, store

    def finish(self) -> None:
        self.cached = self._store
        self._mode = None

    @staticmethod
    def _select(t: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Rows' kept positions of `t` `[B, H, T, D]` (equal counts per row), ascending."""
        B, H, _, D = t.shape
        idx = keep.nonzero()[:, 1].view(B, -1)
        return torch.gather(t, 2, idx[:, None, :, None].expand(B, H, idx.shape[1], D))

    def _bias(self, keep_order: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
        if keep_order is None:
            return None
        return torch.zeros(keep_order.shape, dtype=dtype, device=keep_order.device).masked_fill(
            ~keep_order, torch.finfo(dtype).min)[:, None, None, :]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               mask: torch.Tensor | None) -> torch.Tensor:
        B, H, _, D = k.shape
        if self._mode == "fill":
            ok = None
            if self.key_ok is not None and not bool(self.key_ok.all()):
                ok = self.key_ok
            out = attention(q, k, v, self._bias(ok, q.dtype))
            self.k[layer], self.v[layer] = self._select(k, self._store), self._select(v, self._store)
            return out
        if self._mode != "reuse":
            raise RuntimeError("dKV cache: call fill() or reuse() before the forward")
        # keys: the forwarded positions' fresh ones, then the cached ones of the other positions
        # (each ascending), the reference's order
        old = ~self._forwarded
        old_in_cache = old[self.cached].view(B, -1)          # which cached entries are not forwarded
        if bool(old_in_cache.all()):
            old_k, old_v = self.k[layer], self.v[layer]
        else:
            old_k, old_v = self._select(self.k[layer], old_in_cache), self._select(self.v[layer], old_in_cache)
        keys = torch.cat([k, old_k], dim=2)
        values = torch.cat([v, old_v], dim=2)
        ok = None
        if self.key_ok is not None and not bool(self.key_ok.all()):
            fwd_ok = self.key_ok[self._forwarded].view(B, -1)
            old_ok = self.key_ok[old].view(B, -1)
            ok = torch.cat([fwd_ok, old_ok], dim=1)
        out = attention(q, keys, values, self._bias(ok, q.dtype))
        # Back to sequence order (fresh where forwarded, else cached), then keep the `store` positions.
        T = self._forwarded.shape[1]
        order = torch.cat([self._forwarded.nonzero()[:, 1].view(B, -1), old.nonzero()[:, 1].view(B, -1)], 1)
        index = order[:, None, :, None].expand(B, H, T, D)
        full_k = torch.empty((B, H, T, D), dtype=k.dtype, device=k.device).scatter_(2, index, keys)
        full_v = torch.empty((B, H, T, D), dtype=v.dtype, device=v.device).scatter_(2, index, values)
        self.k[layer], self.v[layer] = self._select(full_k, self._store), self._select(full_v, self._store)
        return out


def _schedule(masks: torch.Tensor, steps: int) -> torch.Tensor:
    """`[B, steps]` commits per step: each row's masks split evenly, the remainder first."""
    base, remainder = masks // steps, masks % steps
    counts = base[:, None].repeat(1, steps)
    counts += torch.arange(steps, device=masks.device)[None] < remainder[:, None]
    return counts


def _forward(x: torch.Tensor, forwarded: torch.Tensor | None, cache: DelayedKVCache | None,
             store: torch.Tensor | None, key_ok: torch.Tensor | None) -> Generator[ForwardRequest, Any, torch.Tensor]:
    """Logits of the forwarded positions `[B, n, V]` (all positions when `forwarded` is None): one
    `ForwardRequest`, used with ``yield from``. The cache is told its part before the request and
    takes its new positions after the answer."""
    B, T = x.shape
    if cache is None:    # step 0: a plain forward
        inputs = {}
        if key_ok is not None and not bool(key_ok.all()):
            inputs["attention_bias"] = torch.zeros((B, 1, 1, T), dtype=torch.float32, device=x.device).masked_fill(
                ~key_ok[:, None, None, :], torch.finfo(torch.float32).min)
        return (yield ForwardRequest(x, per_row=inputs))
    if forwarded is None:
        cache.fill(store)
        logits = yield ForwardRequest(x, per_row={"position_ids": torch.arange(T, device=x.device)[None].expand(B, T)},
                                      cache=cache)
    else:
        cache.reuse(forwarded, store)
        positions = forwarded.nonzero()[:, 1].view(B, -1)
        logits = yield ForwardRequest(x[forwarded].view(B, -1), per_row={"position_ids": positions}, cache=cache)
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
        window_logits = torch.full((B, end - start, logits.shape[-1]), -torch.inf, dtype=logits.dtype,
                                   device=logits.device)
    inside = (positions >= start) & (positions < end)
    part = torch.full((len(g), end - start, logits.shape[-1]), -torch.inf, dtype=logits.dtype, device=logits.device)
    part[where[:, start:end]] = logits[inside]
    window_logits[torch.tensor(g, device=logits.device)] = part
    return logits, window_logits


def _final(x: torch.Tensor, P: int, upto: int, mask_id: int) -> int:
    """Generated positions no later step changes once the first `upto` are decoded: `upto`, less
    any position left masked (only with `commit_mask_token`; a later block may still decode it),
    the minimum over rows."""
    masked = x[:, P:P + upto] == mask_id
    first = torch.where(masked.any(dim=1), masked.int().argmax(dim=1), upto)
    return int(first.min())


@torch.no_grad()
def dkv_generate(model: torch.nn.Module, prompt: torch.Tensor, *, config: DKVCache | None = None,
                 steps: int = 128, gen_length: int = 128, block_length: int = 128,
                 remasking: str = "low_confidence", attention_mask: torch.Tensor | None = None,
                 generator: torch.Generator | None = None, mask_id: int | None = None,
                 stats: GenerationStats | None = None) -> torch.Tensor:
    """dKV-Cache-Decode (greedy tokens). Returns `[B, P + gen_length]`.

    `remasking="random"` draws the uniforms as upstream (`torch.rand` over the forwarded positions,
    float32) from `generator` (None: torch's global generator). `attention_mask` `[B, P]` (left
    padding) hides pad keys (upstream has none). Rows whose forwarded sets differ in size (only
    with `commit_mask_token`) are forwarded one by one, each with its own cache."""
    return drive(dkv_steps(model, prompt, config=config, steps=steps, gen_length=gen_length,
                           block_length=block_length, remasking=remasking, attention_mask=attention_mask,
                           generator=generator, mask_id=mask_id, stats=stats), model)


def dkv_steps(model: torch.nn.Module, prompt: torch.Tensor, *, config: DKVCache | None = None,
              steps: int = 128, gen_length: int = 128, block_length: int = 128,
              remasking: str = "low_confidence", attention_mask: torch.Tensor | None = None,
              generator: torch.Generator | None = None, mask_id: int | None = None,
              stats: GenerationStats | None = None, structure: Any = None, end_ids: Any = ()) -> StepGenerator:
    """`dkv_generate` as a step generator (`remask.diffusion.stepper`): the arguments are checked
    now; the returned generator yields a `ForwardRequest` per forward and a `Progress` after it
    (`final`: the decoded blocks) and returns `dkv_generate`'s tensor. Both variants (decode and
    greedy).

    `structure` (a compiled `remask.structured` structure) and `end_ids`: structured output
    (`diffusion/parts/constrain.py`), in the same three calls as the other rules: each forward's
    frontier (where forwarded) masked before the rule scores, the rule's commits filtered after,
    the block's window being the block. Under a structure (only then):
    - a block whose schedule ends with holes (commits the filter refused) runs more steps, one
      token each (Decode: the most confident; Greedy: none of the spent order, the filter commits
      the frontier), until the block is settled; a block every row has settled is skipped;
    - a position the filter revoked leaves the delayed cache's sets (it is forwarded again, as a
      masked position is);
    - Greedy forwards each row's frontier at every cached step, beside its chosen positions (the
      random order rarely holds it), so the frontier is scored from fresh logits."""
    config = DKVCache() if config is None else config
    if not isinstance(config, DKVCache):
        raise ValueError(f"config must be a remask DKVCache, got {type(config).__name__}")
    if config.dream_fields:
        name = config.dream_fields[0]
        raise ValueError(f"{name}: a Dream-only field (dkv_dream_generate); LLaDA's dKV-Cache takes "
                         f"cache_reloading_step, variant, window_size, commit_mask_token (got {name}="
                         f"{getattr(config, name)!r})")
    for name, value in (("steps", steps), ("gen_length", gen_length), ("block_length", block_length)):
        check_int(name, value, minimum=1)
    if gen_length % block_length:
        raise ValueError(f"gen_length ({gen_length}) must be a multiple of block_length ({block_length})")
    num_blocks = gen_length // block_length
    if steps % num_blocks:
        raise ValueError(f"steps ({steps}) must be divisible by the number of blocks ({num_blocks})")
    check_choice("remasking", remasking, REMASKING)
    check_stats("stats", stats)
    spec = get_spec(model) if mask_id is None else get_spec(model, mask_id=mask_id)
    check_mask_id(spec)
    check_prompt(model, prompt, attention_mask, spec=spec, mask_in_prompt="refuse")
    device = model_device(model)
    check_generator(generator, device)
    mask_id = spec.mask_id
    steps_per_block = steps // num_blocks
    config.check_request(gen_length=gen_length, block_length=block_length, steps=steps)
    if config.variant == "greedy":
        if remasking != "random":
            raise ValueError(f"remasking: dKV-Cache-Greedy decodes in a random order drawn per block "
                             f"(remasking='random'), got {remasking!r}")
    from ..parts.constrain import CommitFilter, end_ids_of

    constraint = CommitFilter.start(structure, end_ids_of(spec, end_ids), prompt.shape[0], mask_id, prompt.shape[1],
                                    gen_length)
    if config.variant == "greedy":
        return _greedy_steps(model, prompt, config, spec, steps_per_block, gen_length, block_length,
                             attention_mask, generator, stats, constraint)
    return _decode_steps(model, prompt, config, mask_id, device, steps_per_block, num_blocks, block_length,
                         gen_length, remasking, attention_mask, generator, stats, constraint)


@torch.no_grad()
def _decode_steps(model, prompt: torch.Tensor, config: DKVCache, mask_id: int, device: torch.device,
                  steps_per_block: int, num_blocks: int, block_length: int, gen_length: int, remasking: str,
                  attention_mask: torch.Tensor | None, generator: torch.Generator | None,
                  stats: GenerationStats | None, constraint: Any = None) -> StepGenerator:
    """dKV-Cache-Decode's loop (the arguments checked by `dkv_steps`; `constraint`: a
    `CommitFilter` or None, see `dkv_steps`)."""
    R = config.cache_reloading_step
    B, P = prompt.shape
    T = P + gen_length
    x = torch.full((B, T), mask_id, dtype=torch.long, device=device)
    x[:, :P] = prompt
    key_ok = valid_positions(attention_mask, T)   # False on the left pads
    final = 0
    if stats is not None:
        stats.start()
    for num_block in range(num_blocks):
        end = P + (num_block + 1) * block_length
        start = end - block_length
        if constraint is not None and not any(constraint.unsettled(x, start, end)):
            continue   # every row's answer is settled through this block (ended or decoded)
        counts = _schedule((x[:, end - block_length:end] == mask_id).sum(dim=1), steps_per_block)
        caches: list[DelayedKVCache] = []
        groups: list[list[int]] = []
        prv = cur = None    # decoded positions after step i-2 / after step i-1
        i = -1
        while True:
            i += 1
            if i >= steps_per_block and (constraint is None or not any(constraint.unsettled(x, start, end))):
                break
            mask_index = x == mask_id
            cached_step = i % R != 0 and i > 1
            # One batched forward while every row forwards and caches as many positions (always,
            # unless commit_mask_token leaves some rows a mask more); else one forward per row.
            uniform = i == 0 or bool((cur.sum(dim=1) == cur[0].sum()).all())
            if cached_step:
                uniform = uniform and bool(((~prv).sum(dim=1) == (~prv[0]).sum()).all())
            if not cached_step:
                groups = [list(range(B))] if uniform else [[b] for b in range(B)]
                caches = [DelayedKVCache(None if key_ok is None else key_ok[g]) for g in groups]
            elif len(caches) == 1 and not uniform:
                whole = caches[0]
                groups = [[b] for b in range(B)]
                caches = [DelayedKVCache(None if key_ok is None else key_ok[g]) for g in groups]
                for b, c in enumerate(caches):
                    c.cached = whole.cached[b:b + 1]
                    c.k = {layer: t[b:b + 1] for layer, t in whole.k.items()}
                    c.v = {layer: t[b:b + 1] for layer, t in whole.v.items()}
            x0 = torch.full_like(x, mask_id)
            x0_p = torch.full(x.shape, -torch.inf, dtype=torch.float64, device=device)
            window_logits = None   # under a structure: the block's logits [B, block_length, V] (the filter's)
            gi = 0
            for cache, g in zip(caches, groups):
                rows = torch.tensor(g, device=device)
                forwarded = (~prv[rows]) if cached_step else None
                if forwarded is not None and not bool(forwarded.any()):
                    continue   # a row whose answer a structure ended: nothing left to score
                if gi:
                    yield Progress(x, final)   # the previous row's forward (rows forwarded one by one)
                gi += 1
                logits = yield from _forward(x[rows], forwarded, None if i == 0 else cache,
                                             None if i == 0 else cur[rows], None if key_ok is None else key_ok[rows])
                n = logits.shape[1]
                if stats is not None:
                    stats.forward(len(g), n, sum(c.nbytes for c in caches))
                where = forwarded if forwarded is not None else torch.ones((len(g), T), dtype=torch.bool,
                                                                          device=device)
                if constraint is not None:   # the frontier masked before the rule scores (parts/constrain.py)
                    logits, window_logits = _constrained_logits(constraint, g, logits, where, start, end,
                                                                window_logits, B)
                tokens = torch.argmax(logits, dim=-1)
                if remasking == "low_confidence" or not config.commit_mask_token:
                    p = F.softmax(logits.to(torch.float64), dim=-1)
                if not config.commit_mask_token and bool((tokens == mask_id).any()):
                    others = p.index_fill(-1, torch.tensor([mask_id], device=device), -1.0).argmax(dim=-1)
                    tokens = torch.where(tokens == mask_id, others, tokens)
                if remasking == "low_confidence":
                    conf = torch.gather(p, -1, tokens[..., None]).squeeze(-1)
                else:
                    conf = torch.rand((len(g), n), generator=generator, device=device).to(torch.float64)
                x0[rows] = x0[rows].masked_scatter(where, tokens)
                x0_p[rows] = x0_p[rows].masked_scatter(where, conf)
            x0_p[:, end:] = -torch.inf
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, torch.full_like(x0_p, -torch.inf))
            transfer = torch.zeros_like(mask_index)
            for j in range(B):
                # past the schedule (a structure's filter left holes): one token a step
                k = int(counts[j, i]) if i < steps_per_block else int(bool(mask_index[j, start:end].any()))
                transfer[j, torch.topk(confidence[j], k=k).indices] = True
            prior = x[:, start:end].clone() if constraint is not None else None
            x[transfer] = x0[transfer]
            committed = transfer.sum()
            if constraint is not None:   # keep what the structure accepts, advance the matchers
                constraint.filter(x, prior, x0[:, start:end], window_logits, start, end, 0)
                committed = int((prior == mask_id).sum() - (x[:, start:end] == mask_id).sum())
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


def _window(chosen: torch.Tensor, around: list[int], masked: torch.Tensor, size: int) -> None:
    """dKV-Cache-Greedy's window, in place on `chosen` `[T]`: for each position of `around` (in its
    order) the `size` nearest masked positions not chosen yet, alternating left and right."""
    T = chosen.shape[0]
    for pos in around:
        left, right, found, go_left = pos - 1, pos + 1, 0, True
        while found < size:
            if go_left:
                if left >= 0 and not chosen[left] and masked[left]:
                    chosen[left] = True
                    found += 1
                left -= 1
            else:
                if right < T and not chosen[right] and masked[right]:
                    chosen[right] = True
                    found += 1
                right += 1
            go_left = not go_left
            if left < 0 and right >= T:
                break


@torch.no_grad()
def _greedy_steps(model, prompt: torch.Tensor, config: DKVCache, spec, steps_per_block: int, gen_length: int,
                  block_length: int, attention_mask: torch.Tensor | None, generator: torch.Generator | None,
                  stats: GenerationStats | None, constraint: Any = None) -> StepGenerator:
    """dKV-Cache-Greedy (horseee/dKV-Cache `llada_dkv_cache_greedy.py`). Per block: one uniform per
    position (`torch.rand` over the sequence, float32) fixes the decoding order of the block's
    positions; the block's masks are split evenly over its steps (remainder first). Step i with
    i % R == 0 forwards the whole sequence and caches every position's keys/values; any other step
    forwards only the positions chosen at step i − 1 (those it decodes, those decoded at i − 1 and
    the window), attends over them and the cache of the rest, and writes their fresh keys/values
    into the cache. The decoded tokens are each position's argmax. A step generator (a `Progress`
    after every forward); the arguments are checked by `dkv_steps` (`constraint`: a `CommitFilter`
    or None, see there)."""
    mask_id, device = spec.mask_id, model_device(model)
    R = config.cache_reloading_step
    B, P = prompt.shape
    T = P + gen_length
    x = torch.full((B, T), mask_id, dtype=torch.long, device=device)
    x[:, :P] = prompt
    key_ok = valid_positions(attention_mask, T)
    everything = torch.ones((1, T), dtype=torch.bool, device=device)
    final = 0
    if stats is not None:
        stats.start()
    for num_block in range(gen_length // block_length):
        start, end = P + num_block * block_length, P + (num_block + 1) * block_length
        if constraint is not None and not any(constraint.unsettled(x, start, end)):
            continue   # every row's answer is settled through this block (ended or decoded)
        counts = _schedule((x[:, start:end] == mask_id).sum(dim=1), steps_per_block)
        done = torch.cat([counts.new_zeros((B, 1)), counts.cumsum(dim=1)], dim=1)
        order_p = torch.rand((B, T), generator=generator, device=device)
        order_p[:, end:] = -torch.inf
        order_p[:, :start] = -torch.inf
        order = torch.sort(order_p, descending=True).indices
        caches: list[DelayedKVCache | None] = [None] * B
        chosen = None
        i = -1
        while True:
            i += 1
            if i >= steps_per_block and (constraint is None or not any(constraint.unsettled(x, start, end))):
                break
            mask_index = x == mask_id
            cached_step = i % R != 0
            x0 = torch.full_like(x, mask_id)
            window_logits = None   # under a structure: the block's logits [B, block_length, V] (the filter's)
            # one forward for the batch when every row forwards as many positions, else row by row
            same = not cached_step or bool((chosen.sum(dim=1) == chosen[0].sum()).all())
            groups = [list(range(B))] if same else [[b] for b in range(B)]
            if cached_step and same and len({id(c) for c in caches}) > 1:
                caches = _merge(caches)
            elif cached_step and not same and len({id(c) for c in caches}) == 1 and B > 1:
                caches = _split(caches[0], B)
            gi = 0
            for g in groups:
                rows = torch.tensor(g, device=device)
                if cached_step and not bool(chosen[rows].any()):
                    continue   # a row whose answer a structure ended: nothing left to score
                if gi:
                    yield Progress(x, final)   # the previous row's forward (rows forwarded one by one)
                gi += 1
                ok = None if key_ok is None else key_ok[rows]
                if not cached_step:
                    cache = DelayedKVCache(ok)
                    logits = yield from _forward(x[rows], None, cache, everything.expand(len(g), T), ok)
                    forwarded = everything.expand(len(g), T)
                else:
                    cache = caches[g[0]]
                    forwarded = chosen[rows]
                    logits = yield from _forward(x[rows], forwarded, cache, everything.expand(len(g), T), ok)
                for b in g:
                    caches[b] = cache
                if stats is not None:
                    stats.forward(len(g), logits.shape[1], cache.nbytes)
                if constraint is not None:   # the frontier masked before the rule scores (parts/constrain.py)
                    logits, window_logits = _constrained_logits(constraint, g, logits, forwarded, start, end,
                                                                window_logits, B)
                tokens = torch.argmax(logits, dim=-1)
                if not config.commit_mask_token and bool((tokens == mask_id).any()):
                    p = F.softmax(logits.to(torch.float64), dim=-1)
                    others = p.index_fill(-1, torch.tensor([mask_id], device=device), -1.0).argmax(dim=-1)
                    tokens = torch.where(tokens == mask_id, others, tokens)
                x0[rows] = x0[rows].masked_scatter(forwarded, tokens)
            x0 = torch.where(mask_index, x0, x)
            transfer = torch.zeros_like(mask_index)
            nxt = torch.zeros_like(mask_index)
            for j in range(B):
                if i >= steps_per_block:
                    continue   # past the schedule (a structure's holes): the filter commits the frontier
                now = order[j, int(done[j, i]):int(done[j, i + 1])]
                transfer[j, now] = True
                if i < steps_per_block - 1:
                    ahead = order[j, int(done[j, i + 1]):int(done[j, i + 1]) + int(counts[j, i + 1])]
                    nxt[j, ahead] = True
                    nxt[j, now] = True
                    if config.window_size > 0:
                        _window(nxt[j], ahead.tolist(), mask_index[j], config.window_size)
            prior = x[:, start:end].clone() if constraint is not None else None
            x[transfer] = x0[transfer]
            committed = transfer.sum()
            if constraint is not None:   # keep what the structure accepts, advance the matchers
                constraint.filter(x, prior, x0[:, start:end], window_logits, start, end, 0)
                now_masked = x[:, start:end] == mask_id
                committed = int((prior == mask_id).sum() - now_masked.sum())
                # the next forward also refreshes what the filter committed and scores each frontier
                nxt[:, start:end] |= (prior == mask_id) & ~now_masked
                for j in range(B):
                    f = constraint.frontier(j)
                    if not constraint.matchers[j].ended and f < T:
                        nxt[j, f] = True
            if stats is not None:
                stats.step(committed)
            chosen = nxt
            if i >= steps_per_block - 1:
                final = _final(x, P, end - P, mask_id)
            yield Progress(x, final)
    if stats is not None:
        stats.stop(B * gen_length)
    return x


def _merge(caches: list) -> list:
    """Rows' own caches (the same positions held) as one batched cache."""
    merged = DelayedKVCache(None if caches[0].key_ok is None else torch.cat([c.key_ok for c in caches]))
    merged.cached = torch.cat([c.cached for c in caches])
    merged.k = {layer: torch.cat([c.k[layer] for c in caches]) for layer in caches[0].k}
    merged.v = {layer: torch.cat([c.v[layer] for c in caches]) for layer in caches[0].v}
    return [merged] * len(caches)


def _split(cache: DelayedKVCache, B: int) -> list:
    """A batched cache as one cache per row."""
    out = []
    for b in range(B):
        row = DelayedKVCache(None if cache.key_ok is None else cache.key_ok[b:b + 1])
        row.cached = cache.cached[b:b + 1]
        row.k = {layer: t[b:b + 1] for layer, t in cache.k.items()}
        row.v = {layer: t[b:b + 1] for layer, t in cache.v.items()}
        out.append(row)
    return out

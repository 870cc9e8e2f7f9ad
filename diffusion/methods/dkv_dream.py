"""dKV-Cache for Dream (horseee/dKV-Cache `generation_utils/dream_generation_utils.py` `_sample` with its
`models/modeling_dream.py`; docs/decoders.md): Dream's whole-canvas loop and commit rule
(`DreamDecoder.commit`) with a delayed K/V cache. `prev`: the positions the cache holds during a
step's forward; `store`: those it holds afterwards, at the start every position whose *next* token
is a prompt token (the logit shift: hidden state i scores token i + 1).
- A step with no cache (the first; with ``cache_type="decoded"`` also every step i with
  i % `cache_reloading_step` == 0) forwards the whole sequence and caches the store's positions.
- Any other step forwards only the positions outside `prev` (keys in `remask.diffusion.methods.dkv`'s
  reference order) and caches the store's positions, fresh where forwarded, else kept.
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
from typing import Any

import torch

from remask.models.spec import get_spec

from ..parts.cache import valid_positions
from ..parts.checks import (check_generator, check_instance, check_int, check_length, check_mask_id,
                            check_model_kind, check_prompt, check_stats)
from .dkv import DKVCache, _counts_equal, _forward, _regroup
from ..families.dream import DreamDecoder, DreamGenerationConfig, _validate_config
from ..parts.stats import GenerationStats
from ..parts.stepper import Progress, StepGenerator, drive

ALGORITHMS = ("origin", "maskgit_plus", "topk_margin", "entropy")


def _store(x: torch.Tensor, mask_id: int, shift_type: str) -> torch.Tensor:
    """`[B, T]` positions cached after a step of ``cache_type="decoded"``."""
    decoded = x != mask_id
    if shift_type == "un":
        return torch.cat([decoded[:, 1:], decoded[:, :1]], dim=1)
    if shift_type == "un_right":
        both = decoded[:, :-1] & decoded[:, 1:]
        return torch.cat([both, both[:, -1:]], dim=1)
    return decoded   # "right"


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
    return _steps(decoder, state, config, steps, attention_mask, generator, stats)


@torch.no_grad()
def _steps(decoder: DreamDecoder, state, config: DKVCache, steps: int, attention_mask: torch.Tensor | None,
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
        keep = store if store is not None else prev
        forwarded = None if prev is None else ~prev
        uniform = _counts_equal(keep) if prev is None else _counts_equal(forwarded, keep)
        groups, caches = _regroup(groups, caches, B, prev is None, uniform, key_ok)
        logits = None
        for g, cache in zip(groups, caches):
            fwd = None if forwarded is None else forwarded[g]
            if fwd is not None and not bool(fwd.any()):
                continue   # a row whose answer a structure ended: nothing left to score
            if logits is not None:
                yield Progress(x, 0)   # the previous row's forward (rows forwarded one by one)
            part = yield from _forward(x[g], positions[g], fwd, cache, keep[g])
            if stats is not None:
                stats.forward(len(g), part.shape[1], cache.nbytes)
            if fwd is not None:   # −inf where not forwarded
                part = part.new_full((len(g), T, part.shape[-1]), -torch.inf).masked_scatter(fwd[..., None], part)
            if logits is None:
                logits = part.new_full((B,) + part.shape[1:], -torch.inf)
            logits[g] = part
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
            prev, store = store, _store(x, mask_id, shift_type)
            if constraint is not None:
                prev = prev & store   # a revoked position's scorer leaves the cached set
        yield Progress(x, 0)
    if stats is not None:
        stats.stop(B * (T - state.prompt_len))
    return x

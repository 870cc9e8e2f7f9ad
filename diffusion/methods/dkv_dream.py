"""dKV-Cache for Dream (horseee/dKV-Cache `generation_utils/dream_generation_utils.py` `_sample`
with its `models/modeling_dream.py`): Dream's whole-canvas loop with a delayed K/V cache.

The decoding rule is Dream's own (`remask.diffusion.dream.DreamDecoder.commit`: the schedule
`linspace(1, eps, steps + 1)`, `origin`, `maskgit_plus`, `topk_margin` or `entropy`). What changes
is what each forward computes. Two position sets drive it: `prev`, the positions whose keys/values
the cache holds during this step's forward, and `store`, those it holds afterwards.

- At the start the store is every position whose *next* token is a prompt token (the logit shift:
  hidden state i scores token i + 1), i.e. the prompt but its last position.
- A step with no cache (the first; with ``cache_type="decoded"`` also every step i with
  i % `cache_reloading_step` == 0) forwards the whole sequence and caches the store's positions.
- Any other step forwards only the positions outside `prev`, attending over them and the cached
  keys/values (keys in the reference's order: forwarded positions, then cached ones, each
  ascending), and caches the store's positions, fresh where forwarded, else kept.
- After each step, ``"decoded"``: `prev` takes the store and the store is recomputed from the
  sequence (a position enters the cache one step after it qualifies, the delay), by `shift_type`:
  ``"un"`` position i once token i + 1 is decoded (position T − 1 follows token 0),
  ``"un_right"`` once tokens i and i + 1 are (T − 1 follows T − 2), ``"right"`` once token i is.
  ``"prefill"``: the first step's store stays cached for the whole generation.

Positions without a forward have no logits (upstream fills −inf). Under ``"un"`` and
``"un_right"`` every masked position is scored from a forwarded neighbour; under ``"right"`` a
masked position right after a cached one is not: its confidence is NaN, which `torch.topk` ranks
first, and its token id is 0, as upstream.

Every forward is a `ForwardRequest` the driver computes (`diffusion/parts/stepper.py`); none is computed
here. The cache (`DelayedKVCache`) plugs into the model through its KV-cache seam (`attend`): keys
enter it after RoPE (upstream re-rotates cached pre-RoPE keys at the same positions: the same
numbers). A batch runs as one forward while its rows forward and cache equally many positions
(always, except with ``"un_right"``); otherwise row by row, each row its own cache (upstream
would fail there).
"""
from __future__ import annotations

from typing import Any, Generator

import torch

from remask.models.spec import get_spec

from ..parts.cache import valid_positions
from ..parts.checks import check_generator, check_int, check_length, check_mask_id, check_model_kind, check_prompt, check_stats
from .dkv import DKVCache, DelayedKVCache, _split
from ..families.dream import DreamDecoder, DreamGenerationConfig, _validate_config
from ..parts.stats import GenerationStats
from ..parts.stepper import ForwardRequest, Progress, StepGenerator, drive

ALGORITHMS = ("origin", "maskgit_plus", "topk_margin", "entropy")


def _initial_store(x: torch.Tensor, mask_id: int) -> torch.Tensor:
    """Positions whose next token is decoded (the last position follows itself)."""
    decoded = x != mask_id
    return torch.cat([decoded[:, 1:], decoded[:, -1:]], dim=1)


def _store(x: torch.Tensor, mask_id: int, shift_type: str) -> torch.Tensor:
    """`[B, T]` positions cached after a step of ``cache_type="decoded"``."""
    decoded = x != mask_id
    if shift_type == "un":
        return torch.cat([decoded[:, 1:], decoded[:, :1]], dim=1)
    if shift_type == "un_right":
        both = decoded[:, :-1] & decoded[:, 1:]
        return torch.cat([both, both[:, -1:]], dim=1)
    return decoded   # "right"


def _counts_equal(*sets: torch.Tensor) -> bool:
    return all(bool((s.sum(dim=1) == s[0].sum()).all()) for s in sets)


def _forward(x: torch.Tensor, positions: torch.Tensor, forwarded: torch.Tensor | None, cache: DelayedKVCache,
             store: torch.Tensor) -> Generator[ForwardRequest, Any, torch.Tensor]:
    """Unshifted logits `[B, T, V]` (−inf where not forwarded) of one cached or caching forward: one
    `ForwardRequest`, used with ``yield from`` (packable with other requests' of its shape:
    `DelayedKVCache.pack`)."""
    B, T = x.shape
    if forwarded is None:
        cache.fill(store)
        logits = yield ForwardRequest(x, per_row={"position_ids": positions}, cache=cache)
    else:
        cache.reuse(forwarded, store)
        part = yield ForwardRequest(x[forwarded].view(B, -1),
                                    per_row={"position_ids": positions[forwarded].view(B, -1)}, cache=cache)
        logits = torch.full((B, T, part.shape[-1]), -torch.inf, dtype=part.dtype, device=part.device)
        logits[forwarded] = part.reshape(-1, part.shape[-1])
    cache.finish()
    return logits


@torch.no_grad()
def dkv_dream_generate(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                       *, config: DKVCache | None = None, steps: int = 512, max_new_tokens: int,
                       alg: str = "origin", alg_temp: float | None = None, temperature: float = 0.0,
                       top_p: float | None = None, top_k: int | None = None, eps: float = 1e-3,
                       mask_id: int | None = None, generator: torch.Generator | None = None,
                       stats: GenerationStats | None = None, structured_outputs: Any = None,
                       tokenizer: Any = None) -> torch.Tensor:
    """dKV-Cache's Dream sampler (greedy tokens). Returns `[B, P + max_new_tokens]`.

    `config`: a `DKVCache` with `cache_type` (None: ``"decoded"``), `shift_type` (None: ``"un"``;
    ``"decoded"`` only) and `cache_reloading_step` (upstream's `cache_steps`; ``"decoded"`` only).
    The sampling arguments are Dream's `diffusion_generate`'s; `temperature` must be 0 (`top_p` /
    `top_k` still filter the confidences, as upstream). `alg="origin"` draws its uniforms from
    `generator` (None: torch's global generator, as upstream). `attention_mask` `[B, P]`: left
    padding, hidden as Dream hides it (positions counted over real tokens). Prompts must not hold
    the mask token. The model must shift its logits (`ModelSpec.logit_shift`, Dream's layout).

    `structured_outputs` (a `remask.StructuredOutputsParams` or its JSON form; `tokenizer`: the
    model's, default the checkpoint's): the answer is held to it as `diffusion_generate` holds it
    (`dkv_dream_steps`).
    """
    structure = None
    if structured_outputs is not None:
        from ..parts.constrain import structure_for_call

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
    """`dkv_dream_generate` as a step generator (`remask.diffusion.stepper`): the arguments are
    checked now; the returned generator yields a `ForwardRequest` per forward, a `Progress` after
    it, and returns `dkv_dream_generate`'s tensor. `Progress.final` is 0 until the end (the whole
    canvas is one block: any masked position may be decoded at any step).

    `structure` (a compiled `remask.structured` structure) and `end_ids`: structured output, held
    in Dream's own commit (`DreamDecoder.commit`: the frontier masked before the rule scores, the
    commits filtered over the whole answer, `diffusion/parts/constrain.py`). Under a structure
    (only then): the loop runs past `steps` until no mask is left (the decoder's extra steps
    commit every mask, the filter keeps what the structure accepts); a position the filter
    revoked leaves the cached set at once (the position scoring it is forwarded again); and the
    position scoring each row's frontier is always forwarded (with ``shift_type="right"`` it would
    often be cached, leaving the frontier without logits)."""
    config = DKVCache(cache_type="decoded") if config is None else config
    if not isinstance(config, DKVCache):
        raise ValueError(f"config must be a remask DKVCache, got {type(config).__name__}")
    if config.variant != "decode" or config.window_size:
        raise ValueError(f"variant: dKV-Cache's Dream sampler is the delayed (decode) cache; variant="
                         f"{config.variant!r} is LLaDA's dKV-Cache-Greedy (dkv_generate)")
    if config.commit_mask_token:
        raise ValueError("commit_mask_token: Dream's sampler never commits the mask token in remask; "
                         "commit_mask_token=True is LLaDA-only (dkv_generate)")
    cache_type = config.cache_type or "decoded"
    shift_type = config.shift_type or "un"
    spec = get_spec(model) if mask_id is None else get_spec(model, mask_id=mask_id)
    check_model_kind(spec, diffusion=True, entry="dkv_dream_generate")
    check_mask_id(spec)
    if not spec.logit_shift:
        raise ValueError("model: dKV-Cache's Dream sampler caches by the logit shift (position i scores token "
                         "i + 1, ModelSpec.logit_shift); this model scores each position from itself — use "
                         "remask.diffusion.dkv.dkv_generate (LLaDA's dKV-Cache)")
    check_int("max_new_tokens", max_new_tokens, minimum=1)
    check_prompt(model, input_ids, attention_mask, name="input_ids", spec=spec, mask_in_prompt="refuse")
    B, P = input_ids.shape
    T = P + max_new_tokens
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
    return _steps(model, decoder, state, config, cache_type, shift_type, steps, attention_mask, generator, stats)


@torch.no_grad()
def _steps(model, decoder: DreamDecoder, state, config: DKVCache, cache_type: str, shift_type: str, steps: int,
           attention_mask: torch.Tensor | None, generator: torch.Generator | None,
           stats: GenerationStats | None) -> StepGenerator:
    """dKV-Cache's Dream loop (the arguments checked by `dkv_dream_steps`)."""
    mask_id, R = decoder.spec.mask_id, config.cache_reloading_step
    B, T = state.x.shape
    max_new_tokens = T - state.prompt_len
    x = state.x
    positions = state.forward_inputs.get("position_ids")
    if not torch.is_tensor(positions):
        positions = torch.arange(T, device=x.device)[None].expand(B, T)
    key_ok = valid_positions(attention_mask, T)
    everything = list(range(B))
    store, prev = _initial_store(x, mask_id), None
    groups: list[list[int]] = []
    caches: list[DelayedKVCache] = []
    constraint = state.constraint
    if stats is not None:
        stats.start()
    i = -1
    while True:
        i += 1
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
        if prev is None:
            groups = [everything] if _counts_equal(keep) else [[b] for b in everything]
            caches = [DelayedKVCache(None if key_ok is None else key_ok[g]) for g in groups]
        elif len(groups) == 1 and B > 1 and not _counts_equal(~prev, keep):
            groups, caches = [[b] for b in everything], _split(caches[0], B)
        if len(groups) == 1:
            logits = yield from _forward(x, positions, None if prev is None else ~prev, caches[0], keep)
        else:
            logits = None
            gi = 0
            for g, cache in zip(groups, caches):
                if prev is not None and not bool((~prev[g]).any()):
                    continue   # a row whose answer a structure ended: nothing left to score
                if gi:
                    yield Progress(x, 0)   # the previous row's forward (rows forwarded one by one)
                gi += 1
                part = yield from _forward(x[g], positions[g], None if prev is None else ~prev[g], cache, keep[g])
                if logits is None:
                    logits = part.new_full((B,) + part.shape[1:], -torch.inf)
                logits[g] = part
        if stats is not None:
            for g, cache in zip(groups, caches):
                n = T if prev is None else int((~prev[g[0]]).sum())
                if n:
                    stats.forward(len(g), n, cache.nbytes)
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
        stats.stop(B * max_new_tokens)
    return x

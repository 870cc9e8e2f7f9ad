"""One entry for the decoders that replace the block rule (`decoder=` in `remask.generate`,
`remask.diffusion_generate` and `remask.SamplingParams`) and the cache configs (`use_cache=`): each
is registered (`registry.py`: its config, its loop, what it reads) in its module of `diffusion/methods/`.

`decoder_steps` maps a call's arguments onto the method's step generator (`diffusion/parts/stepper.py`)
through the registry and refuses, by name, the settings the method does not read: `run_decoder`
drives it to the end (the drop-in functions), the engine one forward per step (`StepwiseDecoder`),
so both give the same tokens.
"""
from __future__ import annotations

from typing import Any

import torch

from remask.models.spec import ModelSpec

from ..parts.checks import CombinationError, changed
from ..parts.stats import GenerationStats
from ..parts.stepper import StepGenerator, drop_in
from . import registry


def is_dinfer_method(decoder: Any, use_cache: Any) -> bool:
    """A request for the block loop that runs commit rules (dInfer's): a commit rule, or the
    `VicinityCache` alone (its threshold rule)."""
    method = registry.method_of(use_cache if decoder is None else decoder)
    return method is not None and (method.is_rule if decoder is not None else method.name == "vicinity")


def decoder_steps(spec: ModelSpec, prompt: torch.Tensor, attention_mask: torch.Tensor | None, decoder: Any, *,
                  gen_length: int, block_length: int, use_cache: Any, mask_id: int | None,
                  stats: GenerationStats | None, settings: dict[str, tuple[Any, Any]] | None = None,
                  structure: Any = None, end_ids: Any = ()) -> StepGenerator:
    """The step generator of `decoder` and / or a cache config (`diffusion/parts/stepper.py`) on a model of
    `spec` (the model's `ModelSpec`: no decoder is handed the model), every argument checked at the call.
    `settings`: the entry point's other settings as ``name: (value, default)``; one set away from its
    default that the method does not read is refused by name.
    Without a decoder `VicinityCache` runs dInfer's threshold rule (0.9), `DKVCache` LLaDA's own
    schedule; `ElasticCache` takes a commit rule as `decoder`. `structure` / `end_ids`: structured
    output, enforced in every method's commits (`diffusion/parts/constrain.py`)."""
    call = method_call(spec, prompt, attention_mask, decoder, gen_length=gen_length, block_length=block_length,
                       use_cache=use_cache, mask_id=mask_id, stats=stats, settings=settings, structure=structure,
                       end_ids=end_ids)
    return call.method.loop(call)


def method_call(spec: ModelSpec, prompt: torch.Tensor, attention_mask: torch.Tensor | None, decoder: Any, *,
                gen_length: int, block_length: int, use_cache: Any, mask_id: int | None,
                stats: GenerationStats | None, settings: dict[str, tuple[Any, Any]] | None = None,
                structure: Any = None, end_ids: Any = ()) -> registry.Call:
    """`decoder_steps`' arguments, checked, as the call its method's `loop` (or `decoder`, the engine's) takes."""
    registry.check_decoder(decoder)
    cache = registry.method_of(use_cache, "use_cache")
    if use_cache is not None and not isinstance(use_cache, str) and cache is None:
        raise ValueError(f"use_cache must be None, a cache name or a remask cache config, "
                         f"got {type(use_cache).__name__}")
    if cache is not None and cache.name == "vicinity":   # dInfer's block loop and a rule (by default its threshold)
        cache, decoder = None, registry.METHODS["threshold"].config() if decoder is None else decoder
    if cache is not None and decoder is not None and not (cache.takes_rule and registry.method_of(decoder).is_rule):
        rules = ", ".join(rule.__name__ for rule in registry.rules())
        why = f"takes a commit rule ({rules}, ...) as decoder=, not a decoder with its own loop" if cache.takes_rule \
            else "runs its own schedule (its commits are part of its cache policy); it does not combine with decoder="
        raise CombinationError(f"decoder={type(decoder).__name__} with use_cache={type(use_cache).__name__}: "
                               f"{type(use_cache).__name__} {why}")
    method = registry.method_of(decoder) if cache is None else cache
    name = method.config.__name__
    if method.unshifted is not None and spec.logit_shift:
        hint = " (Dream's own dKV-Cache: remask.diffusion.methods.dkv.dkv_dream_generate)" if name == "DKVCache" else ""
        raise CombinationError(f"{method.field}={name}: {method.unshifted} reads unshifted logits (position i "
                               f"scored from itself, LLaDA's layout); this model shifts its logits by one position "
                               f"(Dream's layout, ModelSpec.logit_shift){hint}")
    settings = settings or {}
    # not given (the entry point's default): one token per step, or the method's own
    steps = settings["steps"][0] if changed(settings, ("steps",)) else None
    # a generator is the randomness of sampling: harmless (unused) with a greedy method
    unread = [key for key in changed(settings, settings) if key not in ("steps", "generator", *method.reads)]
    if "steps" not in method.reads and steps is not None and steps != gen_length:
        unread.append("steps")
    if unread:
        raise ValueError(f"{name} runs its own rule (greedy) and does not read {sorted(set(unread))}")
    common = dict(gen_length=gen_length, attention_mask=attention_mask, mask_id=mask_id, stats=stats,
                  structure=structure, end_ids=end_ids)
    return registry.Call(spec, prompt, decoder, use_cache, steps, block_length,
                         {key: value for key, (value, _) in settings.items()}, common, method)


@drop_in(decoder_steps, hidden=())
def run_decoder() -> torch.LongTensor:
    """Decode with `decoder` and / or a cache config to the end (the drop-in functions): `drive`
    over `decoder_steps` on the model's spec, the step generator the engine advances one forward at a time."""

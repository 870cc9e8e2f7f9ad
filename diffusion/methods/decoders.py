"""One interface for the decoders that replace the block rule (`decoder=` in `remask.generate`,
`remask.diffusion_generate` and `remask.SamplingParams`) and the cache configs (`use_cache=`), each
in its module of `diffusion/methods/`: `remask.FreeDave` (lossless draft-and-verify),
inclusionAI/dInfer's rules `remask.ThresholdDecoding`, `CreditDecoding`, `HierarchicalDecoding` and
its `VicinityCache`, `remask.WINO` (revocable wide-in, narrow-out), and the caches `remask.DKVCache`
(dKV-Cache-Decode's delayed cache under LLaDA's schedule), `remask.D2Cache` (d2Cache's selective
row recompute with its certainty prior) and `remask.ElasticCache` (Elastic-Cache's drift-triggered
recompute over a sliding window).

`decoder_steps` maps a call's arguments onto the method's step generator (`diffusion/parts/stepper.py`)
and refuses, by name, the settings the method does not read: `run_decoder` drives it to the end (the
drop-in functions), the engine one forward per step (`StepwiseDecoder`), so both give the same tokens.
"""
from __future__ import annotations

from typing import Any

import torch

from remask.models.spec import get_spec

from ..parts.checks import CombinationError
from ..parts.stats import GenerationStats
from ..parts.stepper import StepGenerator, drive
from . import registry


def is_dinfer_method(decoder: Any, use_cache: Any) -> bool:
    """A request for dInfer's block loop: a commit rule (`CommitRule`: dInfer's three, any other
    registered), or the `VicinityCache` alone (its threshold rule)."""
    from .dinfer import VicinityCache
    from ..parts.step import CommitRule

    return isinstance(decoder, CommitRule) or (decoder is None and isinstance(use_cache, VicinityCache))


# The methods whose loops read unshifted logits (LLaDA's layout: position i scored from itself) and
# drive LLaDA's attention themselves: refused on a model whose logits are shifted (Dream).
UNSHIFTED_ONLY = {"WINO": "WINO's shadow-block forward", "DKVCache": "LLaDA's dKV-Cache schedule",
                  "D2Cache": "d2Cache's row recompute", "ElasticCache": "Elastic-Cache's sliding window"}


def check_decoder(decoder: Any) -> None:
    if not registry.is_config("decoder", decoder):
        names = ", ".join(f"remask.{t.__name__}" for t in registry.configs("decoder"))
        raise ValueError(f"decoder must be one of {names}, got {type(decoder).__name__}")


def end_settings_refusal(method: Any, *, min_tokens: bool) -> str | None:
    """Why `method` (a decoder or cache config) cannot honour `ignore_eos` / `min_tokens`, or None.
    The methods' loops score inside their own step, so no logits hook reaches them (`min_tokens`);
    dInfer's rules and Elastic-Cache end a row at its first EOS by their own rule (`ignore_eos`)."""
    from .dinfer import VicinityCache
    from .elastic import ElasticCache
    from ..parts.step import CommitRule

    name = type(method).__name__
    if min_tokens:
        return f"{name}: its loop scores the logits inside its own step, with no logits hook the engine reaches"
    if isinstance(method, (CommitRule, VicinityCache, ElasticCache)):
        return f"{name}: it fills the rest of a row with EOS after the first EOS it decodes"
    return None


# What each method reads of an entry point's settings besides the lengths, the cache and `stats`.
READS = {"FreeDave": ("steps",), "ThresholdDecoding": (), "CreditDecoding": (), "HierarchicalDecoding": (),
         "WINO": (), "DKVCache": ("steps", "remasking", "generator"), "D2Cache": ("steps",), "ElasticCache": ()}


def run_decoder(model: torch.nn.Module, prompt: torch.Tensor, attention_mask: torch.Tensor | None, decoder: Any, *,
                gen_length: int, block_length: int, use_cache: Any, mask_id: int | None,
                stats: GenerationStats | None, settings: dict[str, tuple[Any, Any]] | None = None,
                structure: Any = None, end_ids: Any = ()) -> torch.LongTensor:
    """Decode with `decoder` and / or a cache config to the end (the drop-in functions): `drive`
    over `decoder_steps`, the step generator the engine advances one forward at a time."""
    return drive(decoder_steps(model, prompt, attention_mask, decoder, gen_length=gen_length,
                               block_length=block_length, use_cache=use_cache, mask_id=mask_id, stats=stats,
                               settings=settings, structure=structure, end_ids=end_ids), model)


def decoder_steps(model: torch.nn.Module, prompt: torch.Tensor, attention_mask: torch.Tensor | None, decoder: Any, *,
                  gen_length: int, block_length: int, use_cache: Any, mask_id: int | None,
                  stats: GenerationStats | None, settings: dict[str, tuple[Any, Any]] | None = None,
                  structure: Any = None, end_ids: Any = ()) -> StepGenerator:
    """The step generator of `decoder` and / or a cache config (`diffusion/parts/stepper.py`), every
    argument checked at the call. `settings`: the entry point's other settings as ``name: (value,
    default)``; one set away from its default that the method does not read is refused by name.
    Without a decoder `VicinityCache` runs dInfer's threshold rule (0.9), `DKVCache` LLaDA's own
    schedule; `ElasticCache` takes a commit rule as `decoder`. `structure` / `end_ids`: structured
    output, enforced in every method's commits (`diffusion/parts/constrain.py`)."""
    from .d2cache import D2Cache, d2cache_steps
    from .dinfer import ThresholdDecoding, VicinityCache, dinfer_steps
    from .dkv import DKVCache, dkv_steps
    from .elastic import ElasticCache, elastic_steps
    from .freedave import FreeDave, freedave_steps
    from .wino import WINO, wino_steps

    if decoder is not None:
        check_decoder(decoder)
    if use_cache is not None and not isinstance(use_cache, str) and not registry.is_config("use_cache", use_cache):
        raise ValueError(f"use_cache must be None, a cache name or a remask cache config, "
                         f"got {type(use_cache).__name__}")
    from ..parts.step import CommitRule

    if isinstance(use_cache, ElasticCache) and decoder is not None and not isinstance(decoder, CommitRule):
        raise CombinationError(f"decoder={type(decoder).__name__} with use_cache=ElasticCache: Elastic-Cache's window "
                               f"takes a commit rule (ThresholdDecoding, CreditDecoding, HierarchicalDecoding, "
                               f"MarginDecoding, ...) as decoder=, not a decoder with its own loop")
    if isinstance(use_cache, (DKVCache, D2Cache)) and decoder is not None:
        raise CombinationError(f"decoder={type(decoder).__name__} with use_cache={type(use_cache).__name__}: "
                               f"{type(use_cache).__name__} runs its own schedule (its commits are part of its "
                               f"cache policy); it does not combine with decoder=")
    if decoder is None and isinstance(use_cache, VicinityCache):
        decoder = ThresholdDecoding()
    method = type(use_cache).__name__ if isinstance(use_cache, (DKVCache, D2Cache, ElasticCache)) else \
        type(decoder).__name__
    if method in UNSHIFTED_ONLY and get_spec(model, mask_id=mask_id).logit_shift:
        field = "use_cache" if method != "WINO" else "decoder"
        hint = " (Dream's own dKV-Cache: remask.diffusion.methods.dkv.dkv_dream_generate)" if method == "DKVCache" else ""
        raise CombinationError(f"{field}={method}: {UNSHIFTED_ONLY[method]} reads unshifted logits (position i "
                               f"scored from itself, LLaDA's layout); this model shifts its logits by one position "
                               f"(Dream's layout, ModelSpec.logit_shift){hint}")
    settings = dict(settings or {})
    steps, steps_default = settings.get("steps", (None, None))
    if steps == steps_default:   # not given (the entry point's default): one token per step, or the method's own
        steps = None
    unread = [name for name, (value, default) in settings.items()
              # a generator is the randomness of sampling: harmless (unused) with a greedy method
              if name not in ("steps", "generator") and name not in READS.get(method, ()) and value is not default
              and value != default]
    if method not in ("DKVCache", "D2Cache") and steps is not None and steps != gen_length:
        unread.append("steps")
    if unread:
        raise ValueError(f"{method} runs its own rule (greedy) and does not read {sorted(set(unread))}")
    common = dict(gen_length=gen_length, attention_mask=attention_mask, mask_id=mask_id, stats=stats,
                  structure=structure, end_ids=end_ids)
    if isinstance(use_cache, ElasticCache):
        if block_length != gen_length:
            raise ValueError(f"block_length: ElasticCache decodes over a sliding window of "
                             f"{use_cache.window_length} masked positions (no blocks); leave block_length at "
                             f"gen_length ({gen_length}), got {block_length}")
        return elastic_steps(model, prompt, config=use_cache, rule=decoder, **common)
    if isinstance(use_cache, D2Cache):
        return d2cache_steps(model, prompt, config=use_cache, steps=gen_length if steps is None else steps,
                             block_length=block_length, **common)
    if isinstance(use_cache, DKVCache):
        return dkv_steps(model, prompt, config=use_cache, steps=gen_length if steps is None else steps,
                         block_length=block_length, remasking=settings.get("remasking", ("low_confidence", None))[0],
                         generator=settings.get("generator", (None, None))[0], **common)
    if isinstance(decoder, FreeDave):
        if registry.is_config("use_cache", use_cache):
            raise ValueError("use_cache: FreeDave takes None, 'prefix' or 'dual'")
        return freedave_steps(model, prompt, config=decoder, steps=steps, block_length=block_length,
                              use_cache=use_cache, **common)
    if isinstance(decoder, WINO):
        if use_cache is not None:
            raise ValueError("use_cache: WINO forwards the whole sequence with its shadow block (no cache)")
        return _first(wino_steps(model, prompt, config=decoder, block_length=block_length, **common))
    return dinfer_steps(model, prompt, decoder=decoder, block_length=block_length, use_cache=use_cache, **common)


def _first(steps: StepGenerator) -> StepGenerator:
    """A step generator that returns a tuple, returning its first item (WINO's `(x, forwards)`)."""
    out = yield from steps
    return out[0]

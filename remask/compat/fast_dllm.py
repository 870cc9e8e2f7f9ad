"""NVlabs/Fast-dLLM v1 entry points with their exact signatures and `(x, nfe)` returns.

Switch a Fast-dLLM script by changing one import::

    from remask.compat.fast_dllm import generate   # was: from generate import generate
    out, nfe = generate(model, prompt, steps=128, gen_length=256, block_length=32, threshold=0.9)

Confidences are computed in float64, as upstream. `generate_with_prefix_cache` and
`generate_with_dual_cache` are the cached variants (keys cached after RoPE; a dual-cache block is
always finished, where upstream's `steps`-bounded loop can leave masks — docs/quirks.md).

`dream_diffusion_generate` is Fast-dLLM's Dream block decoder (`dream/model/generation_utils_block.py`),
with its `threshold`, `block_length` and `dual_cache` keywords.
"""
from __future__ import annotations

import torch

from remask.diffusion.parts.checks import check_bool, check_int, check_model_kind
from remask.diffusion.drop_in import diffusion_generate
from remask.diffusion.families.llada import FAST_DLLM_FACTOR_PRECISION, FAST_DLLM_PRECISION, block_diffusion_generate
from remask.diffusion.parts.stats import GenerationStats
from remask.models.spec import get_spec


def _run(model, prompt, steps, gen_length, block_length, temperature, remasking, mask_id, threshold, factor,
         reference_rng, generator, use_cache):
    stats = GenerationStats()
    check_int("mask_id", mask_id, minimum=0)
    spec = get_spec(model, mask_id=mask_id)
    check_model_kind(spec, diffusion=True, entry="remask.compat.fast_dllm")
    x = block_diffusion_generate(
        model, prompt, None, steps=steps, gen_length=gen_length, block_length=block_length,
        temperature=temperature, remasking=remasking, spec=spec, threshold=threshold, factor=factor,
        precision=FAST_DLLM_FACTOR_PRECISION if factor is not None else FAST_DLLM_PRECISION, stats=stats,
        reference_rng=reference_rng, generator=generator, use_cache=use_cache)
    return x, stats.nfe


@torch.no_grad()
def generate(model, prompt, steps=128, gen_length=128, block_length=128, temperature=0.,
             remasking='low_confidence', mask_id=126336, threshold=None, factor=None, *, reference_rng=False,
             generator=None):
    """Fast-dLLM `generate`: no cache; `threshold`/`factor` parallel decoding, else LLaDA's
    schedule. Returns `(x, nfe)` with x `[B, prompt_len + gen_length]`. `reference_rng=True` samples
    (temperature > 0) with upstream's float64 torch noise, for seeded token-for-token reproduction."""
    return _run(model, prompt, steps, gen_length, block_length, temperature, remasking, mask_id, threshold, factor,
                reference_rng, generator, None)


@torch.no_grad()
def generate_with_prefix_cache(model, prompt, steps=128, gen_length=128, block_length=128, temperature=0.,
                               remasking='low_confidence', mask_id=126336, threshold=None, factor=None, *,
                               reference_rng=False, generator=None):
    """Fast-dLLM `generate_with_prefix_cache`: per block, one full forward builds the cache and
    commits the first tokens; later steps feed the block and the rest against the prefix cache.
    Returns `(x, nfe)`."""
    return _run(model, prompt, steps, gen_length, block_length, temperature, remasking, mask_id, threshold, factor,
                reference_rng, generator, "prefix")


@torch.no_grad()
def generate_with_dual_cache(model, prompt, steps=128, gen_length=128, block_length=128, temperature=0.,
                             remasking='low_confidence', mask_id=126336, threshold=None, factor=None, *,
                             reference_rng=False, generator=None):
    """Fast-dLLM `generate_with_dual_cache`: per block, one full forward caches every position;
    later steps feed only the block, overwriting its K/V in place. Returns `(x, nfe)`; the block
    is always finished (upstream can stop after `steps` with masks left)."""
    return _run(model, prompt, steps, gen_length, block_length, temperature, remasking, mask_id, threshold, factor,
                reference_rng, generator, "dual")


@torch.no_grad()
def dream_diffusion_generate(model, inputs, generation_config=None, **kwargs):
    """Fast-dLLM's Dream `diffusion_generate` from `generation_utils_block.py` (a method there):
    the keywords of Dream's `diffusion_generate` plus `threshold` (0.9), `block_length` (32) and
    `dual_cache` (False: the prefix cache), and Fast-dLLM++'s `frechet_margin` (its `v1/dream` copy of the
    file; not with `threshold`). Returns what Dream's returns (sequences, or a
    `DreamModelOutput` with `return_dict_in_generate=True`). Upstream's fixes listed in
    docs/quirks.md apply (batches decoded row by row, blocks finished)."""
    dual_cache = check_bool("dual_cache", kwargs.pop("dual_cache", False))
    kwargs.setdefault("block_length", 32)
    return diffusion_generate(model, inputs, generation_config, use_cache="dual" if dual_cache else "prefix", **kwargs)

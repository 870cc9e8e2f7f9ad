"""Plain autoregressive decoding for any `AutoModelForCausalLM`, with its KV cache.

It is the baseline the diffusion strategies are compared against, and later the APD verifier's
decoder. Token choice goes through `score_tokens` (greedy at T=0; temperature, top-k, top-p
otherwise), like every other sampler in remask.
"""
from __future__ import annotations

import numbers

import torch

from remask.models.spec import get_spec

from .checks import (ParameterTypeError, check_generator, check_int, check_model_kind, check_prompt, check_real, check_stats,
                     check_token_id, warn_if_padded_without_mask)
from .scoring import score_tokens
from .stats import GenerationStats


@torch.no_grad()
def ar_generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    *,
    generator: torch.Generator | None = None,
    stats: GenerationStats | None = None,
) -> torch.LongTensor:
    """Decode `max_new_tokens` after a (left-padded) prompt `[B, P]`.

    Rows that emitted an EOS id continue with `pad_token_id` (default: the first EOS id); decoding
    stops early once every row has finished. Returns `[B, P + max_new_tokens]`.
    """
    spec = get_spec(model)
    check_model_kind(spec, diffusion=False, entry="remask.ar_generate")
    check_prompt(model, input_ids, attention_mask, name="input_ids", spec=spec)
    check_int("max_new_tokens", max_new_tokens, minimum=1)
    check_real("temperature", temperature, low=0)
    check_int("top_k", top_k, minimum=1, allow_none=True)
    check_real("top_p", top_p, low=0, high=1, low_open=True, allow_none=True)
    check_generator(generator, input_ids.device)
    check_stats("stats", stats)
    config = model.config
    if eos_token_id is None:
        eos_token_id = getattr(config, "eos_token_id", None)
    if eos_token_id is None or isinstance(eos_token_id, numbers.Integral):
        eos_ids = [] if eos_token_id is None else [eos_token_id]
    elif isinstance(eos_token_id, (list, tuple)):
        eos_ids = list(eos_token_id)
    else:
        raise ParameterTypeError(f"eos_token_id must be an int, a list of ints or None, got {eos_token_id!r}")
    for value in eos_ids:
        check_token_id(spec, value, "eos_token_id")
    if pad_token_id is None:
        pad_token_id = getattr(config, "pad_token_id", None)
        if pad_token_id is None:
            pad_token_id = eos_ids[0] if eos_ids else 0
    check_token_id(spec, pad_token_id, "pad_token_id")
    warn_if_padded_without_mask(input_ids, attention_mask, getattr(config, "pad_token_id", None))
    max_positions = getattr(config, "max_position_embeddings", None)
    if max_positions is not None and input_ids.shape[1] + max_new_tokens > max_positions:
        raise ValueError(f"prompt length + max_new_tokens = {input_ids.shape[1] + max_new_tokens} exceeds the "
                         f"model's max_position_embeddings {max_positions}")

    if stats is not None:
        stats.start()
    B, P = input_ids.shape
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(input_ids.dtype)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=True)
    if stats is not None:
        stats.forward(B, P)
    cache = out.past_key_values
    logits = out.logits[:, -1]
    tokens = torch.full((B, max_new_tokens), pad_token_id, dtype=torch.long, device=input_ids.device)
    finished = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
    eos = torch.tensor(eos_ids, dtype=torch.long, device=input_ids.device)
    generated = 0
    for step in range(max_new_tokens):
        # A mask token the config declares (a model sharing a diffusion model's tokenizer) is never
        # emitted: no remask output holds one.
        next_token, _ = score_tokens(logits.float(), temperature=temperature, top_k=top_k, top_p=top_p,
                                     sampler="categorical", exclude_id=spec.mask_id, generator=generator)
        next_token = torch.where(finished, torch.full_like(next_token, pad_token_id), next_token)
        tokens[:, step] = next_token
        active = int((~finished).sum())
        generated += active
        if stats is not None:
            stats.step(active)
        finished |= torch.isin(next_token, eos)
        if bool(finished.all()) or step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype, device=mask.device)], dim=-1)
        position_ids = position_ids[:, -1:] + 1
        out = model(input_ids=next_token[:, None], attention_mask=mask, position_ids=position_ids,
                    past_key_values=cache, use_cache=True)
        if stats is not None:
            stats.forward(B, 1)
        cache = out.past_key_values
        logits = out.logits[:, -1]
    if stats is not None:
        stats.stop(generated)   # tokens up to and including each row's EOS
    return torch.cat([input_ids, tokens], dim=1)

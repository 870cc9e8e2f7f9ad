"""SDAR's `generate.py::block_diffusion_generate` with its exact signature and return value.

Switch a script by changing one import::

    from remask.compat.sdar import block_diffusion_generate   # was: from generate import ...
    x = block_diffusion_generate(model, prompt=tokens, mask_id=151669, gen_length=256, block_length=4,
                                 denoising_steps=4, temperature=1.0, remasking_strategy="low_confidence_dynamic")

`prompt` is the tokenizer's output (a dict with `input_ids`, batch 1, as upstream). The model is
remask's `SDARForCausalLM` (loaded without remote code) or the official remote-code model. Seeded
runs replay upstream's draws (torch's global generator; `generator=` to use another). Departures
(all where upstream breaks its own output) are in `remask.diffusion.families.sdar` and docs/quirks.md.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from remask.diffusion.families.sdar import sdar_generate


@torch.no_grad()
def block_diffusion_generate(
        model: torch.nn.Module,
        prompt: Any,
        mask_id: int,
        gen_length: int = 128,
        block_length: int = 8,
        denoising_steps: int = 8,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        remasking_strategy: str = "low_confidence_dynamic",
        confidence_threshold: float = 0.85,
        eb_threshold: float | None = None,
        stopping_criteria_idx: Sequence[int] | int | None = None,
        *,
        fill_after_stop: bool = True,
        generator: torch.Generator | None = None,
        stats: Any = None,
        use_cache: bool = True,
        decoder: Any = None,
        structured_outputs: Any = None,
        tokenizer: Any = None,
) -> torch.LongTensor:
    """Upstream's arguments, in upstream's order; returns x `[1, ceil((P + gen_length) / block_length) ·
    block_length]` (the prompt, then the decoded blocks; after a stop, the stop id where upstream
    leaves masks unless `fill_after_stop=False`). `use_cache=False` (remask's): no KV cache, every step
    forwards the sequence up to the current block under the block-causal mask — the same tokens.
    `decoder=remask.FreeDave(...)` (remask's): the tokens of the same call with fewer forwards (greedy,
    `denoising_steps == block_length`; `SDARDecoder`'s commit part, `remask.diffusion.parts.drafts`).
    `structured_outputs=remask.StructuredOutputsParams(...)` (remask's; `tokenizer=` the model's, default
    the one saved beside it): the answer is held to it block by block; `stopping_criteria_idx` end it."""
    input_ids = prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt
    model.eval()
    return sdar_generate(model, input_ids, mask_id=mask_id, gen_length=gen_length, block_length=block_length,
                         denoising_steps=denoising_steps, temperature=temperature, top_k=top_k, top_p=top_p,
                         remasking_strategy=remasking_strategy, confidence_threshold=confidence_threshold,
                         eb_threshold=eb_threshold, stopping_criteria_idx=stopping_criteria_idx,
                         fill_after_stop=fill_after_stop, generator=generator, stats=stats, use_cache=use_cache,
                         decoder=decoder, structured_outputs=structured_outputs, tokenizer=tokenizer)

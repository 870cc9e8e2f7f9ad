"""LLaDA2's `model.generate` (LLaDA2.0 and LLaDA2.1 remote code) with its arguments and return value.

    import remask
    remask.patch(model)                      # or: from remask.compat.llada2 import generate
    out = model.generate(inputs=input_ids, gen_length=512, block_length=32, steps=32, threshold=0.95)
    text = tokenizer.decode(out[0], skip_special_tokens=True)

`editing_threshold=None` (the default) runs LLaDA2.0's decoder; a number runs LLaDA2.1's token
editing (`editing_threshold`, `max_post_steps`, `num_to_transfer`), where 0 means "edit whenever the
argmax differs" as in LLaDA2.1's own S-mode — unlike diffusers' LLaDA2Pipeline, which treats
None, 0 and negatives as off. Returns the continuation `[1, n]`, up to and including the first EOS.
Seeded sampling replays upstream's draws (`torch.multinomial` on torch's global generator) with
`reference_rng=True`; `reference_rng=False` draws from `generator`. Departures are listed in
`remask.diffusion.families.llada2`.
"""
from __future__ import annotations

from typing import Any

import torch

from remask.diffusion.families.llada2 import LLaDA2Decoder, LLaDA2Decoding
from remask.diffusion.parts.blocks import rule_unread
from remask.diffusion.parts.checks import check_bool, check_generator, check_stats
from remask.diffusion.parts.constrain_loops import structure_for_call
from remask.diffusion.parts.rules import check_rule_on_loop, is_rule
from remask.diffusion.parts.stepper import decode_alone
from remask.models.llada2 import LLADA2_EOS_ID, LLADA2_MASK_ID


@torch.no_grad()
def generate(model: torch.nn.Module, inputs: Any = None, temperature: float = 0.0, block_length: int = 32,
             steps: int = 32, gen_length: int = 2048, top_p: float | None = None, top_k: int | None = None,
             eos_early_stop: bool = False, minimal_topk: int = 1, threshold: float = 0.95,
             editing_threshold: float | None = None, max_post_steps: int = 16, eos_id: int | None = None,
             mask_id: int | None = None, num_to_transfer: int = 1, *, use_cache: bool = True,
             reference_rng: bool = True, generator: torch.Generator | None = None, stats: Any = None,
             decoder: Any = None, structured_outputs: Any = None, tokenizer: Any = None,
             **unsupported: Any) -> torch.LongTensor:
    """LLaDA2's generate: upstream's arguments in upstream's order (2.0's, then 2.1's). `eos_id` /
    `mask_id` default to the model config's ids, then to the release's (156892 / 156895).
    `decoder=remask.FreeDave(...)` (remask's): the tokens of the same call with fewer forwards
    (greedy, `steps == block_length`; `LLaDA2Decoder`'s commit part, `remask.diffusion.parts.drafts`).
    `decoder=remask.ThresholdDecoding(...)` / `HierarchicalDecoding(...)` / `CreditDecoding(...)`
    (remask's): dInfer's rule chooses each step's commits in LLaDA2.0's loop (greedy; `steps`,
    `top_p`, `top_k`, `minimal_topk`, `threshold` and 2.1's settings are not read and must stay at
    their defaults; `LLaDA2Decoder`'s commit part).
    `structured_outputs=remask.StructuredOutputsParams(...)` (remask's; `tokenizer=` the model's, default
    the one saved beside it): the answer is held to it block by block, EOS allowed only where it is
    complete; 2.1's edits keep the committed prefix valid (`diffusion/parts/constrain_loops.py`)."""
    if unsupported:
        raise ValueError(f"generate: unknown argument(s) {sorted(unsupported)}")
    if inputs is None:
        raise ValueError("inputs: the prompt ids [1, length] are required")
    input_ids = inputs["input_ids"] if isinstance(inputs, dict) or hasattr(inputs, "keys") else inputs
    config = getattr(model, "config", None)
    if eos_id is None:
        eos_id = getattr(config, "eos_token_id", None)
        eos_id = (eos_id[0] if isinstance(eos_id, (list, tuple)) and eos_id else eos_id)
        eos_id = LLADA2_EOS_ID if eos_id is None else eos_id
    if mask_id is None:
        mask_id = getattr(config, "mask_token_id", None)
        mask_id = LLADA2_MASK_ID if mask_id is None else mask_id
    check_bool("reference_rng", reference_rng)
    if reference_rng and generator is not None:
        raise ValueError("generator: reference_rng=True replays upstream's draws from torch's global generator; "
                         "pass reference_rng=False to draw from a generator of your own")
    check_stats("stats", stats)
    kwargs = dict(mask_id=mask_id, eos_id=eos_id, gen_length=gen_length, block_length=block_length,
                  steps=steps, temperature=temperature, top_k=top_k, top_p=top_p,
                  minimal_topk=minimal_topk, threshold=threshold, editing_threshold=editing_threshold,
                  max_post_steps=max_post_steps, num_to_transfer=num_to_transfer,
                  eos_early_stop=eos_early_stop, use_cache=use_cache)
    if is_rule(decoder):
        check_rule_on_loop(decoder, "LLaDA2", temperature=temperature, replaces="threshold rule and schedule",
                           unread=rule_unread(LLaDA2Decoding, generate, kwargs))
    decoder = LLaDA2Decoder(decoder, **kwargs)
    decoder.constrain(structure_for_call(structured_outputs, model, tokenizer, mask_id, gen_length))
    if torch.is_tensor(input_ids):
        check_generator(generator, input_ids.device)
        vocab = getattr(config, "vocab_size", None)
        if vocab is not None and input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
            raise ValueError(f"inputs: token ids must be in [0, {vocab})")
    model.eval()
    state = decoder.start(input_ids)
    if stats is not None:
        stats.start()
    decode_alone(decoder, model, state, generator, stats)
    out = decoder.output(state)
    if stats is not None:
        stats.stop(int(out.shape[1]))
    return out

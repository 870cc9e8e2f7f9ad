"""Fast-dLLM v2's two entry points with their exact signatures and return values: `batch_sample`
(NVlabs/Fast-dLLM `v2/generation_functions.py`, which `v2/eval.py` binds onto the model) and the
official model's `generate` (what `v2/run_chatbot.py` calls).

Switch a script by changing one line::

    from remask.compat.fast_dllm_v2 import batch_sample, generate
    out = batch_sample(model, input_ids, tokenizer, block_size=32, max_new_tokens=256, small_block_size=8,
                       min_len=min_len, seq_len=seq_len)          # was: model.mdm_sample(input_ids, ...)
    ids = generate(model, input_ids, max_new_tokens=512, small_block_size=8, threshold=0.9)

`remask.patch(model)` makes `model.generate(...)` this `generate` (remask's `FastDLLMV2ForCausalLM`
has it as its own method already, as the official model does). The model is remask's
`FastDLLMV2ForCausalLM` (loaded without remote code) or anything with the official forward
arguments. Seeded runs replay upstream's draws (torch's global generator; `generator=` to use
another). Departures, all where upstream breaks its own output, are listed in
`remask.diffusion.families.fast_dllm_v2` and docs/block-diffusion.md.
"""
from __future__ import annotations

from typing import Any

import torch

from remask.diffusion.parts.checks import ParameterTypeError, check_bool, check_bools, check_int
from remask.diffusion.families.fast_dllm_v2 import fast_dllm_v2_batch_sample, fast_dllm_v2_generate


def _pad_id(model: torch.nn.Module, tokenizer: Any) -> int:
    pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    if pad is None:   # upstream reads tokenizer.pad_token_id (and fails without one); fall back to the model's
        from remask.models import get_spec

        pad = get_spec(model).pad_id
    if pad is None:
        raise ValueError("tokenizer has no pad_token_id and the model's config declares none: pass a tokenizer "
                         "with pad_token_id")
    return check_int("tokenizer.pad_token_id", pad, minimum=0)


@torch.no_grad()
def batch_sample(model: torch.nn.Module, input_ids: torch.LongTensor, tokenizer: Any, block_size: int,
                 max_new_tokens: int, small_block_size: int, min_len: int, seq_len: torch.Tensor,
                 mask_id: int = 151665, threshold: float = 0.95, stop_token: int = 151645,
                 use_block_cache: bool = False, top_p: float = 0.95, temperature: float = 0.0, *,
                 prefill_whole_block_prompt: bool = True, generator: torch.Generator | None = None,
                 stats: Any = None) -> dict[int, torch.Tensor]:
    """Upstream's arguments, in upstream's order (less `self`): `input_ids` `[B, W]` (row b's prompt
    is its first `seq_len[b]` tokens; `eval.py` pads with the mask id), `min_len = min(seq_len)`.
    Returns {row: 1-D LongTensor}: the prompt, the decoded blocks (pad after the first stop of a row
    that committed one), as upstream. `prefill_whole_block_prompt=False` keeps upstream's handling of
    `min_len == block_size` (the first block never reaches the cache)."""
    check_bool("prefill_whole_block_prompt", prefill_whole_block_prompt)
    model.eval()
    return fast_dllm_v2_batch_sample(
        model, input_ids, seq_len, min_len=min_len, block_size=block_size, max_new_tokens=max_new_tokens,
        small_block_size=small_block_size, pad_token=_pad_id(model, tokenizer), mask_id=mask_id, threshold=threshold,
        stop_token=stop_token, use_block_cache=use_block_cache, top_p=top_p, temperature=temperature,
        prefill_whole_block_prompt=prefill_whole_block_prompt, generator=generator, stats=stats)


@torch.no_grad()
def generate(model: torch.nn.Module, input_ids: torch.LongTensor, max_new_tokens: int | None = None,
             max_length: int | None = None, tokenizer: Any = None, mask_id: int = 151665, threshold: float = 1,
             small_block_size: int = 8, block_size: int = 32, stop_token: int = 151645, stopping_criteria: Any = None,
             top_p: float = 0.95, temperature: float = 0, use_block_cache: bool = False,
             return_dict_in_generate: bool = False, output_scores: bool = False, output_hidden_states: bool = False,
             *, prefill_whole_block_prompt: bool = True, generator: torch.Generator | None = None, stats: Any = None,
             use_cache: bool = True, decoder: Any = None, structured_outputs: Any = None, **kwargs: Any):
    """The official model's `generate(input_ids, max_new_tokens=None, max_length=None, tokenizer=None,
    mask_id=151665, threshold=1, small_block_size=8, block_size=32, stop_token=151645, ...)`: returns
    the token ids `[B, n]` (the prompt, the answer up to and including its first stop), or with
    `return_dict_in_generate` a `GenerateDecoderOnlyOutput` with `sequences`. `tokenizer` and
    `stopping_criteria` are accepted and unused, as upstream. Batches: each row is decoded alone and
    shorter rows are right-padded with `stop_token` (upstream's stop test and truncation read the
    whole batch). `output_scores` / `output_hidden_states` are not collected (remask's decoder does
    not keep every forward's logits); asking for them raises. `decoder=remask.FreeDave(...)`
    (remask's): the same tokens with fewer forwards (greedy; without `use_block_cache`).
    `structured_outputs=remask.StructuredOutputsParams(...)` (remask's): each answer held to it,
    compiled against `tokenizer` (here it is read; default the one saved beside the model)."""
    kwargs.pop("attention_mask", None)   # upstream accepts and ignores it (its forward builds its own mask)
    kwargs.pop("generation_config", None)
    if kwargs:
        raise ParameterTypeError(f"generate() got unexpected arguments {sorted(kwargs)}")
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a LongTensor [batch, length], got {getattr(input_ids, 'shape', None)}")
    if max_new_tokens is None and max_length is None:
        raise ValueError("Either max_new_tokens or max_length must be specified")
    if max_new_tokens is None:
        check_int("max_length", max_length, minimum=input_ids.shape[1])
        max_new_tokens = max_length - input_ids.shape[1]
    check_bools(return_dict_in_generate=return_dict_in_generate, output_scores=output_scores,
                output_hidden_states=output_hidden_states, use_block_cache=use_block_cache)
    if output_scores or output_hidden_states:
        raise ValueError("output_scores / output_hidden_states are not supported by remask's Fast-dLLM v2 generate")
    model.eval()
    sequences = fast_dllm_v2_generate(
        model, input_ids, max_new_tokens=max_new_tokens, mask_id=mask_id, threshold=threshold,
        small_block_size=small_block_size, block_size=block_size, stop_token=stop_token, top_p=top_p,
        temperature=temperature, use_block_cache=use_block_cache, prefill_whole_block_prompt=prefill_whole_block_prompt,
        generator=generator, stats=stats, use_cache=use_cache, decoder=decoder,
        structured_outputs=structured_outputs, tokenizer=tokenizer if structured_outputs is not None else None)
    if return_dict_in_generate:
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        return GenerateDecoderOnlyOutput(sequences=sequences, scores=None, hidden_states=None)
    return sequences

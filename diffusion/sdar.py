"""SDAR's block diffusion decoding (JetAstra/SDAR `generate.py::block_diffusion_generate`).

Autoregressive over blocks, parallel inside one: the prompt's whole blocks are prefilled into the
KV cache (`store_kv=True`); then each block (the first one holds the prompt's tail) is denoised by
forwards over the block against the cache (`store_kv=False`), each step sampling every position
(temperature, top-k, top-p; the confidence is the sampled token's probability) and committing some
masked positions by `remasking_strategy`: ``"sequential"`` (the first n masks, left to right),
``"low_confidence_static"`` (the n most confident), ``"low_confidence_dynamic"`` (every one above
`confidence_threshold` when there are at least n, else the n most confident), ``"entropy_bounded"``
(lowest entropy first while the running sum stays ≤ `eb_threshold`); n follows the per-step schedule
(`block_length` split over `denoising_steps`, remainder first). A finished block is forwarded once
more with `store_kv=True` and decoding moves on; it stops after a block holding a stop id.

Upstream's draws are replayed: `torch.multinomial` over the block's filtered, tempered softmax with
torch's global generator (or `generator`). Departures, on by default because upstream breaks its own
output (docs/quirks.md): temperature 0 is greedy (upstream divides by zero); a step never commits
more positions than the block has masks (upstream's top-k fallback then overwrites prompt or
committed tokens); `entropy_bounded` uses each position's entropy (upstream's is a sum over the
block of the sampled probability and crashes on an unset variable); positions left masked after a
stop are filled with the first stop id (upstream returns them as mask tokens); a sampled mask token
is replaced by the most probable other token (upstream commits it, the position stays masked and
the loop then fails with an IndexError).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache

from .checks import check_choice, check_generator, check_int, check_real, check_stats
from .stats import GenerationStats

REMASKING_STRATEGIES = ("sequential", "low_confidence_static", "low_confidence_dynamic", "entropy_bounded")


def num_transfer_schedule(block_length: int, steps: int) -> torch.Tensor:
    """Positions to commit at each step: `block_length` split evenly, the remainder to the first steps."""
    base, remainder = divmod(block_length, steps)
    counts = torch.full((steps,), base, dtype=torch.int64)
    counts[:remainder] += 1
    return counts


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """SDAR's preprocessing: logits / T (T ≠ 1), top-k (k > 0), top-p (p < 1); removed tokens get −inf."""
    if temperature != 1.0 and temperature > 0:
        logits = logits / temperature
    if top_k > 0:
        kth = torch.topk(logits, top_k).values[..., -1, None]
        logits = torch.where(logits < kth, torch.full_like(logits, float("-inf")), logits)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        remove = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1) > top_p
        remove[..., 1:] = remove[..., :-1].clone()
        remove[..., 0] = False
        logits = logits.masked_fill(torch.zeros_like(remove).scatter(-1, order, remove), float("-inf"))
    return logits


def sample_block(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                 generator: torch.Generator | None, mask_id: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, their probabilities, the distributions) for logits `[1, L, V]`. T > 0: upstream's
    multinomial draw over the filtered softmax (its draws); T = 0: the argmax (upstream divides by 0).
    A draw of `mask_id` (which upstream commits, leaving the position masked) becomes the most
    probable other token — only there, so every other draw is upstream's."""
    shape, V = logits.shape[:-1], logits.shape[-1]
    probs = F.softmax(filter_logits(logits.reshape(-1, V), temperature, top_k, top_p), dim=-1)
    if temperature > 0:
        token = torch.multinomial(probs, num_samples=1, generator=generator)
    else:
        token = probs.argmax(dim=-1, keepdim=True)
    if mask_id is not None and bool((token == mask_id).any()):
        other = probs.index_fill(-1, torch.tensor([mask_id], device=probs.device), -1.0).argmax(dim=-1, keepdim=True)
        token = torch.where(token == mask_id, other, token)
    token_prob = torch.gather(probs, -1, token)
    return token.view(*shape), token_prob.view(*shape), probs.view(*shape, V)


def select_positions(strategy: str, mask_index: torch.Tensor, x0_p: torch.Tensor, probs: torch.Tensor,
                     count: int, confidence_threshold: float | None, eb_threshold: float | None) -> torch.Tensor:
    """Which masked positions of a `[1, L]` block to commit this step (never more than it has)."""
    transfer = torch.zeros_like(mask_index)
    masks = int(mask_index.sum())
    count = min(count, masks)   # upstream's top-k would pick unmasked positions beyond the masks
    if strategy == "sequential":
        first = int(mask_index[0].nonzero()[0])
        transfer[0, first:first + count] = True
        return transfer & mask_index
    if strategy == "entropy_bounded":
        entropy = -(probs * torch.log(probs.clamp_min(1e-12))).sum(dim=-1)
        entropy = torch.where(mask_index, entropy, torch.inf)
        sorted_entropy, order = torch.sort(entropy, dim=1)
        k = int(torch.searchsorted(torch.cumsum(sorted_entropy, dim=1)[0],
                                   torch.tensor(eb_threshold, dtype=entropy.dtype), right=False))
        transfer[0, order[0, :max(1, min(k, masks))]] = True
        return transfer
    confidence = torch.where(mask_index, x0_p, -torch.inf)
    if strategy == "low_confidence_dynamic":
        high = confidence[0] > confidence_threshold
        if int(high.sum()) >= count:
            transfer[0] = high
            return transfer
    transfer[0, torch.topk(confidence[0], count).indices] = True
    return transfer


@torch.no_grad()
def sdar_generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
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
    stopping_criteria_idx: Sequence[int] | None = None,
    fill_after_stop: bool = True,
    generator: torch.Generator | None = None,
    stats: GenerationStats | None = None,
) -> torch.LongTensor:
    """SDAR's loop on one prompt `[1, P]`; returns x `[1, ceil((P + gen_length) / block_length) · block_length]`."""
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError(f"prompt input_ids must be a LongTensor [1, length], got {getattr(input_ids, 'shape', None)}")
    if input_ids.shape[0] != 1:
        raise ValueError(f"SDAR's block_diffusion_generate decodes one prompt (batch 1), got batch {input_ids.shape[0]}; "
                         "use remask.LLM for many")
    check_int("mask_id", mask_id, minimum=0)
    check_int("gen_length", gen_length, minimum=1)
    check_int("block_length", block_length, minimum=1)
    check_int("denoising_steps", denoising_steps, minimum=1)
    check_real("temperature", temperature, low=0)
    check_int("top_k", top_k, minimum=0)
    check_real("top_p", top_p, low=0, high=1, low_open=True)
    check_choice("remasking_strategy", remasking_strategy, REMASKING_STRATEGIES)
    if remasking_strategy == "low_confidence_dynamic":
        check_real("confidence_threshold", confidence_threshold, low=0, high=1)
    if remasking_strategy == "entropy_bounded":
        check_real("eb_threshold", eb_threshold, low=0, low_open=True)
    check_generator(generator, input_ids.device)
    check_stats("stats", stats)
    stops = [] if stopping_criteria_idx is None else (
        [stopping_criteria_idx] if isinstance(stopping_criteria_idx, int) else list(stopping_criteria_idx))
    for stop in stops:
        check_int("stopping_criteria_idx", stop, minimum=0)
    if bool((input_ids == mask_id).any()):
        raise ValueError(f"the prompt holds the mask id {mask_id}: SDAR decodes only after the prompt")
    device = input_ids.device
    prompt_length = input_ids.shape[1]
    cache = DynamicCache()
    num_blocks = (prompt_length + gen_length + block_length - 1) // block_length
    total_length = num_blocks * block_length
    block_mask = torch.tril(torch.ones(num_blocks, num_blocks, device=device))
    attention = block_mask.repeat_interleave(block_length, 0).repeat_interleave(block_length, 1)[None]
    position_ids = torch.arange(total_length, device=device)[None]
    x = torch.full((1, total_length), mask_id, dtype=torch.long, device=device)
    x[:, :prompt_length] = input_ids
    prefill_blocks = prompt_length // block_length
    prefill = prefill_blocks * block_length
    if stats is not None:
        stats.start()
    if prefill > 0:
        model(x[:, :prefill], attention_mask=attention[:, :prefill, :prefill], position_ids=position_ids[:, :prefill],
              past_key_values=cache, use_cache=True, store_kv=True)
        if stats is not None:
            stats.forward(1, prefill)
    schedule = num_transfer_schedule(block_length, denoising_steps).tolist()
    stopped = None
    for block in range(prefill_blocks, num_blocks):
        span = slice(block * block_length, (block + 1) * block_length)
        cur_x = x[:, span].clone()
        cur_mask = attention[:, span, :(block + 1) * block_length]
        cur_positions = position_ids[:, span]
        step = 0
        while True:
            mask_index = cur_x == mask_id
            if not bool(mask_index.any()):
                model(cur_x, attention_mask=cur_mask, position_ids=cur_positions, past_key_values=cache,
                      use_cache=True, store_kv=True)   # the finished block joins the cache
                if stats is not None:
                    stats.forward(1, block_length)
                break
            # The schedule commits every mask within `denoising_steps` steps; only the entropy-bounded
            # rule (its own count) can need more, and then at least one position per step.
            count = schedule[step] if step < len(schedule) else 1
            logits = model(cur_x, attention_mask=cur_mask, position_ids=cur_positions, past_key_values=cache,
                           use_cache=True, store_kv=False).logits
            if stats is not None:
                stats.forward(1, block_length)
            x0, x0_p, probs = sample_block(logits, temperature, top_k, top_p, generator, mask_id)
            transfer = select_positions(remasking_strategy, mask_index, x0_p, probs, count,
                                        confidence_threshold, eb_threshold)
            cur_x[transfer] = x0[transfer]
            if stats is not None:
                stats.step(int(transfer.sum()))
            step += 1
        x[:, span] = cur_x
        if stops and any(stop in x[:, prompt_length:] for stop in stops):
            stopped = (block + 1) * block_length
            break
    if stopped is not None and fill_after_stop:
        x[:, stopped:] = stops[0]
    if stats is not None:
        stats.stop(int(total_length - prompt_length))
    return x

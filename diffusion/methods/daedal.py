"""DAEDAL: variable-length generation for LLaDA (Li-Jinsong/DAEDAL `models/LLaDA_DAEDAL.py` `generate`).

The answer to "which gen_length?": start short and let the model's end-of-sequence confidence say
when the canvas is long enough. `gen_length` (the engine's `max_tokens`) is only the most it may grow
to; the output is `[1, P + L]` with L ≤ gen_length.

1. **Initial length expansion.** The canvas is `initial_gen_length` masks. Each forward scores the
   EOS confidence: scanning from the canvas end back to the prompt, the probabilities of the (at most
   `eos_check_tokens`) positions whose argmax is EOS, summed and divided by `eos_check_tokens`. Below
   `eos_confidence_threshold` the canvas grows by `expansion_factor` masks (capped at gen_length) and
   is forwarded again. Then `eos_check_tokens // 2` EOS tokens are appended (capped at gen_length).
2. **Iterative denoising and mask insertion**, a block of `block_length` at a time (from the first
   block still holding a mask). Per forward: commit the block's masked positions with confidence above
   `high_conf_threshold` (argmax not the mask token), else the most confident one whose argmax is not
   the mask token (none: the best token other than the mask token of the position with the highest
   such probability). Unless the EOS confidence reaches `expand_eos_confidence_threshold` or the canvas
   is at gen_length, the least confident uncommitted masked block position below `low_conf_threshold`
   becomes `expansion_factor` masks (the canvas cut at gen_length).

Every forward sees the whole canvas (no cache). Rows of a batch are decoded each alone (upstream
decodes a batch together, its pad tokens attended); a shorter row is filled with EOS to the longest.

Structured output (`structure`): `parts/constrain.py`'s filter over the current block, the answer being the
canvas as it then is; a block is passed once the matcher consumed it, and a canvas consumed with the
structure still open grows by `expansion_factor` masks (docs/quirks.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from remask.models.spec import ModelSpec

from ..parts.checks import NoWorkBound, check_config, check_int, check_ints, check_method_call, check_real, checked
from ..parts.constrain import CommitFilter, end_ids_of
from ..parts.scoring import score_tokens
from ..parts.stats import GenerationStats
from ..parts.stepper import ForwardRequest, Progress, StepGenerator, drop_in, guided_forward


@dataclass(frozen=True)
class DAEDAL(NoWorkBound):
    """DAEDAL's parameters, upstream's names and defaults. `max_gen_length` is the entry point's
    `gen_length` / `max_tokens`; `block_length` the entry point's (upstream's default: 32).

    No work bound of its own: `gen_length` caps every length (an `initial_gen_length` past it starts at gen_length,
    as upstream ends up), each forward commits a position."""

    initial_gen_length: int = checked(64, check_int, minimum=1)
    high_conf_threshold: float = checked(0.90, check_real)
    low_conf_threshold: float = checked(0.10, check_real)
    expansion_factor: int = checked(8, check_int, minimum=0)   # 0: an insertion drops the mask
    eos_confidence_threshold: float = checked(0.5, check_real)
    expand_eos_confidence_threshold: float = checked(0.9, check_real)
    eos_check_tokens: int = checked(32, check_int, minimum=1)   # upstream divides by it


def eos_confidence(x0: torch.Tensor, conf: torch.Tensor, P: int, eos_id: int, count: int) -> torch.Tensor:
    """Upstream's EOS confidence of one row (`x0`, `conf` `[T]`): the confidences of the last `count`
    positions past the prompt whose argmax is EOS, summed from the end as Python floats, over
    `count`, as a float32 scalar (compared in float32, as upstream's tensor)."""
    where = (x0[P:] == eos_id).nonzero().flatten().flip(0)[:count] + P
    return torch.tensor(sum(conf[where].tolist()) / count, dtype=torch.float32)


def daedal_steps(spec: ModelSpec, prompt: torch.Tensor, *, config: DAEDAL | None = None,
                 gen_length: int = 2048, block_length: int = 32, temperature: float = 0.0,
                 generator: torch.Generator | None = None, attention_mask: torch.Tensor | None = None,
                 mask_id: int | None = None, stats: GenerationStats | None = None, structure: Any = None,
                 end_ids: Any = (), cfg_scale: float = 0.0) -> StepGenerator:
    """`daedal_generate` as a step generator, its arguments checked at the call: each forward's
    canvas is as long as the row's canvas then is; a `Progress` after each denoising forward (`final`:
    the blocks before the current one, which no insertion moves)."""
    config = check_config("config", config, DAEDAL, "a remask DAEDAL")
    check_ints(1, gen_length=gen_length, block_length=block_length)
    check_real("temperature", temperature, low=0)
    check_real("cfg_scale", cfg_scale, low=0)
    spec, stats = check_method_call(spec, prompt, attention_mask, stats, generator=generator, mask_id=mask_id)
    if spec.eos_id is None:
        raise ValueError("DAEDAL reads the EOS confidence: the model has no eos id")
    return _daedal_loop(config, spec, prompt.to(spec.device), attention_mask, gen_length, block_length, stats,
                        (structure, end_ids_of(spec, end_ids)), (temperature, generator, cfg_scale))


@drop_in(daedal_steps)
def daedal_generate() -> torch.Tensor:
    """DAEDAL decoding: `[B, P + L]`, L ≤ `gen_length` the longest row's length. `temperature` > 0 samples each
    denoising forward's tokens as upstream (float32 Gumbel-max over the canvas, drawn from `generator`);
    `cfg_scale` > 0 guides the denoising forwards as upstream (LLaDA's unsupervised CFG, the prompt masked)."""


@torch.no_grad()
def _daedal_loop(config: DAEDAL, spec: ModelSpec, prompt: torch.Tensor, attention_mask: torch.Tensor | None,
                 max_length: int, block_length: int, stats: GenerationStats, structure: tuple[Any, list[int]],
                 sampling: tuple[float, torch.Generator | None, float]) -> StepGenerator:
    stats.start()
    rows = []
    for b in range(prompt.shape[0]):
        keys = None if attention_mask is None or bool(attention_mask[b].all()) else attention_mask[b:b + 1]
        rows.append((yield from _daedal_row(config, spec, prompt[b:b + 1], keys, max_length, block_length, stats,
                                             structure, sampling)))
    stats.stop(sum(row.shape[1] - prompt.shape[1] for row in rows))
    # a shorter row is filled with EOS to the longest
    return pad_sequence([row[0] for row in rows], batch_first=True, padding_value=spec.eos_id)


def _daedal_row(config: DAEDAL, spec: ModelSpec, prompt: torch.Tensor, keys: torch.Tensor | None, max_length: int,
                block_length: int, stats: GenerationStats, structure: tuple[Any, list[int]],
                sampling: tuple[float, torch.Generator | None, float]) -> StepGenerator:
    mask_id, eos_id, P, device = spec.mask_id, spec.eos_id, prompt.shape[1], prompt.device
    temperature, generator, cfg_scale = sampling

    def forward(x: torch.Tensor, sample: bool = False):
        """The forward's logits, its tokens and their (untempered) probabilities, the EOS confidence (from the
        argmax, as upstream's), and the denoising forwards' (`sample`) float32 uniforms where `temperature` > 0.
        A denoising forward with `cfg_scale` > 0 is guided, `un + (cfg+1)(cond − un)`, its unconditional row the
        canvas with every prompt position masked (upstream's stage 1 is not guided)."""
        guided, inputs = sample and cfg_scale > 0, spec.forward_inputs(keys, x.shape[1])
        if guided:
            un_x = x.index_fill(1, torch.arange(P, device=device), mask_id)
            logits = yield from guided_forward(spec, x, un_x, inputs, cfg_scale)
        else:
            logits = yield ForwardRequest.call(x, inputs, spec=spec)
        stats.forward(2 if guided else 1, x.shape[1])
        x0, conf = score_tokens(logits[0])   # greedy; the untempered softmax's probability (logits' dtype)
        eos_conf, noise = eos_confidence(x0, conf, P, eos_id, config.eos_check_tokens), None
        if sample and temperature > 0:   # upstream's draw: torch.rand_like over the whole canvas's logits
            noise = torch.rand(logits[0].shape, dtype=torch.float32, device=device, generator=generator)
            x0, conf = score_tokens(logits[0], temperature=temperature, noise=noise, noise_dtype=torch.float32)
        return logits[0], x0, conf, eos_conf, noise

    def masks(n: int, fill: int = mask_id) -> torch.Tensor:
        return torch.full((1, n), fill, dtype=torch.long, device=device)

    # 1. initial length expansion
    length = min(config.initial_gen_length, max_length)
    x = torch.cat([prompt, masks(length)], dim=1)
    while True:
        eos_conf = (yield from forward(x))[3]
        stats.step(0)
        grown = min(length + config.expansion_factor, max_length)
        if not bool(eos_conf < config.eos_confidence_threshold) or grown <= length:
            break
        x, length = torch.cat([x, masks(grown - length)], dim=1), grown
    tail = min(length + config.eos_check_tokens // 2, max_length) - length
    x, length = torch.cat([x, masks(tail, eos_id)], dim=1), length + tail
    constraint = CommitFilter.start(*structure, 1, mask_id, P, length)
    # 2. iterative denoising and mask insertion
    current = P
    while current < P + length:
        logits, x0, conf, eos_conf, noise = yield from forward(x, sample=True)
        masked = x[0] == mask_id
        block = torch.zeros_like(masked)
        end = min(current + block_length, P + length)
        block[current:end] = True
        if constraint is not None:   # the frontier's token and confidence from its masked logits (parts/constrain.py)
            logits, prior = constraint.mask_frontier(logits[None], current, end, current)[0], x[:, current:end].clone()
            f = constraint.frontier(0)
            if current <= f < end:
                x0[f:f + 1], conf[f:f + 1] = score_tokens(
                    logits[f:f + 1], temperature=temperature, noise=None if noise is None else noise[f:f + 1],
                    noise_dtype=torch.float32)
        commit = (conf > config.high_conf_threshold) & block & masked & (x0 != mask_id)
        candidates = torch.where(block & masked)[0]
        if not bool(commit.any()) and candidates.numel():   # (none: a block of held tokens the filter judges)
            order = torch.sort(conf[candidates], descending=True).indices
            usable = order[x0[candidates[order]] != mask_id]
            if usable.numel():
                commit[candidates[usable[0]]] = True
            else:   # every candidate's argmax is the mask token: the best other token of the best position
                stuck = logits[candidates]
                stuck[:, mask_id] = -torch.inf
                best, tokens = torch.max(torch.softmax(stuck, dim=-1), dim=-1)
                pick = torch.argmax(best)
                x0[candidates[pick]], commit[candidates[pick]] = tokens[pick], True
        x[0, commit] = x0[commit]
        if constraint is not None:   # keep what the structure accepts; an end token fills the rest of the canvas
            constraint.filter(x, prior, x0[None, current:end], logits[None], current, end, current)
        stats.step(int((masked & (x[0] != mask_id)).sum()))
        if not bool(eos_conf >= config.expand_eos_confidence_threshold) and length < max_length:
            low = torch.where((conf < config.low_conf_threshold) & block & (x[0] == mask_id))[0]
            if low.numel():
                at = int(low[torch.topk(conf[low], 1, largest=False).indices])
                length = min(length + config.expansion_factor - 1, max_length)
                x = torch.cat([x[:, :at], masks(config.expansion_factor), x[:, at + 1:]], dim=1)[:, :P + length]
        if constraint is not None:
            if constraint.frontier(0) >= P + length and not constraint.matchers[0].ended and length < max_length:
                # the canvas is full and the structure open: it grows, as an insertion would
                grown = min(length + max(config.expansion_factor, 1), max_length)
                x, length = torch.cat([x, masks(grown - length)], dim=1), grown
            constraint.answer_len = length
        while current < P + length and not (bool((x[0, current:current + block_length] == mask_id).any())
                                            if constraint is None else
                                            constraint.unsettled(x, current, current + block_length)[0]):
            current += block_length
        yield Progress(x, current - P)
    return x

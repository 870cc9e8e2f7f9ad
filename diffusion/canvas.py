"""Uniform-noise block diffusion (DiffusionGemma): canvases denoised against an encoder's KV cache.

There is no mask token. A canvas of `canvas_length` positions starts as uniform random tokens; each
step the decoder scores it, every position gets a sample and an entropy, and the step's decision
(`entropy_bound_accept`, the EB-sampler) *commits* the accepted positions to their sample while
every other position is *renoised* (re-drawn uniformly). A canvas ends when the argmax canvas is
stable and confident (`stable_and_confident`) or after `max_denoising_steps`; the argmax canvas is
the output, then the encoder appends it to the cache and the next canvas starts.

`canvas_generate` is the drop-in for `DiffusionGemmaForBlockDiffusion.generate`: the same keyword
arguments (read by transformers' own `DiffusionGemmaGenerationConfig`, so the same defaults and
errors) and the same return type. It drives the model through `models.diffusion_gemma.CanvasModel`
(the model's own encoder, decoder and cache). With ``reference_rng=True`` it makes transformers'
random draws in transformers' order (`torch.randint` for each canvas, `torch.multinomial` then
`torch.randint` per step, over the whole batch), so a seeded call returns `model.generate`'s tokens.
By default the step runs on the fused kernels (`remask.kernels.canvas`): the sample (Gumbel-max
over the tempered logits), argmax and entropy in one pass over the vocabulary, then the EB decision
and the renoise in one launch; see docs/diffusion-gemma.md.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch

from remask.kernels.canvas import canvas_score, canvas_update
from remask.models.diffusion_gemma import CanvasModel, require_diffusion_gemma

from .checks import check_bool, check_choice, check_generator, check_instance, check_int, check_real, check_stats
from .stats import GenerationStats

REMASK_KWARGS = ("reference_rng", "generator", "stats", "canvas_sampler")
MODEL_KWARGS = ("attention_mask", "decoder_input_ids", "self_conditioning_logits")


# --- the step's pure functions: score → decide → update --------------------------------------------

def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per position, as transformers computes it
    (`torch.distributions.Categorical(logits=...).entropy()`)."""
    return torch.distributions.Categorical(logits=logits).entropy()


def entropy_bound_accept(entropy: torch.Tensor, entropy_bound: float) -> torch.Tensor:
    """The EB-sampler's decision: per row, accept the lowest-entropy positions while the sum of the
    accepted entropies minus the largest of them stays ≤ `entropy_bound` (the lowest is always
    accepted). Returns a bool mask of `entropy`'s shape."""
    sorted_entropy, order = torch.sort(entropy, dim=-1, descending=False)
    within = torch.cumsum(sorted_entropy, dim=-1) - sorted_entropy <= entropy_bound
    return torch.scatter(torch.zeros_like(within), -1, order, within)


def commit_and_renoise(sample: torch.Tensor, accepted: torch.Tensor, noise_tokens: torch.Tensor) -> torch.Tensor:
    """The update: accepted positions take their sample, every other one a fresh uniform token."""
    return torch.where(accepted, sample, noise_tokens)


class StabilityTracker:
    """`StableAndConfidentStoppingCriteria`'s rule per row: the argmax canvas equal to each of the
    last `stability_threshold` ones, and the mean entropy below `confidence_threshold`."""

    def __init__(self, stability_threshold: int, confidence_threshold: float):
        self.stability_threshold = stability_threshold
        self.confidence_threshold = confidence_threshold
        self.history: torch.Tensor | None = None

    def reset(self) -> None:
        self.history = None

    def __call__(self, argmax_canvas: torch.Tensor, mean_entropy: torch.Tensor) -> torch.Tensor:
        if self.stability_threshold == 0:
            stable = torch.ones(argmax_canvas.shape[0], dtype=torch.bool, device=argmax_canvas.device)
        else:
            if self.history is None:
                self.history = torch.full((self.stability_threshold, *argmax_canvas.shape), -1,
                                          dtype=argmax_canvas.dtype, device=argmax_canvas.device)
            stable = (self.history == argmax_canvas[None]).all(dim=-1).all(dim=0)
            self.history = torch.roll(self.history, shifts=-1, dims=0)
            self.history[-1] = argmax_canvas
        return stable & (mean_entropy < self.confidence_threshold)


@dataclass(frozen=True)
class CanvasSampler:
    """remask's decisions for uniform-noise canvases (DiffusionGemma), next to the reference's.

    rule: which positions a step accepts (the others are renoised) —
      ``"entropy_bound"`` the EB-sampler (transformers'; its bound is `sampler_config.entropy_bound`),
      ``"threshold"`` every position whose most probable token has probability ≥ `threshold`
      (Fast-dLLM's rule on the maximum probability; at least the most confident position),
      ``"top_k"`` the `top_k` lowest-entropy positions.
    freeze_after: a position whose argmax has come out the same at this many consecutive steps after
      the first (1: equal to the previous step's) is committed to it for good (never renoised again; a mask-free early commit), and a canvas whose
      positions are all frozen is finished. None: off (the reference).
    """

    rule: str = "entropy_bound"
    threshold: float | None = None
    top_k: int | None = None
    freeze_after: int | None = None

    def __post_init__(self):
        check_choice("rule", self.rule, CANVAS_RULES)
        if self.rule == "threshold":
            check_real("threshold", self.threshold, low=0, high=1, low_open=True)
        elif self.threshold is not None:
            raise ValueError(f"threshold applies to rule='threshold' only (rule={self.rule!r})")
        if self.rule == "top_k":
            check_int("top_k", self.top_k, minimum=1)
        elif self.top_k is not None:
            raise ValueError(f"top_k applies to rule='top_k' only (rule={self.rule!r})")
        if self.freeze_after is not None:
            check_int("freeze_after", self.freeze_after, minimum=1)


CANVAS_RULES = ("entropy_bound", "threshold", "top_k")


def accept_positions(sampler: CanvasSampler, entropy: torch.Tensor, top_prob: torch.Tensor,
                     entropy_bound: float) -> torch.Tensor:
    """The decision of `sampler`'s rule: a bool mask over `[B, L]`."""
    if sampler.rule == "entropy_bound":
        return entropy_bound_accept(entropy, entropy_bound)
    if sampler.rule == "threshold":
        best = torch.zeros_like(top_prob, dtype=torch.bool).scatter(-1, top_prob.argmax(-1, keepdim=True), True)
        return (top_prob >= sampler.threshold) | best
    k = min(sampler.top_k, entropy.shape[-1])
    order = torch.sort(entropy, dim=-1, stable=True).indices[..., :k]
    return torch.zeros_like(entropy, dtype=torch.bool).scatter(-1, order, True)


def _seed(generator: torch.Generator | None) -> int:
    device = generator.device if generator is not None else "cpu"
    return int(torch.randint(0, 2**31 - 1, (), device=device, generator=generator))


def score_canvas(processed_logits: torch.Tensor, *, reference_rng: bool, generator: torch.Generator | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sample, argmax, entropy, top_prob) per position of the processed (tempered) logits `[B, L, V]`.

    reference_rng: transformers' formulation — float32 softmax, `torch.multinomial` over the
    flattened batch (its draws), `torch.argmax`, `Categorical(...).entropy()`. Otherwise the fused
    kernel (`remask.kernels.canvas.canvas_score`) draws the sample by Gumbel-max (the same
    distribution, from the kernel's own stream) and returns all four in one pass.
    """
    B, L, V = processed_logits.shape
    if reference_rng:
        probs = torch.softmax(processed_logits, dim=-1, dtype=torch.float32)
        sample = torch.multinomial(probs.view(-1, V), num_samples=1, generator=generator).view(B, L)
        argmax = torch.argmax(processed_logits, dim=-1)
        return sample, argmax, token_entropy(processed_logits), probs.max(dim=-1).values
    out = canvas_score(processed_logits.reshape(B * L, V), 1.0, seed=_seed(generator))
    return tuple(t.view(B, L) for t in out)


# --- the loop ----------------------------------------------------------------------------------------

def _generation_config(model, generation_config, kwargs: dict[str, Any]):
    """transformers' own config handling: its defaults, its `update`, its `validate` (errors name
    the parameter); returns (config, model_kwargs)."""
    module = require_diffusion_gemma()
    config = copy.deepcopy(generation_config or model.generation_config or module.DiffusionGemmaGenerationConfig())
    if not isinstance(config, module.DiffusionGemmaGenerationConfig):
        config = module.DiffusionGemmaGenerationConfig(**config.to_dict())
    config.update(**model.generation_config.to_dict(), defaults_only=True, allow_custom_entries=True)
    config.update(**config._get_default_generation_params(), defaults_only=True)
    model_kwargs = config.update(**kwargs)
    config.validate()
    unknown = sorted(set(model_kwargs) - set(MODEL_KWARGS))
    if unknown:
        raise ValueError(f"unexpected keyword argument(s) {unknown} for DiffusionGemma generation; accepted: every "
                         f"DiffusionGemmaGenerationConfig field, {list(MODEL_KWARGS)} and remask's "
                         f"{list(REMASK_KWARGS)} (images, `pixel_values`, are not supported by remask's loop)")
    return config, model_kwargs


def canvas_generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    generation_config: Any = None,
    *,
    past_key_values: Any = None,
    streamer: Any = None,
    logits_processor: Any = None,
    stopping_criteria: Any = None,
    reference_rng: bool = False,
    generator: torch.Generator | None = None,
    stats: GenerationStats | None = None,
    canvas_sampler: CanvasSampler | None = None,
    **kwargs: Any,
):
    """Drop-in for `DiffusionGemmaForBlockDiffusion.generate(input_ids, **kwargs)`.

    Keyword arguments: every `DiffusionGemmaGenerationConfig` field (`max_new_tokens` or
    `max_length`, `max_denoising_steps`, `sampler_config`, `t_min`, `t_max`,
    `stability_threshold`, `confidence_threshold`, `eos_token_id`, `pad_token_id`,
    `return_dict_in_generate`, …), `attention_mask` (2-D, left padding), `decoder_input_ids`
    (the first canvas), `self_conditioning_logits` (for the first step), `logits_processor` and
    `stopping_criteria` (applied first, as transformers does), `streamer` (`put`, and `put_draft`
    with each step's argmax canvas). remask adds `reference_rng` (replay transformers' random
    draws), `generator` (the random source; default torch's global one, as transformers),
    `stats` (forwards and tokens) and `canvas_sampler` (a `CanvasSampler`: remask's accept rules
    and early commit; default the reference's EB-sampler).

    Returns a `DiffusionGemmaGenerationOutput` (`sequences`, `tokens_per_forward`,
    `past_key_values`), or the `[B, T]` sequences when `return_dict_in_generate=False`.
    """
    module = require_diffusion_gemma()
    from transformers.generation.logits_process import LogitsProcessorList
    from transformers.generation.stopping_criteria import (EosTokenCriteria, MaxLengthCriteria,
                                                           StoppingCriteriaList)

    check_bool("reference_rng", reference_rng)
    check_generator(generator, input_ids.device)
    check_stats("stats", stats)
    check_instance("canvas_sampler", canvas_sampler, CanvasSampler, "a remask.CanvasSampler")
    sampler = canvas_sampler or CanvasSampler()
    if past_key_values is not None:
        raise ValueError("past_key_values: remask's canvas loop builds its own cache; pass the whole prompt")
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a 2-D tensor [batch, length], got {getattr(input_ids, 'shape', None)}")
    config, model_kwargs = _generation_config(model, generation_config, kwargs)
    canvas_model = CanvasModel(model)
    L, V = canvas_model.canvas_length, canvas_model.vocab_size
    B, cur_len = input_ids.shape
    device = input_ids.device
    if config.max_length and config.max_new_tokens == 256:   # transformers' rule: max_new_tokens wins unless default
        max_length, max_new_tokens = config.max_length, config.max_length - cur_len
    else:
        max_new_tokens, max_length = config.max_new_tokens, config.max_new_tokens + cur_len
    prompt_length = cur_len

    attention_mask = model_kwargs.pop("attention_mask", None)
    if attention_mask is None:
        attention_mask = torch.ones((B, cur_len), dtype=torch.bool, device=device)
    elif attention_mask.dim() != 2 or tuple(attention_mask.shape) != (B, cur_len):
        raise ValueError(f"attention_mask must be 2-D with input_ids' shape {(B, cur_len)}, "
                         f"got {tuple(attention_mask.shape)}")
    attention_mask = attention_mask.bool()
    decoder_attention_mask = torch.nn.functional.pad(attention_mask, (0, L), value=True)
    encoder_positions = torch.arange(0, cur_len, dtype=torch.int32, device=device)[None]
    decoder_positions = torch.arange(cur_len, cur_len + L, dtype=torch.int32, device=device)[None]

    processors = LogitsProcessorList(logits_processor or [])
    if config.t_min is not None and config.t_max is not None:
        processors.append(module.LinearTemperatureScheduleLogitsProcessor(config.t_min, config.t_max,
                                                                          config.max_denoising_steps))
    criteria = StoppingCriteriaList(stopping_criteria or [])
    if config.max_length is not None:
        criteria.append(MaxLengthCriteria(config.max_length))
    eos = None
    if config.eos_token_id is not None:
        criteria.append(EosTokenCriteria(config.eos_token_id))
        eos = torch.tensor(config.eos_token_id, device=device)
    tracker = None
    if config.stability_threshold is not None and config.confidence_threshold is not None:
        tracker = StabilityTracker(config.stability_threshold, config.confidence_threshold)
    entropy_bound = config.sampler_config.entropy_bound

    if stats is not None:
        stats.start()
    cache = canvas_model.new_cache()
    finished_sequences = torch.zeros(B, dtype=torch.bool, device=device)
    decoder_forwards = torch.zeros(B, dtype=torch.int, device=device)
    if streamer is not None:
        streamer.put(input_ids.cpu())
    first = True
    for _ in range(math.ceil(max_new_tokens / L)):
        cache = canvas_model.encode(input_ids if first else input_ids[:, -L:], attention_mask, encoder_positions,
                                    cache)
        first = False
        # transformers draws the random canvas even when `decoder_input_ids` replaces it (an eager default)
        random_canvas = torch.randint(0, V, (B, L), device=device, generator=generator)
        canvas = model_kwargs.pop("decoder_input_ids", random_canvas)
        self_conditioning = model_kwargs.pop("self_conditioning_logits", None)
        masks = canvas_model.decoder_masks(canvas, cache, decoder_attention_mask)
        finished_denoising = torch.zeros(B, dtype=torch.bool, device=device)
        if tracker is not None:
            tracker.reset()
        argmax_canvas = canvas
        frozen = torch.zeros((B, L), dtype=torch.bool, device=device)
        stable_steps = torch.zeros((B, L), dtype=torch.long, device=device)
        for cur_step in reversed(range(1, config.max_denoising_steps + 1)):
            running = ~(finished_denoising | finished_sequences)
            decoder_forwards += running
            logits = canvas_model.denoise(canvas, self_conditioning, masks, cache, decoder_positions)
            if stats is not None:
                stats.forward(B, L)
            # transformers passes the step as an int32 tensor: the temperature is computed in float32
            processed = processors(input_ids, logits, cur_step=torch.tensor(cur_step, dtype=torch.int32,
                                                                            device=device))
            sample, new_argmax, entropy, top_prob = score_canvas(processed, reference_rng=reference_rng,
                                                                 generator=generator)
            if sampler.rule == "entropy_bound" and not reference_rng:   # decide + renoise: one launch
                new_canvas, accepted = canvas_update(sample, entropy, entropy_bound, vocab_size=V,
                                                     seed=_seed(generator))
            else:
                accepted = accept_positions(sampler, entropy, top_prob, entropy_bound)
                noise_tokens = torch.randint(0, V, (B, L), device=device, generator=generator)
                new_canvas = commit_and_renoise(sample, accepted, noise_tokens)
            if sampler.freeze_after is not None:   # early commit: a stable argmax is kept for good
                new_argmax = torch.where(frozen, argmax_canvas, new_argmax)
                if cur_step < config.max_denoising_steps:   # from the second step: a previous argmax exists
                    stable_steps = torch.where(new_argmax == argmax_canvas, stable_steps + 1, 0)
                    frozen = frozen | (stable_steps >= sampler.freeze_after)
                new_canvas = torch.where(frozen, new_argmax, new_canvas)
                accepted = accepted | frozen
            if finished_denoising.any():   # finished rows keep their state (and self-conditioning logits)
                keep = finished_denoising
                new_argmax = torch.where(keep[:, None], argmax_canvas, new_argmax)
                new_canvas = torch.where(keep[:, None], canvas, new_canvas)
                processed = torch.where(keep[:, None, None], self_conditioning, processed)
                if tracker is not None:   # transformers recomputes the entropy of what it kept
                    entropy = token_entropy(processed) if reference_rng else torch.where(
                        keep[:, None], token_entropy(processed), entropy)
            if tracker is not None:
                finished_denoising |= tracker(new_argmax, entropy.mean(dim=-1))
            if sampler.freeze_after is not None:
                finished_denoising |= frozen.all(dim=-1)
            if stats is not None:
                stats.step(int(accepted[running].sum()))
            canvas, argmax_canvas = new_canvas, new_argmax
            self_conditioning = processed.to(canvas_model.embedding_dtype)
            if streamer is not None and hasattr(streamer, "put_draft"):
                streamer.put_draft(value=argmax_canvas.cpu())
            if bool(finished_denoising.all()):
                break
        input_ids = torch.cat([input_ids, argmax_canvas], dim=-1)
        input_ids, finished_sequences = _finish_canvas(input_ids, finished_sequences, criteria, config, L, eos)
        if streamer is not None:
            streamer.put(input_ids[:, -L:].cpu())
        if bool(finished_sequences.all()):
            break
        cur_len += L
        decoder_attention_mask = torch.nn.functional.pad(decoder_attention_mask, (0, L), value=True)
        attention_mask = torch.nn.functional.pad(attention_mask, (0, L), value=True)
        encoder_positions = decoder_positions
        decoder_positions = torch.arange(cur_len, cur_len + L, dtype=torch.int32, device=device)[None]
    if streamer is not None:
        streamer.end()
    new_tokens = input_ids[:, prompt_length:]
    valid = (new_tokens != config.pad_token_id).sum(dim=-1) if config.pad_token_id is not None else \
        torch.full((B,), new_tokens.shape[1], device=device)
    if stats is not None:
        stats.stop(int(valid.sum()))
    if not getattr(config, "return_dict_in_generate", True):
        return input_ids
    return module.DiffusionGemmaGenerationOutput(sequences=input_ids, tokens_per_forward=valid / decoder_forwards,
                                                 past_key_values=cache)


def _finish_canvas(input_ids, finished_sequences, criteria, config, L, eos):
    """After a canvas: rows finished before get pad over it; rows finishing now (EOS in it, or the
    length reached) get pad after their first EOS — transformers' `_finalize_canvas`."""
    finished_now = criteria(input_ids, None, new_token_length=L)
    before = finished_sequences
    finished_sequences = before | finished_now
    if config.pad_token_id is not None and bool(finished_sequences.any()):
        input_ids[before, -L:] = config.pad_token_id
        if eos is not None and bool(finished_now.any()):
            new_tokens = input_ids[:, -L:]
            is_eos = torch.isin(new_tokens, eos)
            seen = is_eos.cumsum(dim=-1)
            new_tokens[(seen > 0) & ~((seen == 1) & is_eos)] = config.pad_token_id
    return input_ids, finished_sequences

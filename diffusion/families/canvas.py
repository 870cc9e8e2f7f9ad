"""Uniform-noise block diffusion (DiffusionGemma): canvases denoised against an encoder's KV cache.

No mask token: a canvas starts as uniform random tokens; each step the decision (the EB-sampler,
`entropy_bound_accept`) commits the accepted positions to their sample and renoises the rest. A canvas
ends when its argmax is stable and confident or after `max_denoising_steps`; that argmax is the output,
appended to the encoder's cache before the next canvas. `canvas_generate` is the drop-in for
`DiffusionGemmaForBlockDiffusion.generate`; with ``reference_rng=True`` it makes transformers' random
draws in its order (`torch.randint` per canvas, `torch.multinomial` then `torch.randint` per step, over
the batch), so a seeded call returns `model.generate`'s tokens; by default the step runs on the fused
kernels (`remask.kernels.canvas`). See docs/diffusion-gemma.md.
"""
from __future__ import annotations

import copy
import inspect
import math
from dataclasses import dataclass, fields
from typing import Any, Generator, Sequence

import torch

from remask.kernels.canvas import canvas_score, canvas_update
from remask.models.diffusion_gemma import CanvasModel, require_diffusion_gemma
from remask.models.hf_compat import with_cache_field
from remask.models.spec import ModelSpec, get_spec

from ..parts.checks import (MAX_LOOP_STEPS, NoWorkBound, check_at_most, check_bool, check_choice, check_generator,
                            check_instance, check_int, check_real, check_stats, checked)
from ..parts.constrain_loops import Constrainable, compile_for, constrain_canvas
from ..parts.scoring import draw_categorical, draw_seed
from ..parts.selection import entropy_bound_accept
from ..parts.protocol import Decoder, Together, answer_alone, answer_together
from ..parts.stats import GenerationStats
from ..parts.step import Decision, apply_decision
from ..parts.stepper import ForwardRequest, drive

REMASK_KWARGS = ("reference_rng", "generator", "stats", "canvas_sampler")
MODEL_KWARGS = ("attention_mask", "decoder_input_ids", "self_conditioning_logits")


# --- the step's pure functions: score → decide → update --------------------------------------------

def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per position, as transformers (`Categorical(logits=...).entropy()`)."""
    return torch.distributions.Categorical(logits=logits).entropy()


class StabilityTracker:
    """`StableAndConfidentStoppingCriteria`'s rule per row: the argmax canvas equal to each of the
    last `stability_threshold` ones, and the mean entropy below `confidence_threshold`."""

    def __init__(self, stability_threshold: int, confidence_threshold: float):
        self.stability_threshold, self.confidence_threshold = stability_threshold, confidence_threshold
        self.history: torch.Tensor | None = None

    def __call__(self, argmax_canvas: torch.Tensor, mean_entropy: torch.Tensor) -> torch.Tensor:
        if self.history is None:   # no canvas before: never equal (threshold 0: an empty history, always stable)
            self.history = torch.full((self.stability_threshold, *argmax_canvas.shape), -1,
                                      dtype=argmax_canvas.dtype, device=argmax_canvas.device)
        stable = (self.history == argmax_canvas[None]).all(dim=-1).all(dim=0)
        if self.stability_threshold > 0:   # the oldest canvas out, this one in
            self.history = torch.cat([self.history[1:], argmax_canvas[None]])
        return stable & (mean_entropy < self.confidence_threshold)


@dataclass(frozen=True)
class CanvasSampler:
    """remask's decisions for uniform-noise canvases (DiffusionGemma). `rule`: the positions a step
    accepts (the rest renoised): ``"entropy_bound"`` the EB-sampler (transformers'), ``"threshold"``
    top probability ≥ `threshold` (Fast-dLLM's rule; at least the most confident), ``"top_k"`` the
    `top_k` lowest-entropy ones. `freeze_after`: an argmax the same at this many consecutive steps is
    committed for good (a mask-free early commit; a canvas of frozen positions is finished)."""

    rule: str = "entropy_bound"
    threshold: float | None = None
    top_k: int | None = None
    freeze_after: int | None = None

    def __post_init__(self):
        check_choice("rule", self.rule, ("entropy_bound", "threshold", "top_k"))
        for name, value in (("threshold", self.threshold), ("top_k", self.top_k)):
            if self.rule != name and value is not None:
                raise ValueError(f"{name} applies to rule={name!r} only (rule={self.rule!r})")
        if self.rule == "threshold":
            check_real("threshold", self.threshold, low=0, high=1, low_open=True)
        elif self.rule == "top_k":
            check_int("top_k", self.top_k, minimum=1)
        check_int("freeze_after", self.freeze_after, minimum=1, allow_none=True)


def check_stability(stability_threshold: int | None, max_denoising_steps: int, what: str) -> None:
    """`stability_threshold` (a history of that many canvases) at most `max_denoising_steps`: a larger
    one never stops a canvas early and only sizes the history (10**9 of them was an out-of-memory kill)."""
    check_at_most("CanvasDecoding.stability_threshold", stability_threshold, max_denoising_steps, what)


@dataclass(frozen=True)
class CanvasDecoding(NoWorkBound):
    """DiffusionGemma's canvas loop on an engine request (`SamplingParams(decoder=CanvasDecoding(...))`, JSON
    ``{"name": "canvas", ...}``): the generation settings a request may set (None: the checkpoint's; transformers
    checks the rest) and `sampler`, remask's decisions (None: the reference's EB-sampler). No token count bounds
    max_denoising_steps's loop (canvases are redrawn whole): a cap, ~20x the checkpoint's 48 (`MAX_LOOP_STEPS`);
    stability_threshold at most a canvas's steps (the checkpoint's: at the engine)."""

    qualified = True
    max_denoising_steps: int | None = checked(None, check_int, minimum=1, maximum=MAX_LOOP_STEPS, allow_none=True)
    t_min: float | None = checked(None, check_real, low=0, low_open=True, allow_none=True)
    t_max: float | None = checked(None, check_real, low=0, low_open=True, allow_none=True)
    entropy_bound: float | None = checked(None, check_real, low=0, low_open=True, allow_none=True)
    stability_threshold: int | None = checked(None, check_int, minimum=0, allow_none=True)
    confidence_threshold: float | None = checked(None, check_real, low=0, low_open=True, allow_none=True)
    sampler: CanvasSampler | None = checked(None, check_instance, cls=CanvasSampler, what="a remask.CanvasSampler")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_stability(self.stability_threshold, self.max_denoising_steps or MAX_LOOP_STEPS,
                        "MAX_LOOP_STEPS" if self.max_denoising_steps is None else "CanvasDecoding.max_denoising_steps")

    def generation_kwargs(self, **extra: Any) -> dict[str, Any]:
        """`canvas_generate` keyword arguments of the settings given (`entropy_bound` in a `sampler_config`) and
        `extra`."""
        kw = {f.name: getattr(self, f.name) for f in fields(self)   # `sampler` is remask's, not transformers'
              if f.name != "sampler" and getattr(self, f.name) is not None}
        if "entropy_bound" in kw:
            kw["sampler_config"] = require_diffusion_gemma().EntropyBoundSamplerConfig(kw.pop("entropy_bound"))
        return {**kw, **extra}


def accept_positions(sampler: CanvasSampler, entropy: torch.Tensor, top_prob: torch.Tensor,
                     entropy_bound: float) -> torch.Tensor:
    """The decision of `sampler`'s rule: a bool mask over `[B, L]`."""
    if sampler.rule == "entropy_bound":
        return entropy_bound_accept(entropy, entropy_bound)
    if sampler.rule == "threshold":
        best = torch.zeros_like(top_prob, dtype=torch.bool).scatter(-1, top_prob.argmax(-1, keepdim=True), True)
        return (top_prob >= sampler.threshold) | best
    order = torch.sort(entropy, dim=-1, stable=True).indices[..., :sampler.top_k]   # all when top_k > L
    return torch.zeros_like(entropy, dtype=torch.bool).scatter(-1, order, True)


def reference_score(processed_logits: torch.Tensor, generator: torch.Generator | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sample, argmax, entropy, top_prob) per position of the processed logits `[B, L, V]` in transformers'
    formulation (float32 softmax, `torch.multinomial` over the flat batch: its draws, `reference_rng`)."""
    probs = torch.softmax(processed_logits, dim=-1, dtype=torch.float32)
    return (draw_categorical(probs, generator), torch.argmax(processed_logits, dim=-1),
            token_entropy(processed_logits), probs.max(dim=-1).values)


def score_and_update(items: list[tuple]) -> list[tuple]:
    """`Together` work of canvas steps on the fused kernels, each item `(processed logits [B, L, V], score seed,
    update seed or None, entropy bound, V)`: (sample, argmax, entropy, top_prob) per position from `canvas_score` in
    one pass (Gumbel-max: the reference's distribution), then with an update seed the EB-sampler's `canvas_update`
    (new canvas, accepted; else None, None). One item draws from its int seeds; several (one row each: their key)
    are scored and updated in one call each, every row from its own seeds, as alone."""
    if len(items) == 1:
        processed, score_seed, update_seed, bound, V = items[0]
        scored = tuple(t.view(processed.shape[:2]) for t in canvas_score(processed.flatten(0, 1), 1.0, seed=score_seed))
        updated = canvas_update(scored[0], scored[2], bound, vocab_size=V, seed=update_seed) \
            if update_seed is not None else (None, None)
        return [(*scored, *updated)]
    processed, score_seeds, update_seeds, bounds, vocab_sizes = zip(*items)
    stacked = torch.cat(processed)   # [n, L, V]
    seeds = lambda values: torch.tensor(values, dtype=torch.int64, device=stacked.device)
    scored = tuple(t.view(stacked.shape[:2]) for t in canvas_score(stacked.flatten(0, 1), 1.0,
                                                                  seed=seeds(score_seeds)))
    updated = canvas_update(scored[0], scored[2], bounds[0], vocab_size=vocab_sizes[0], seed=seeds(update_seeds)) \
        if update_seeds[0] is not None else (None, None)
    return [tuple(None if t is None else t[i:i + 1] for t in (*scored, *updated)) for i in range(len(items))]


# --- the loop ----------------------------------------------------------------------------------------

def resolve_generation_config(model, generation_config, kwargs: dict[str, Any]):
    """The config by transformers' own defaults, `update` and `validate` (errors name the parameter); keyword arguments
    that are not config fields are refused (`canvas_generate` takes its model inputs, `MODEL_KWARGS`, out first)."""
    module = require_diffusion_gemma()
    config = copy.deepcopy(generation_config or model.generation_config or module.DiffusionGemmaGenerationConfig())
    if not isinstance(config, module.DiffusionGemmaGenerationConfig):
        config = module.DiffusionGemmaGenerationConfig(**config.to_dict())
    config.update(**model.generation_config.to_dict(), defaults_only=True, allow_custom_entries=True)
    config.update(**config._get_default_generation_params(), defaults_only=True)
    unknown = sorted(config.update(**kwargs))
    config.validate()
    if unknown:
        raise ValueError(f"unexpected keyword argument(s) {unknown} for DiffusionGemma generation; accepted: every "
                         f"DiffusionGemmaGenerationConfig field, {list(MODEL_KWARGS)} and remask's "
                         f"{list(REMASK_KWARGS)} (images, `pixel_values`, are not supported by remask's loop)")
    return config


@dataclass(eq=False)
class CanvasState:
    """Rows under the canvas loop: `input_ids` (the prompt and the finished canvases), the canvas
    being denoised and its last argmax, `cur_step` (counting down from `max_denoising_steps`). Until the
    first canvas opens (`masks` None), `canvas` and `self_conditioning` hold the caller's
    `decoder_input_ids` / `self_conditioning_logits` for it, if any."""

    input_ids: torch.Tensor
    prompt_length: int
    max_new_tokens: int
    attention_mask: torch.Tensor
    encoder_positions: torch.Tensor
    decoder_positions: torch.Tensor
    cache: Any
    finished_sequences: torch.Tensor
    decoder_forwards: torch.Tensor
    canvases_left: int
    tracker: StabilityTracker | None = None   # a fresh one per canvas (None: no stability stop)
    canvas: torch.Tensor | None = None
    argmax_canvas: torch.Tensor | None = None
    self_conditioning: torch.Tensor | None = None
    masks: Any = None
    finished_denoising: torch.Tensor | None = None
    stable_steps: torch.Tensor | None = None   # per position: steps its argmax stayed (`freeze_after`: frozen)
    cur_step: int = 0
    done: bool = False
    pending: Any = None                    # under the engine: the step under way (a step generator) ...
    request: ForwardRequest | None = None  # ... and the forward it waits for (None: a pause)
    matchers: Any = None                   # structured output: one matcher per row (`CanvasDecoder.constrain`)
    error: Exception | None = None         # raised by its step while receiving with others: failed at its next step

    @property
    def x(self) -> torch.Tensor:
        """The sequences so far, with the current canvas's argmax after them (the draft)."""
        if self.done or self.argmax_canvas is None:
            return self.input_ids
        return torch.cat([self.input_ids, self.argmax_canvas], dim=-1)


class CanvasDecoder(Constrainable, Decoder):
    """The canvas loop as a decoder: a step denoises every row (one decoder forward, plus the encoder's
    when it opens a canvas), built from the model's spec (`models.diffusion_gemma.CanvasModel`). `config`: a
    resolved `DiffusionGemmaGenerationConfig`; `prompt_cache`: a `remask.caches.PromptCache` (single unpadded rows
    take the prompt's cache)."""

    def __init__(self, spec: ModelSpec, config: Any, sampler: CanvasSampler | None = None, *,
                 reference_rng: bool = False, logits_processor: Any = None, stopping_criteria: Any = None,
                 prompt_cache: Any = None):
        module = require_diffusion_gemma()
        from transformers.generation import stopping_criteria as stopping
        self.module, self.config, self.sampler = module, config, sampler or CanvasSampler()
        self.reference_rng, self.canvas_model = reference_rng, CanvasModel(spec)
        processors = list(logits_processor or [])   # the caller's first, then the schedule (transformers' order)
        if config.t_min is not None and config.t_max is not None:
            processors.append(module.LinearTemperatureScheduleLogitsProcessor(config.t_min, config.t_max,
                                                                              config.max_denoising_steps))
        # as `LogitsProcessorList` calls them (those with more than two parameters get the step), each signature
        # read once here rather than at every step
        self.processors = [(p, len(inspect.signature(p.__call__).parameters) > 2) for p in processors]
        self.criteria = stopping.StoppingCriteriaList(stopping_criteria or [])
        if config.max_length is not None:
            self.criteria.append(stopping.MaxLengthCriteria(config.max_length))
        self.eos_ids = config.eos_token_id
        if self.eos_ids is not None:
            self.criteria.append(stopping.EosTokenCriteria(self.eos_ids))
        self.entropy_bound = config.sampler_config.entropy_bound
        self.prompt_cache = prompt_cache

    def _default_end_ids(self) -> tuple[Any, str]:
        """Structured output (`constrain`; `constrain_loops.constrain_canvas`: the committed canvas renoised from
        its first refused position, the argmax canvas valid at every step) ends at the config's EOS ids."""
        return self.eos_ids, "the generation config has no eos_token_id"

    def num_final(self, state: CanvasState) -> int:
        """Generated positions that are final: those of finished canvases."""
        return min(state.input_ids.shape[1] - state.prompt_length, state.max_new_tokens)

    def start(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
              *, decoder_input_ids: torch.Tensor | None = None,
              self_conditioning_logits: torch.Tensor | None = None) -> CanvasState:
        config, L = self.config, self.canvas_model.canvas_length
        (B, cur_len), device = input_ids.shape, input_ids.device
        # transformers' rule: max_new_tokens wins, unless it is its default (256) and max_length is set
        max_new_tokens = config.max_length - cur_len if config.max_length and config.max_new_tokens == 256 \
            else config.max_new_tokens
        if attention_mask is None:
            attention_mask = torch.ones((B, cur_len), dtype=torch.bool, device=device)
        elif attention_mask.dim() != 2 or tuple(attention_mask.shape) != (B, cur_len):
            raise ValueError(f"attention_mask must be 2-D with input_ids' shape {(B, cur_len)}, "
                             f"got {tuple(attention_mask.shape)}")
        # the first step opens the first canvas (encoder, random canvas: transformers' order)
        return CanvasState(
            input_ids=input_ids, prompt_length=cur_len, max_new_tokens=max_new_tokens,
            attention_mask=attention_mask.bool(), canvas=decoder_input_ids, self_conditioning=self_conditioning_logits,
            encoder_positions=torch.arange(0, cur_len, dtype=torch.int32, device=device)[None],
            decoder_positions=torch.arange(cur_len, cur_len + L, dtype=torch.int32, device=device)[None],
            cache=self.canvas_model.new_cache(), canvases_left=math.ceil(max_new_tokens / L), done=max_new_tokens <= 0,
            finished_sequences=torch.zeros(B, dtype=torch.bool, device=device),
            decoder_forwards=torch.zeros(B, dtype=torch.int, device=device),
            matchers=None if self.structure is None else [self.structure.matcher(self.end_ids) for _ in range(B)])

    def next_forward(self, state: CanvasState, generator: torch.Generator | None = None,
                     stats: GenerationStats | None = None) -> ForwardRequest | None:
        """The forward `state` waits for; None once decoded, or for one engine step while another
        request encodes this prompt."""
        if state.error is not None:
            raise state.error
        if state.pending is None and not state.done:
            state.pending = self.denoising_step(state, generator, stats)
        if state.pending is not None and state.request is None:   # a new step, or one paused a step
            self.receive(state, None)
        return state.request

    def receive(self, state: CanvasState, answer: Any, generator: torch.Generator | None = None,
                stats: GenerationStats | None = None) -> None:
        """Hand the pending forward its answer and run the step to its next forward (or its end), its scoring done
        alone."""
        answer_alone(lambda sent: self._advance(state, sent), answer)

    def commit_key(self) -> Any:
        """Canvas steps score together (`score_and_update`) unless they replay transformers' draws."""
        return None if self.reference_rng else "canvas"

    @staticmethod
    def receive_together(decoders: Sequence["CanvasDecoder"], states: Sequence[CanvasState], answers: Sequence[Any],
                         generators: Sequence[torch.Generator | None],
                         stats: Sequence[GenerationStats | None]) -> None:
        """Each request's step run on; their scorings done together (`answer_together`); a failing step fails its
        request alone (at its next step)."""
        def fail(i: int, err: Exception) -> None:
            states[i].error, states[i].pending, states[i].request = err, None, None

        answer_together(lambda i, sent: decoders[i]._advance(states[i], sent), answers, fail)

    @staticmethod
    def _advance(state: CanvasState, answer: Any) -> Together | None:
        """Send `answer` into the step: its next forward (`state.request`; None: a pause or its end), or the
        scoring it asks for (returned)."""
        try:
            item = state.pending.throw(answer) if isinstance(answer, Exception) else state.pending.send(answer)
        except StopIteration:
            state.pending = state.request = None
            return None
        if not isinstance(item, Together):   # a forward (None: a pause) is the state's; a scoring is returned
            state.request, item = item, None
        return item

    def _open_canvas(self, state: CanvasState, generator: torch.Generator | None,
                     first: bool = False) -> Generator[ForwardRequest | None, Any, None]:
        """Encode what the cache lacks (the prompt, or the last canvas) and draw a fresh canvas; yields
        None (a pause) while another request encodes the same prompt (then its cache is taken)."""
        L, V = self.canvas_model.canvas_length, self.canvas_model.vocab_size
        (B, _), device = state.input_ids.shape, state.input_ids.device
        key = None
        if first and self.prompt_cache is not None and B == 1 and bool(state.attention_mask.all()):
            key = tuple(state.input_ids[0].tolist())
            if key in self.prompt_cache.encoding:
                yield None   # one step: the other request's forward is computed in the same one
            cached = self.prompt_cache.get(key)
            if cached is not None:   # bitwise the cache this prompt's encoder forward writes
                state.cache, key = cached, None
            else:
                self.prompt_cache.encoding.add(key)
        if not first or state.cache.get_seq_length() == 0:
            yield self.canvas_model.encoder_forward(state.input_ids if first else state.input_ids[:, -L:],
                                                    state.attention_mask, state.encoder_positions, state.cache)
            if key is not None:
                self.prompt_cache.put(key, state.cache)
                self.prompt_cache.encoding.discard(key)
        # transformers draws the random canvas even when `decoder_input_ids` replaces it (an eager default)
        random_canvas = torch.randint(0, V, (B, L), device=device, generator=generator)
        state.canvas = state.canvas if first and state.canvas is not None else random_canvas
        state.self_conditioning = state.self_conditioning if first else None
        state.masks = self.canvas_model.decoder_masks(state.canvas, state.cache,
                                                      torch.nn.functional.pad(state.attention_mask, (0, L), value=True))
        state.finished_denoising = torch.zeros(B, dtype=torch.bool, device=device)
        if self.config.stability_threshold is not None and self.config.confidence_threshold is not None:
            state.tracker = StabilityTracker(self.config.stability_threshold, self.config.confidence_threshold)
        state.argmax_canvas = state.canvas
        state.stable_steps = torch.zeros((B, L), dtype=torch.long, device=device)
        state.cur_step = self.config.max_denoising_steps
        state.canvases_left -= 1

    def denoising_step(self, state: CanvasState, generator: torch.Generator | None = None,
                       stats: GenerationStats | None = None,
                       streamer: Any = None) -> Generator[ForwardRequest | None, Any, CanvasState]:
        """One denoising step of every row as a step generator: it opens a canvas where none is (the first, or
        the next after one closed: the encoder's forward first) and closes the canvas as it ends."""
        cm, sampler = self.canvas_model, self.sampler
        L, V, B, device = cm.canvas_length, cm.vocab_size, state.input_ids.shape[0], state.input_ids.device
        if state.argmax_canvas is None:
            yield from self._open_canvas(state, generator, first=state.masks is None)
        canvas, argmax_canvas, finished = state.canvas, state.argmax_canvas, state.finished_denoising
        running = ~(finished | state.finished_sequences)
        state.decoder_forwards += running
        logits = yield cm.decoder_forward(canvas, state.self_conditioning, state.masks, state.cache,
                                          state.decoder_positions)
        if stats is not None:
            stats.forward(B, L)
        # transformers passes the step as an int32 tensor: the temperature is computed in float32
        cur_step, processed = torch.tensor(state.cur_step, dtype=torch.int32, device=device), logits
        for processor, takes_step in self.processors:
            processed = processor(state.input_ids, processed, **({"cur_step": cur_step} if takes_step else {}))
        if self.reference_rng:
            sample, new_argmax, entropy, top_prob = reference_score(processed, generator)
            new_canvas = None
        else:   # the fused kernels (the EB-sampler: decide + renoise in one launch), with other requests' in the engine
            update = sampler.rule == "entropy_bound"
            seeds = (draw_seed(generator), draw_seed(generator) if update else None)
            key = ("canvas", *processed.shape[1:], processed.dtype, processed.device, update and self.entropy_bound)
            sample, new_argmax, entropy, top_prob, new_canvas, accepted = yield Together(
                key if B == 1 else None, score_and_update, (processed, *seeds, self.entropy_bound, V))
        if new_canvas is None:
            accepted = accept_positions(sampler, entropy, top_prob, self.entropy_bound)
            noise_tokens = torch.randint(0, V, (B, L), device=device, generator=generator)
            new_canvas = apply_decision(canvas, sample, Decision(commit=accepted, renoise=~accepted), noise_tokens)
        if sampler.freeze_after is not None:   # early commit: a stable argmax is kept for good
            # frozen: stable for `freeze_after` steps; its argmax is kept, so its count only grows
            new_argmax = torch.where(state.stable_steps >= sampler.freeze_after, argmax_canvas, new_argmax)
            if state.cur_step < self.config.max_denoising_steps:   # from the second step: a previous argmax
                state.stable_steps = torch.where(new_argmax == argmax_canvas, state.stable_steps + 1, 0)
            frozen = state.stable_steps >= sampler.freeze_after
            new_canvas = torch.where(frozen, new_argmax, new_canvas)
            accepted = accepted | frozen
        if finished.any():   # finished rows keep their state (and self-conditioning logits)
            new_argmax = torch.where(finished[:, None], argmax_canvas, new_argmax)
            new_canvas = torch.where(finished[:, None], canvas, new_canvas)
            processed = torch.where(finished[:, None, None], state.self_conditioning, processed)
            if state.tracker is not None:   # transformers recomputes the entropy of what it kept
                entropy = token_entropy(processed) if self.reference_rng else torch.where(
                    finished[:, None], token_entropy(processed), entropy)
        if state.tracker is not None:
            finished |= state.tracker(new_argmax, entropy.mean(dim=-1))
        if sampler.freeze_after is not None:
            finished |= frozen.all(dim=-1)
        if stats is not None:
            stats.step(accepted[running].sum())
        if state.matchers is not None:   # structured output: the commit checked, the output held valid
            noise = torch.randint(0, V, (B, L), device=device, generator=generator)
            new_canvas, new_argmax, _ = constrain_canvas(state.matchers, new_canvas, new_argmax, processed, noise,
                                                         ~state.finished_sequences)
        state.canvas, state.argmax_canvas = new_canvas, new_argmax
        state.self_conditioning = processed.to(cm.embedding_dtype)
        state.cur_step -= 1
        if streamer is not None and hasattr(streamer, "put_draft"):
            streamer.put_draft(value=new_argmax.cpu())
        if state.cur_step == 0 or bool(finished.all()):
            self._close_canvas(state, streamer)
        return state

    def _close_canvas(self, state: CanvasState, streamer: Any = None) -> None:
        """Append the argmax canvas; unless every row is finished, the next step opens the next one (encoding
        this one)."""
        L = self.canvas_model.canvas_length
        if state.matchers is not None:   # each running row's matcher consumes its canvas (valid by construction)
            for b, matcher in enumerate(state.matchers):
                if not bool(state.finished_sequences[b]):
                    matcher.advance(state.argmax_canvas[b].tolist())
        input_ids = state.input_ids = torch.cat([state.input_ids, state.argmax_canvas], dim=-1)
        # transformers' `_finalize_canvas`: rows finished before get pad over the canvas; rows finishing
        # now (EOS in it, or the length reached) get pad after their first EOS
        before, pad = state.finished_sequences, self.config.pad_token_id
        finished_now = self.criteria(input_ids, None, new_token_length=L)
        state.finished_sequences = before | finished_now
        if pad is not None and bool(state.finished_sequences.any()):
            input_ids[before, -L:] = pad
            if self.eos_ids is not None and bool(finished_now.any()):
                new_tokens = input_ids[:, -L:]
                is_eos = torch.isin(new_tokens, torch.tensor(self.eos_ids, device=input_ids.device))
                new_tokens[is_eos.cumsum(dim=-1) > is_eos.long()] = pad   # after the first EOS
        if streamer is not None:
            streamer.put(state.input_ids[:, -L:].cpu())
        state.argmax_canvas = None   # the sequences so far (`x`) until the next canvas is drawn
        state.done = bool(state.finished_sequences.all()) or state.canvases_left == 0
        state.attention_mask = torch.nn.functional.pad(state.attention_mask, (0, L), value=True)
        state.encoder_positions, state.decoder_positions = state.decoder_positions, state.decoder_positions + L


def canvas_generate(model: torch.nn.Module, input_ids: torch.Tensor, generation_config: Any = None, *,
                    past_key_values: Any = None, streamer: Any = None, logits_processor: Any = None,
                    stopping_criteria: Any = None, reference_rng: bool = False,
                    generator: torch.Generator | None = None, stats: GenerationStats | None = None,
                    canvas_sampler: CanvasSampler | None = None, structured_outputs: Any = None,
                    tokenizer: Any = None, **kwargs: Any):
    """Drop-in for `DiffusionGemmaForBlockDiffusion.generate(input_ids, **kwargs)`: a
    `DiffusionGemmaGenerationOutput`, or the `[B, T]` sequences when `return_dict_in_generate=False`.

    Keyword arguments: every `DiffusionGemmaGenerationConfig` field, `attention_mask` (2-D, left padding),
    `decoder_input_ids` (the first canvas), `self_conditioning_logits` (for the first step), `logits_processor`
    and `stopping_criteria` (applied first, as transformers does), `streamer` (`put`, and `put_draft` with
    each step's argmax canvas). remask adds `reference_rng`, `generator` (default torch's global one, as
    transformers), `stats`, `canvas_sampler` (default the reference's EB-sampler) and `structured_outputs`
    (compiled against `tokenizer`, default the one beside the model; `CanvasDecoder.constrain`).
    """
    check_bool("reference_rng", reference_rng)
    stats = check_stats("stats", stats) or GenerationStats()   # None: counted, then dropped
    check_instance("canvas_sampler", canvas_sampler, CanvasSampler, "a remask.CanvasSampler")
    if past_key_values is not None:
        raise ValueError("past_key_values: remask's canvas loop builds its own cache; pass the whole prompt")
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a 2-D tensor [batch, length], got {getattr(input_ids, 'shape', None)}")
    check_generator(generator, input_ids.device)
    model_kwargs = {name: kwargs.pop(name) for name in MODEL_KWARGS if name in kwargs}
    config = resolve_generation_config(model, generation_config, kwargs)
    decoder = CanvasDecoder(get_spec(model), config, canvas_sampler, reference_rng=reference_rng,
                            logits_processor=logits_processor, stopping_criteria=stopping_criteria)
    decoder.constrain(compile_for(structured_outputs, model, tokenizer, None))
    stats.start()
    if streamer is not None:
        streamer.put(input_ids.cpu())
    state = decoder.start(input_ids, model_kwargs.pop("attention_mask", None), **model_kwargs)
    while not state.done:
        drive(decoder.denoising_step(state, generator, stats, streamer), model)   # its forwards alone
    if streamer is not None:
        streamer.end()
    pad, new_tokens = config.pad_token_id, state.input_ids[:, state.prompt_length:]
    valid = (new_tokens != pad).sum(dim=-1) if pad is not None else new_tokens.shape[1]   # per row
    stats.stop(int(valid.sum()) if pad is not None else new_tokens.numel())
    if not getattr(config, "return_dict_in_generate", True):   # transformers' return value: the sequences, ...
        return state.input_ids
    # ... or a `DiffusionGemmaGenerationOutput`
    return decoder.module.DiffusionGemmaGenerationOutput(**with_cache_field(dict(
        sequences=state.input_ids, tokens_per_forward=valid / state.decoder_forwards, cache=state.cache)))


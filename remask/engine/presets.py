"""Presets: which parts a request's settings ask for — the decoder the engine steps for it.

`decoder_for(engine, params, prompt_ids)` returns the request's decoder from the model and its
`SamplingParams`: a family's own loop (`Family.engine_decoder`), DiffusionGemma's canvas loop,
autoregressive decoding, LLaDA's block rule, Dream's sampler or block decoder, APD, or a method's
step generator (`decoders.decoder_steps`), each built as the drop-in function builds it (the same
tokens). The one place that maps settings to methods, one lookup: `way_of` names the request's way of
decoding (a key of `parts.checks.WAYS`, whose table says what each reads, or "family"), `BUILDERS` its
builder. The engine has no branch on a method or model.

`min_tokens`: the engine gives the decoder a logits processor (`parts/processors.HoldEndIds`, through
`Decoder.add_processor`) where its loop scores after the forward (LLaDA's block rule, Dream's sampler
and block decoder); the methods that score inside their own loops refuse it (`check_end_settings`).
"""
from __future__ import annotations

from typing import Any

import torch

from remask.diffusion.families.ar import ARDecoder
from remask.diffusion.families.canvas import CanvasDecoding, CanvasDecoder, check_stability, resolve_generation_config
from remask.diffusion.families.dream import (DEFAULT_BLOCK_LENGTH, DreamBlockDecoder, DreamDecoder,
                                             DreamGenerationConfig, _validate_config)
from remask.diffusion.families.llada import BlockDecoder, validate_block_args
from remask.diffusion.methods import registry
from remask.diffusion.methods.decoders import decoder_steps, method_call
from remask.diffusion.parts.checks import changed, check_instance, refuse_unread
from remask.diffusion.parts.constrain_loops import structure_for_call
from remask.diffusion.parts.protocol import Decoder
from remask.diffusion.parts.stepper import StepwiseDecoder

from .sampling_params import SamplingParams


def way_of(engine: Any, params: SamplingParams) -> str:
    """How the request decodes on `engine`'s model: the model's own loop ("canvas" for a uniform-noise model,
    "family" for a family with one), "ar", else the params' own way (`SamplingParams.way`)."""
    if engine.spec.noise == "uniform":
        return "canvas"
    if engine.family is not None and engine.family.engine_decoder is not None:
        return "family"
    return "ar" if engine.is_ar else params.way


def decoder_for(engine: Any, params: SamplingParams, prompt_ids: torch.Tensor) -> Any:
    """The decoder of a request with `params` on `engine`'s model (module docstring): its way's builder
    (`BUILDERS`), after refusing by name what that way does not read or cannot honour."""
    way = way_of(engine, params)
    if params.ignore_eos or params.min_tokens:
        check_end_settings(engine, params, way)
    if params.logprobs is not None and way not in ("ar", "llada", "dream"):
        what = type(params.method).__name__ if way == "method" else engine.spec.kind if way == "family" else way
        raise ValueError(f"logprobs: reported for autoregressive models, LLaDA's block rule and Dream's sampler / "
                         f"block decoder (each token from the forward that committed it), not with {what}: its loop "
                         "scores the logits inside itself")
    if way in ("canvas", "ar", "llada"):   # the others were refused when the params were built, or by the family
        refuse_unread(params, way)
    if params.structured_outputs is not None and engine.tokenizer is None:
        raise ValueError("structured_outputs needs the engine's tokenizer (the structure is compiled against its "
                         "vocabulary): build the LLMEngine with tokenizer=")
    # compiled against the engine's tokenizer (cached), `max_tokens` checked against the shortest valid answer
    structure = structure_for_call(params.structured_outputs, engine.model, engine.tokenizer, engine.spec.mask_id,
                                   params.max_tokens)
    ends = sorted(set(engine.stop_ids) | set(params.stop_token_ids)) if structure is not None else ()
    # the block-causal families' loops, APD and the canvases hold it in their own loops (parts/constrain_loops.py);
    # Dream's sampler and block decoder, FreeDave, dInfer's rules, WINO and the DKVCache / D2Cache /
    # ElasticCache configs in their commits (parts/constrain.py)
    return BUILDERS[way](engine, params, prompt_ids, structure, ends)


def check_end_settings(engine: Any, params: SamplingParams, way: str) -> None:
    """`ignore_eos` / `min_tokens` where the request's loop can honour them, refused by name where
    it cannot (never ignored): both for AR models, LLaDA's block rule and Dream's sampler and block
    decoder; `ignore_eos` also for the methods with no EOS rule of their own. docs/engine.md has
    the table."""
    name = type(params.method).__name__
    if way == "method" and params.min_tokens:   # the methods score inside their own step: no logits hook reaches them
        reason = f"{name}: its loop scores the logits inside its own step, with no logits hook the engine reaches"
    elif way == "method":   # some end a row at its first EOS by their own rule (`Method.fills_after_eos`)
        fills = registry.switch(registry.method_of(params.method).fills_after_eos, params.method)
        reason = f"{name}: it fills the rest of a row with EOS after the first EOS it decodes" if fills else None
    elif way == "family":
        reason = (f"a block-causal model ({engine.family.model_type}): its loop stops after the block holding EOS, "
                  "and its rule scores inside the family's own step")
    else:
        reason = {"canvas": "a uniform-noise model (DiffusionGemma): its canvas loop ends at the first canvas "
                            "holding EOS",
                  "apd": "apd: APD stops at the first EOS it accepts and drafts with the AR verifier's logits too"
                  }.get(way)
    if reason is not None:
        raise ValueError(f"{' / '.join(changed(params, ('ignore_eos', 'min_tokens')))}: not supported with {reason}")


def canvas_decoder(engine: Any, params: SamplingParams, prompt_ids: torch.Tensor, structure: Any,
                   end_ids: Any) -> CanvasDecoder:
    """DiffusionGemma's canvas loop for these params, configured as `remask.diffusion_generate`
    would be with the checkpoint's generation config and the request's `decoder=CanvasDecoding(...)`."""
    canvas = check_instance("decoder", params.decoder, CanvasDecoding, "remask.CanvasDecoding") or CanvasDecoding()
    config = resolve_generation_config(engine.model, None, canvas.generation_kwargs(max_new_tokens=params.max_tokens))
    if canvas.stability_threshold is not None:   # against the checkpoint's max_denoising_steps
        check_stability(config.stability_threshold, config.max_denoising_steps, "max_denoising_steps")
    return CanvasDecoder(engine.spec, config, canvas.sampler, reference_rng=params.reference_rng,
                         prompt_cache=engine.prompt_cache).constrain(structure)


def family_decoder(engine: Any, params: SamplingParams, prompt_ids: torch.Tensor, structure: Any, end_ids: Any) -> Any:
    """The family's own loop (SDAR, LLaDA2, Fast-dLLM v2: `Family.engine_decoder`)."""
    return engine.family.decoder_factory()(engine.spec, params, store=engine.runner.store,
                                           stop_ids=engine.stop_ids).constrain(structure)


def ar_decoder(engine: Any, params: SamplingParams, prompt_ids: torch.Tensor, structure: Any,
               end_ids: Any) -> ARDecoder:
    decoder = ARDecoder(engine.spec, **params.ar_kwargs(engine.eos_ids()), structure=structure,
                        logprobs=params.logprobs)
    decoder.check_input(prompt_ids, None)
    return decoder


def llada_decoder(engine: Any, params: SamplingParams, prompt_ids: torch.Tensor, structure: Any,
                  end_ids: Any) -> BlockDecoder:
    """LLaDA's block rule (and Fast-dLLM v1's caches and parallel rules), as `remask.generate` runs it."""
    decoder = BlockDecoder(engine.spec, **params.generate_kwargs(), structure=structure, end_ids=end_ids)
    decoder.check_input(prompt_ids, None)
    return decoder


def method_decoder(engine: Any, params: SamplingParams, prompt_ids: torch.Tensor, structure: Any,
                   end_ids: Any) -> Decoder:
    """`decoder=` / a cache config (APD's `decoder=APDConfig(...)` too: its rounds, as `remask.generate` runs them):
    the method's step generator (`decoder_steps`), advanced one forward per engine step — or, where the method's
    loop is one decoder's over the request's row (`Method.decoder`: dInfer's rules), that decoder. Its arguments are
    checked here, before the request is queued."""
    # the settings as (value, default): refused unless the method reads them
    settings = {"steps": (params.steps, None), "remasking": (params.remasking, params.remasking),
                "cfg_scale": (params.cfg_scale, SamplingParams.cfg_scale), "top_p": (params.top_p, None),
                "top_k": (params.top_k, None), "temperature": (params.temperature, SamplingParams.temperature)}
    kwargs = dict(gen_length=params.max_tokens, block_length=params.block_length or params.max_tokens,
                  use_cache=params.use_cache, mask_id=engine.spec.mask_id, structure=structure, end_ids=end_ids)

    def make_steps(prompt: torch.Tensor, generator: torch.Generator | None, stats: Any) -> Any:
        return decoder_steps(engine.spec, prompt, None, params.decoder, stats=stats,
                             settings={**settings, "generator": (generator, generator)}, **kwargs)

    # Checked now (the settings as values; SamplingParams refused the unread ones already, add_request the prompt).
    call = method_call(engine.spec, prompt_ids, None, params.decoder, stats=None,
                       settings={**settings, "generator": (None, None)}, **kwargs)
    if call.method.decoder is not None:
        return call.method.decoder(call)
    call.method.loop(call).close()
    return StepwiseDecoder(make_steps, gen_length=params.max_tokens, name=type(params.method).__name__)


def dream_decoder(engine: Any, params: SamplingParams, prompt_ids: torch.Tensor, structure: Any,
                  end_ids: Any) -> DreamDecoder | DreamBlockDecoder:
    """Dream's sampler for these params — or, with `block_length` / `use_cache`, Fast-dLLM's
    Dream block decoder — configured as `remask.diffusion_generate` would."""
    decoders = ("max_new_tokens", "threshold", "frechet_margin", "reference_ties", "block_length", "use_cache")
    config = DreamGenerationConfig(mask_token_id=engine.spec.mask_id, pad_token_id=engine.spec.pad_id,
                                   eos_token_id=engine.spec.eos_id)   # the decoders' settings stay out of it
    config.update(**{k: v for k, v in params.diffusion_generate_kwargs().items() if k not in decoders})
    config.max_length = prompt_ids.shape[1] + params.max_tokens
    _validate_config(config, engine.spec)   # the prompt: checked by add_request
    threshold = 0.9 if params.threshold is None else params.threshold
    if params.block_length is None and params.use_cache is None:
        return DreamDecoder(
            engine.spec, config, threshold, reference_ties=params.reference_ties, structure=structure, end_ids=end_ids)
    block_length = DEFAULT_BLOCK_LENGTH if params.block_length is None else params.block_length
    validate_block_args(params.max_tokens, block_length, config.steps, length="the generation length")
    return DreamBlockDecoder(engine.spec, config, threshold, block_length, params.use_cache, structure=structure,
                             end_ids=end_ids, frechet_margin=params.frechet_margin)


# way (`way_of`) → the builder of its decoder: `builder(engine, params, prompt_ids, structure, end_ids)`
BUILDERS = {"canvas": canvas_decoder, "family": family_decoder, "ar": ar_decoder, "method": method_decoder,
            "apd": method_decoder, "dream": dream_decoder, "llada": llada_decoder}

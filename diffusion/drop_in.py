"""The drop-in entry points: `remask.generate` (LLaDA's `generate.py` and Fast-dLLM v1's, on every
bidirectional mask model) and `remask.diffusion_generate` (Dream's `diffusion_generate`).

Each checks its arguments and routes the call: a registered method's config (`decoder=` /
`use_cache=` / `apd=`, `diffusion/methods/registry.py`: dInfer's rules, FreeDave, APD, ...) runs that method's loop
(`methods.decoders.run_decoder`); otherwise the family's own loop runs (LLaDA's block rule
`families.llada.block_diffusion_generate`, Dream's sampler and Fast-dLLM's Dream block decoder in
`families.dream`, DiffusionGemma's canvas).
They sit above the methods, so the families and the methods below never import an entry point.
"""
from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable

import torch

from remask.caches import PagedKVCache
from remask.models.spec import get_spec

from .families.apd import APDConfig
from .families.canvas import canvas_generate
from .families.dream import (DEFAULT_BLOCK_LENGTH, DEFAULT_MAX_LENGTH, DreamBlockDecoder, DreamDecoder,
                             DreamGenerationConfig, DreamModelOutput, _validate_config)
from .families.llada import block_diffusion_generate, validate_block_args, validate_rule
from .methods import registry
from .methods.decoders import is_dinfer_method, run_decoder
from .methods.freedave import FreeDave
from .parts.cache import cache_mode
from .parts.checks import (check_bools, check_generator, check_instance, check_int, check_length, check_mask_id,
                           check_model_kind, check_optional_token_id, check_prompt, check_real, check_stats,
                           refuse_unread, warn_if_longer_than_trained, warn_if_padded_without_mask)
from .parts.constrain_loops import structure_for_call
from .parts.sparse import SparseConfig
from .parts.stats import GenerationStats
from .parts.stepper import decode_alone


def generate(model: torch.nn.Module, prompt: torch.Tensor, attention_mask: torch.Tensor | None = None,
             steps: int = 128, gen_length: int = 128, block_length: int = 128, temperature: float = 0.0,
             cfg_scale: float = 0.0, remasking: str = "low_confidence", mask_id: int | None = None,
             logits_eos_inf: bool = False, confidence_eos_eot_inf: bool | str = False, *,
             threshold: float | None = None, factor: float | None = None, early_stop: bool = False,
             reference_rng: bool = False, eos_id: int | None = None, eot_id: int | None = None,
             generator: torch.Generator | None = None, stats: GenerationStats | None = None,
             on_step: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
             use_cache: str | PagedKVCache | None = None, apd: APDConfig | None = None,
             verifier_stats: GenerationStats | None = None, sparse: SparseConfig | None = None,
             reference_ties: bool = False, decoder: Any = None, structured_outputs: Any = None,
             tokenizer: Any = None, frechet_margin: float | None = None) -> torch.LongTensor:
    """Drop-in for ML-GSAI/LLaDA `generate` (same positional order, defaults and output): returns
    `[B, P + gen_length]`, the prompt unchanged and no mask token left.

    `prompt` is left-padded when rows differ (`attention_mask`: 1 = token); `mask_id` / `eos_id` /
    `eot_id` None: the model's. `gen_length % block_length == 0`, `steps` divisible by the number of
    blocks (LLaDA's integer schedule per block). `temperature`: float64 Gumbel-max (0 = greedy);
    `cfg_scale`: unsupervised CFG; `remasking`: ``"low_confidence"`` or ``"random"``;
    `logits_eos_inf`: EOS logits at −inf; `confidence_eos_eot_inf`: ``True`` as upstream
    (docs/quirks.md), ``"corrected"`` commits EOS/EOT last. `threshold` / `factor`: Fast-dLLM's
    parallel rules, looping until the block is decoded; `frechet_margin`: Fast-dLLM++'s Fréchet profile
    rule in the same loop (`remask.FrechetRule`; at most one of the three). `early_stop`: a row stops after a decoded
    block with EOS/EOT (the rest EOS). `reference_rng`: at temperature > 0, the reference's float64
    Gumbel noise over the whole `[B, T, V]` logits (a seeded reference run reproduced); by default
    the fused kernel's own stream. `on_step(block_index, x, transfer_index)` runs after every step.
    `use_cache`: None, "prefix", "dual" (Fast-dLLM v1, see `block_diffusion_generate`) or "paged" /
    a `PagedKVCache`. `apd`: an `APDConfig(verifier=...)`, short for `decoder=APDConfig(...)`: adaptive parallel
    decoding (`remask.diffusion.families.apd`; `verifier_stats` counts its verifier's forwards). `sparse`: a
    `SparseConfig(...)` (`remask.diffusion.parts.sparse`). `reference_ties`: the schedule through
    `torch.topk` as the references (their order among exactly equal confidences, common at p = 1.0
    in float32); by default the lower index. `decoder`: a config replacing the block rule
    (docs/decoders.md): `remask.FreeDave(...)` (the tokens of `steps=gen_length` greedy decoding in
    fewer forwards) or dInfer's rules. `structured_outputs`: a `remask.StructuredOutputsParams`,
    compiled against `tokenizer` (default: the one beside the model), held at each commit
    (`diffusion/parts/constrain.py`): a completed answer ends with EOS, one out of positions holds
    a valid prefix.
    """
    given = dict(locals())   # the call's arguments by name (the tables below `generate` say which go where)
    for name, value in (("mask_id", mask_id), ("eos_id", eos_id), ("eot_id", eot_id)):
        check_int(name, value, minimum=0, allow_none=True)
    spec = get_spec(model, mask_id=mask_id, eos_id=eos_id, eot_id=eot_id)
    check_model_kind(spec, diffusion=True, entry="remask.generate")
    check_optional_token_id(spec, eos_id, "eos_id")
    check_optional_token_id(spec, eot_id, "eot_id")
    check_instance("apd", apd, APDConfig, "a remask.APDConfig")
    check_stats("verifier_stats", verifier_stats)
    # the checks SamplingParams runs, compiled against the tokenizer; every decoder enforces it in its commits
    structure = structure_for_call(structured_outputs, model, tokenizer, spec.mask_id, gen_length)
    if decoder is None and apd is not None:   # `apd=`: the drop-in keyword of `decoder=APDConfig(...)`
        decoder, given["apd"], given["decoder"] = apd, None, apd
    if registry.way_of(decoder) == "apd":   # APD reads none of the block rule's settings: refused when set
        refuse_unread({name: (given[name], default) for name, default in _DEFAULTS.items()}, "apd")
        warn_if_longer_than_trained(spec, check_int("gen_length", gen_length, minimum=1))
    if decoder is not None or (use_cache is not None and not isinstance(use_cache, (str, PagedKVCache))):
        settings = {name: (given[name], _DEFAULTS[name]) for name in _METHOD_SETTINGS}
        return run_decoder(model, prompt, attention_mask, decoder, gen_length=gen_length, block_length=block_length,
                           use_cache=use_cache, mask_id=mask_id, stats=stats, settings=settings, structure=structure)
    return block_diffusion_generate(model, prompt, attention_mask, spec=spec, structure=structure,
                                    **{name: value for name, value in given.items() if name not in _ROUTING})


# `generate`'s parameters by role: those a registered method's loop is handed (to refuse what it does not read), those
# that choose the route (the rest LLaDA's block rule takes); APD refuses by `checks.WAYS["apd"]`
_DEFAULTS = {name: p.default for name, p in inspect.signature(generate).parameters.items()}
_METHOD_SETTINGS = ("steps", "temperature", "cfg_scale", "remasking", "logits_eos_inf", "confidence_eos_eot_inf",
                    "threshold", "factor", "frechet_margin", "early_stop", "reference_rng", "eos_id", "eot_id",
                    "generator", "on_step", "apd", "verifier_stats", "sparse", "reference_ties")
_ROUTING = ("model", "prompt", "attention_mask", "mask_id", "eos_id", "eot_id", "apd", "verifier_stats", "decoder",
            "structured_outputs", "tokenizer")


@torch.no_grad()
def diffusion_generate(model: torch.nn.Module, inputs: torch.Tensor, generation_config: Any = None,
                       **kwargs: Any) -> torch.LongTensor | DreamModelOutput:
    """Drop-in for Dream's `model.diffusion_generate(inputs, generation_config=None, **kwargs)`:
    the `[B, max_length]` sequences, or a `DreamModelOutput` with `return_dict_in_generate`.

    Keyword arguments: every `DreamGenerationConfig` field, `attention_mask` (left padding), the hooks
    `generation_tokens_hook_func` / `generation_logits_hook_func(step, x, logits)`, `threshold`
    (`alg="confidence_threshold"`, default 0.9); `frechet_margin` (Fast-dLLM++'s Fréchet profile rule in the block
    decoder in place of alg's rule, as upstream; not with `threshold`); remask's `generator`, `stats`, `reference_ties`
    (default True: the count through `torch.topk` as Dream, so exact ties — many 1.0 under a nucleus
    of one — fall in its order; False: lower index first); `decoder` (`remask.FreeDave(...)`: the block
    decoder's tokens at `alg="confidence_threshold"`, `threshold=1.0`, `steps=max_new_tokens` in fewer
    forwards; or dInfer's rules); `use_cache` (None / "prefix" / "dual" / "paged" or a `PagedKVCache`)
    and `block_length` (32 once a cache is asked for): Fast-dLLM's block decoder (`finish_blocks=False`
    keeps upstream's masks when a block has one step); `sparse=SparseConfig(...)` (docs/sparse.md):
    Sparse-dLLM's retention (block decoder; not ``origin``) or SparseD's block masks (whole-canvas loop,
    selection scaled by 1/√head_dim as upstream's Dream); `apd=APDConfig(...)` (or `decoder=`): APD's `apd_sample`
    (`verifier_stats` counts the verifier's forwards); `structured_outputs` (compiled against
    `tokenizer`, default the checkpoint's), held at each commit (`diffusion/parts/constrain.py`).
    A uniform-noise model (DiffusionGemma) goes to `canvas.canvas_generate`, its own drop-in.
    """
    spec = get_spec(model)
    if spec.noise == "uniform":   # no mask token: canvases renoised (DiffusionGemma's generate)
        return canvas_generate(model, inputs, generation_config, **kwargs)
    hooks_given = [k for k in ("generation_tokens_hook_func", "generation_logits_hook_func") if k in kwargs]
    validate_rule(kwargs.get("threshold"), None, kwargs.get("frechet_margin"))   # a threshold given, not its default
    threshold, frechet_margin = kwargs.pop("threshold", 0.9), kwargs.pop("frechet_margin", None)
    finish_blocks, reference_ties = kwargs.pop("finish_blocks", True), kwargs.pop("reference_ties", True)
    (tokens_hook, logits_hook, attention_mask, use_cache, block_length, decoder, sparse, apd, verifier_stats,
     generator, stats, structured_outputs, tokenizer) = (kwargs.pop(name, None) for name in (
        "generation_tokens_hook_func", "generation_logits_hook_func", "attention_mask", "use_cache", "block_length",
        "decoder", "sparse", "apd", "verifier_stats", "generator", "stats", "structured_outputs", "tokenizer"))
    if apd is None and registry.way_of(decoder) == "apd":   # `apd=` is the drop-in keyword of decoder=APDConfig(...)
        apd, decoder = decoder, None
    alg_given = kwargs.get("alg")   # FreeDave runs its own rule: an explicit other alg is refused
    config = DreamGenerationConfig() if generation_config is None else DreamGenerationConfig.from_any(generation_config)
    # unset special ids are the model's (Dream: `DreamGenerationConfig.from_model_config`), then the keywords apply
    for name, value in (("mask_token_id", spec.mask_id), ("pad_token_id", spec.pad_id),
                        ("bos_token_id", getattr(model.config, "bos_token_id", None)), ("eos_token_id", spec.eos_id)):
        if getattr(config, name) is None:
            setattr(config, name, value)
    leftover = config.update(**kwargs)
    if leftover:
        raise ValueError(f"unknown keyword arguments for diffusion_generate: {sorted(leftover)}")
    if inputs is None:
        raise ValueError("inputs must be a LongTensor of prompt ids [batch, length]")
    spec = get_spec(model, mask_id=config.mask_token_id)
    check_model_kind(spec, diffusion=True, entry="remask.diffusion_generate")
    check_mask_id(spec)
    dinfer = is_dinfer_method(decoder, use_cache)
    check_instance("sparse", sparse, SparseConfig, "a remask.SparseConfig")
    blocks = dinfer or cache_mode(use_cache) is not None or block_length is not None \
        or (sparse is not None and sparse.method == "retention")
    # Dream's sampler fills masks anywhere in the sequence; the block decoder and APD only after the prompt.
    check_prompt(spec.device, inputs, attention_mask, name="inputs", spec=spec,
                 mask_in_prompt="refuse" if blocks or apd is not None else "allow")
    _validate_config(config, spec)
    if threshold is not None or (config.alg == "confidence_threshold" and frechet_margin is None):
        # upstream reads it under alg="confidence_threshold" only (its None is unread elsewhere, as here)
        check_real("threshold", threshold, low=0, high=1, low_open=True)
    check_bools(finish_blocks=finish_blocks, reference_ties=reference_ties)
    check_generator(generator, inputs.device)
    check_stats("stats", stats)
    check_stats("verifier_stats", verifier_stats)
    check_instance("apd", apd, APDConfig, "a remask.APDConfig")
    check_instance("generation_tokens_hook_func", tokens_hook, Callable, "a callable")
    check_instance("generation_logits_hook_func", logits_hook, Callable, "a callable")
    if sparse is not None:   # what it does not combine with in Dream's sampler, each named
        clashes = [name for name, value in (("use_cache", cache_mode(use_cache) is not None), ("apd", apd is not None),
                                            ("decoder", decoder is not None)) if value]
        if clashes:
            raise ValueError(f"sparse= keeps its own attention (and cache); it does not combine with {clashes}")
        if sparse.method == "retention" and config.alg == "origin":
            raise ValueError("sparse method 'retention' commits by confidence (Sparse-dLLM's Dream sampler does not "
                             "implement alg='origin'); choose alg='maskgit_plus', 'topk_margin', 'entropy' or "
                             "'confidence_threshold'")
        if sparse.method == "block_mask" and block_length is not None:
            raise ValueError("sparse method 'block_mask' runs Dream's whole-canvas loop (SparseD's Dream sampler); "
                             "it does not combine with block_length")
        if sparse.method == "block_mask" and attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("sparse method 'block_mask' decodes unpadded rows (SparseD's block masks cover the whole "
                             "sequence); got a padded attention_mask")
    if frechet_margin is not None and (not blocks or dinfer or decoder is not None):
        raise ValueError("frechet_margin runs in Fast-dLLM's Dream block decoder (use_cache= / block_length=, as "
                         "Fast-dLLM++'s generation_utils_block.py); Dream's sampler, APD and decoder= do not read it")
    if blocks:
        if block_length is None:
            block_length = DEFAULT_BLOCK_LENGTH if sparse is None or sparse.block_len is None else sparse.block_len
        check_int("block_length", block_length, minimum=1)
        if sparse is not None:
            sparse.validate(block_length)
        if hooks_given:
            raise ValueError(f"{' / '.join(hooks_given)} not supported by the block decoder (use_cache / "
                             "block_length); use use_cache=None without block_length")
    # Length: max_new_tokens wins; otherwise an explicit max_length is the total length; otherwise
    # transformers' default of 20 new tokens (capped by max_position_embeddings), as Dream does.
    input_len = inputs.shape[-1]
    if config.max_new_tokens is not None:
        config.max_length = config.max_new_tokens + input_len
    elif kwargs.get("max_length") is None and config.max_length in (None, DEFAULT_MAX_LENGTH):
        warnings.warn("Using the model-agnostic default `max_length` (=20) to control the generation length; "
                      "set `max_new_tokens`.", UserWarning)
        config.max_length = min(DEFAULT_MAX_LENGTH + input_len,
                                torch.inf if spec.max_length is None else spec.max_length)
    if input_len >= config.max_length:
        raise ValueError(f"input length {input_len} must be smaller than max_length={config.max_length}; "
                         "increase max_length or set max_new_tokens")
    check_length(spec, config.max_length, "max_length (prompt + new tokens)")
    gen_length = config.max_length - input_len
    warn_if_padded_without_mask(inputs, attention_mask, config.pad_token_id)
    warn_if_longer_than_trained(spec, gen_length)
    # the checks SamplingParams runs (remask/structured.py), then compiled against the tokenizer
    structure = structure_for_call(structured_outputs, model, tokenizer, spec.mask_id, gen_length)
    if config.num_return_sequences > 1:
        inputs = inputs.repeat_interleave(config.num_return_sequences, dim=0)
        if attention_mask is not None:
            attention_mask = attention_mask.repeat_interleave(config.num_return_sequences, dim=0)
    if blocks and not dinfer:
        validate_block_args(gen_length, block_length, config.steps, length="the generation length")
    if dinfer or apd is not None or decoder is not None:   # a method's config: its loop (`run_decoder`), as generate's
        # what dInfer's rules and FreeDave (greedy, over blocks) do not read: refused by name
        greedy_unread = [name for name, on in (
            ("temperature", config.temperature > 0), ("top_p", config.top_p is not None),
            ("top_k", config.top_k is not None), ("generation hooks", bool(hooks_given)),
            ("output_history", config.output_history), ("reference_ties", not reference_ties),
            ("finish_blocks", not finish_blocks)) if on]
        settings = {"temperature": (config.temperature, 0.0), "generator": (generator, None)}
        if dinfer:
            # dInfer's rules (and `VicinityCache`) over Fast-dLLM's Dream blocks: LLaDA's step generator
            # (`dinfer_steps`) on Dream's shifted logits, a combination no paper shipped; greedy: the sampling settings
            # refused by name; `temperature` (with `generator`) goes to the method, which refuses it by name unless it
            # samples (KLASS)
            unread = [name for name in greedy_unread if name != "temperature"] + [name for name, on in (
                ("alg", alg_given is not None), ("threshold", threshold != 0.9), ("apd", apd is not None),
                ("sparse", sparse is not None)) if on] + sorted(n for n in ("alg_temp", "steps", "eps") if n in kwargs)
            why = (f"decoder/use_cache={type(decoder if decoder is not None else use_cache).__name__} on Dream runs "
                   f"its own commit rule over blocks; it does not read {unread}")
        elif apd is not None:   # APD's rounds (`apd.apd_call_steps`) read Dream's sampling settings
            unread, decoder = blocks or hooks_given or decoder is not None, apd
            why = "apd= does not combine with use_cache / block_length, decoder= or the generation hooks"
            settings.update(top_p=(config.top_p, None), top_k=(config.top_k, None),
                            verifier_stats=(verifier_stats, None))
        else:
            check_instance("decoder", decoder, FreeDave, "a remask decoder config (remask.FreeDave)")
            unread = greedy_unread + [name for name, on in (
                ("alg", alg_given not in (None, "confidence_threshold")), ("steps", config.steps != gen_length)) if on]
            why = (f"decoder=FreeDave decodes greedily one token per step (Fast-dLLM's Dream block decoder with "
                   f"alg='confidence_threshold', threshold=1.0, steps=max_new_tokens); it does not read {unread}")
        if unread:
            raise ValueError(why)
        sequences, history = run_decoder(model, inputs, attention_mask, decoder, gen_length=gen_length,
                                         block_length=DEFAULT_BLOCK_LENGTH if block_length is None else block_length,
                                         use_cache=use_cache, mask_id=config.mask_token_id, stats=stats,
                                         structure=structure, settings=settings), None
    else:
        if stats is not None:
            stats.start()
        decoder = DreamDecoder(spec, config, threshold, tokens_hook, logits_hook, reference_ties=reference_ties,
                               sparse=sparse, structure=structure) if not blocks else DreamBlockDecoder(
            spec, config, threshold, block_length, use_cache, finish_blocks, sparse, reference_ties,
            structure=structure, frechet_margin=frechet_margin)
        state = decode_alone(decoder, model, decoder.start(inputs, attention_mask), generator, stats)
        if stats is not None:
            stats.stop(int(state.x.shape[0] * gen_length))
        sequences, history = state.x, state.histories
    return DreamModelOutput(sequences=sequences, history=history) if config.return_dict_in_generate else sequences

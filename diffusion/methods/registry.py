"""The registry: every method that `decoder=` / `use_cache=` takes, by name, one `register` line each.

A method is a name, a config dataclass (in the method's own file, checking its own values), the
keyword it goes under (`field`) and, for a method with a loop of its own, its `loop`: a function of
the call (`Call`) that returns the method's step generator (`diffusion/parts/stepper.py`). A commit
rule has no loop of its own: it runs in the block loop that takes rules (dInfer's). Its capabilities
sit beside it: the entry-point settings it `reads`, why its loop needs LLaDA's unshifted logits
(`unshifted`), whether a cache method takes a commit rule as `decoder=` (`takes_rule`), and whether
it fills a row with EOS after the first EOS it decodes (`fills_after_eos`, so `ignore_eos` is refused), and
whether `gen_length` only bounds a canvas that grows (`length_bound`: its output may be shorter, and blocks
need not divide it), and whether its last block may be partial (`partial_blocks`, its config checking the
layout). A model family's own loop (SDAR, LLaDA2, Fast-dLLM v2, DiffusionGemma's canvas) is a method too: its
config is the request's `decoder=` there, its `way` the loop's (`parts/checks.py` `WAYS`: what it reads), the
model's family builds it (`Family.engine_decoder`; on any other model its loop refuses it); `nested` names the fields
whose JSON form is an object of its own (`rule`: a decoder config; `sampler`: its class's keywords).

Everything that turns a name or a config into a method looks here: `decoder_steps` (the drop-in
functions and the engine), the JSON form `{"name": "freedave", ...}` of `SamplingParams`, the HTTP
API and the CLI, the type checks and their messages, docs/compatibility.md; `check_settings` checks a
`SamplingParams`' decoding settings, the flat ones and the method's config, in one place. Adding a method is its
file plus one `register` line below (docs/architecture.md, "Adding a method").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from remask.models.spec import ModelSpec

from ..families import apd, canvas, fast_dllm_v2, llada2, sdar
from ..families.dream import ALGORITHMS
from ..families.llada import REMASKING, validate_block_args, validate_rule
from ..parts.blocks import READS
from ..parts.cache import CACHE_MODES
from ..parts.checks import (MAX_TEMPERATURE, check_bool, check_choice, check_generator, check_instance, check_int,
                            check_length, check_method_call, check_real, check_steps, refuse_unread)
from ..parts.rules import CreditDecoding, HierarchicalDecoding, ThresholdDecoding
from ..parts.sparse import SparseConfig
from ..parts.step import CommitRule
from ..parts.stepper import StepGenerator
from .d2cache import D2Cache, d2cache_steps
from .daedal import DAEDAL, daedal_steps
from .dinfer import VicinityCache, dinfer_decoder, dinfer_steps
from .dkv import DKVCache, dkv_steps
from .eb_sampler import EBSampler
from .elastic import ElasticCache, elastic_steps
from .frechet import FrechetRule
from .freedave import FreeDave, freedave_steps
from .klass import KLASS, klass_steps
from .margin import MarginDecoding
from .multiblock import MultiBlock, multiblock_steps
from .prophet import Prophet, prophet_steps
from .wino import WINO, wino_steps

FIELDS = ("decoder", "use_cache")


@dataclass(frozen=True)
class Call:
    """What an entry point hands a method's loop: the model's spec (never the model) and the prompt, the
    configs, the layout, the entry point's other settings (`settings`: name → value, for those the method
    `reads`) and the keywords every loop takes (`common`: gen_length, attention_mask, mask_id, stats,
    structure, end_ids)."""

    spec: ModelSpec
    prompt: torch.Tensor
    decoder: Any
    use_cache: Any
    steps: int | None
    block_length: int
    settings: dict[str, Any] = field(default_factory=dict)
    common: dict[str, Any] = field(default_factory=dict)
    method: Method | None = None   # the method called

    @property
    def gen_length(self) -> int:
        return self.common["gen_length"]


@dataclass(frozen=True)
class Method:
    """One registered method (module docstring)."""

    name: str
    config: type
    field: str = "decoder"
    loop: Callable[[Call], StepGenerator] | None = None
    # the engine's decoder of one request where the loop is one `Decoder`'s over its row (its commits batch with
    # other requests', `Decoder.commit_key`); None: the loop's step generator, one forward per engine step
    decoder: Callable[[Call], Any] | None = None
    reads: tuple[str, ...] = ()
    unshifted: str | None = None
    takes_rule: bool = False
    fills_after_eos: bool | Callable[[Any], bool] = False   # or a function of the config (a switch of its own)
    length_bound: bool = False
    # its last block may be partial (its config checks the layout)
    partial_blocks: bool | Callable[[Any], bool] = False
    way: str = "method"   # the way it decodes (`parts.checks.WAYS`): "method", or a family's own loop's
    nested: dict[str, Any] | None = None   # field → "decoder" (a config's JSON) or a class

    @property
    def is_rule(self) -> bool:
        """A commit rule: every loop that takes `decoder=` runs it (`CommitRule`)."""
        return issubclass(self.config, CommitRule)


METHODS: dict[str, Method] = {}


def register(name: str, config: type, field: str = "decoder", **capabilities: Any) -> None:
    if field not in FIELDS:
        raise ValueError(f"field must be one of {FIELDS}, got {field!r}")
    if name in METHODS:
        raise ValueError(f"a method named {name!r} is registered already ({METHODS[name].config.__name__})")
    METHODS[name] = Method(name, config, field, **capabilities)


# --- the loops, as each method's step generator takes the call ---------------------------------------

def _rules_loop(call: Call) -> StepGenerator:   # dInfer's block loop: any commit rule
    return dinfer_steps(call.spec, call.prompt, decoder=call.decoder, block_length=call.block_length,
                        use_cache=call.use_cache, **call.common)


def _rules_decoder(call: Call) -> Any:   # the same loop as one request's BlockDecoder
    return dinfer_decoder(call.spec, call.prompt, decoder=call.decoder, block_length=call.block_length,
                          use_cache=call.use_cache, **call.common)[0]


def _freedave_loop(call: Call) -> StepGenerator:
    if is_config("use_cache", call.use_cache):
        raise ValueError("use_cache: FreeDave takes None, 'prefix' or 'dual'")
    return freedave_steps(call.spec, call.prompt, config=call.decoder, steps=call.steps,
                          block_length=call.block_length, use_cache=call.use_cache, **call.common)


def _own_loop(steps_of: Callable[..., StepGenerator], *, no_cache: str | None = None, first: bool = False
              ) -> Callable[[Call], StepGenerator]:
    """The loop of a method with a step generator of its own, `steps_of(spec, prompt, config=, block_length=,
    ...)`, given the settings the method `reads` (`steps`: None is gen_length); `no_cache` says why it takes no
    `use_cache` (refused); `first`: a loop that returns (x, forward counts)."""
    def loop(call: Call) -> StepGenerator:
        if no_cache is not None and call.use_cache is not None:   # checked at the call, as every loop's arguments
            raise ValueError(f"use_cache: {no_cache}")
        taken = {name: call.settings[name] for name in call.method.reads if name in call.settings}
        if "steps" in call.method.reads:
            taken["steps"] = call.gen_length if call.steps is None else call.steps
        config = call.use_cache if call.method.field == "use_cache" else call.decoder
        steps = steps_of(call.spec, call.prompt, config=config, block_length=call.block_length, **taken, **call.common)
        return _first(steps) if first else steps
    return loop


def _first(steps: StepGenerator) -> StepGenerator:
    """WINO's and MultiBlock's loops return (x, forward counts): the output is x."""
    out = yield from steps
    return out[0]


def _elastic_loop(call: Call) -> StepGenerator:
    if call.block_length != call.gen_length:
        raise ValueError(f"block_length: ElasticCache decodes over a sliding window of "
                         f"{call.use_cache.window_length} masked positions (no blocks); leave block_length at "
                         f"gen_length ({call.gen_length}), got {call.block_length}")
    return elastic_steps(call.spec, call.prompt, config=call.use_cache, rule=call.decoder, **call.common)


def _apd_loop(call: Call) -> StepGenerator:   # APD's rounds (`families.apd`), its arguments checked at the call
    spec, stats = check_method_call(call.spec, call.prompt, call.common["attention_mask"], call.common["stats"],
                                    mask_id=call.common["mask_id"])
    check_length(spec, call.prompt.shape[1] + call.gen_length, "prompt length + gen_length")
    sampling = {name: call.settings[name] for name in ("temperature", "top_p", "top_k") if name in call.settings}
    return apd.apd_call_steps(spec, call.prompt, call.gen_length, call.decoder, structure=call.common["structure"],
                              generator=check_generator(call.settings.get("generator"), call.prompt.device),
                              stats=stats, verifier_stats=call.settings.get("verifier_stats"), **sampling)


def _family_loop(call: Call) -> StepGenerator:
    raise ValueError(f"decoder: {type(call.decoder).__name__} configures its model family's own loop (remask.LLM / "
                     f"SamplingParams on a model of that family); this model ({call.spec.kind}) has no such loop")


register("freedave", FreeDave, loop=_freedave_loop)   # `steps`: only gen_length (one token a step) or unset
for rule in (ThresholdDecoding, CreditDecoding, HierarchicalDecoding, MarginDecoding, EBSampler, FrechetRule):
    # dInfer's block loop runs each (in the engine: one request's BlockDecoder, its commits batched)
    register(rule.name, rule, loop=_rules_loop, decoder=_rules_decoder, fills_after_eos=True)
# KLASS: its own loop on LLaDA / Dream, a rule elsewhere
register("klass", KLASS, reads=("steps", "temperature", "generator"), loop=_own_loop(
    klass_steps, no_cache="KLASS forwards the whole sequence at every step (its KL memory needs every position's "
    "distribution; upstream has no cache)"))
register("wino", WINO, unshifted="WINO's shadow-block forward", loop=_own_loop(
    wino_steps, no_cache="WINO forwards the whole sequence with its shadow block (no cache)", first=True))
register("prophet", Prophet, reads=("steps", "cfg_scale", "remasking", "generator"), loop=_own_loop(
    prophet_steps, no_cache="Prophet reads the answer positions' logits at every step (full forwards, no cache, as "
    "upstream)"))
register("daedal", DAEDAL, reads=("temperature", "generator", "cfg_scale"), length_bound=True, loop=_own_loop(
    daedal_steps, no_cache="DAEDAL forwards its whole canvas, whose length changes (no cache)"))
register("multiblock", MultiBlock, reads=("temperature", "remasking", "generator"),
         fills_after_eos=lambda config: config.early_stop, partial_blocks=lambda config: config.variant == "sglang",
         loop=_own_loop(multiblock_steps, first=True,
                        no_cache="MultiBlock keeps d3LLM's own delayed KV cache: MultiBlock(cache_delay_iter=...)"))
register("vicinity", VicinityCache, "use_cache", loop=_rules_loop, fills_after_eos=True)
register("dkv", DKVCache, "use_cache", reads=("steps", "remasking", "generator"),
         unshifted="LLaDA's dKV-Cache schedule", loop=_own_loop(dkv_steps))
register("d2cache", D2Cache, "use_cache", reads=("steps",), unshifted="d2Cache's row recompute",
         loop=_own_loop(d2cache_steps))
register("elastic", ElasticCache, "use_cache", loop=_elastic_loop, unshifted="Elastic-Cache's sliding window",
         takes_rule=True, fills_after_eos=True)
# the model families' own loops (`Family.engine_decoder`; presets' canvas loop)
for kind, family in (("sdar", sdar.SDARDecoding), ("llada2", llada2.LLaDA2Decoding),
                    ("fast_dllm_v2", fast_dllm_v2.FastDLLMV2Decoding)):
    register(kind, family, way="family", reads=READS, loop=_family_loop, nested={"rule": "decoder"})
register("canvas", canvas.CanvasDecoding, way="canvas", loop=_family_loop, nested={"sampler": canvas.CanvasSampler})
register("apd", apd.APDConfig, way="apd", reads=("temperature", "top_p", "top_k", "generator", "verifier_stats"),
         loop=_apd_loop)   # its verifier is a model (over HTTP a served model's name: remask.serve)


def switch(capability: bool | Callable[[Any], bool], config: Any) -> bool:
    """A capability that is a bool or a function of the config (`fills_after_eos`, `partial_blocks`), for `config`."""
    return capability(config) if callable(capability) else capability


# --- lookups -------------------------------------------------------------------------------------------

def names(field: str) -> dict[str, type]:
    """name → config class of the methods that go under `field` ("decoder" or "use_cache"), in registry order."""
    return {m.name: m.config for m in METHODS.values() if m.field == field}


def rules() -> tuple[type, ...]:
    """The registered commit rules."""
    return tuple(m.config for m in METHODS.values() if m.is_rule)


def method_of(config: Any, field: str | None = None) -> Method | None:
    """The registered method of a config object (an instance of its config class, subclasses included), one that
    goes under `field` when given; None when it is no registered method's config."""
    return next((m for m in METHODS.values() if isinstance(config, m.config) and field in (None, m.field)), None)


def is_config(field: str, value: Any) -> bool:
    return method_of(value, field) is not None


def way_of(decoder: Any) -> str | None:
    """The way a `decoder=` value decodes (`Method.way`), None when it is no registered decoder config."""
    return getattr(method_of(decoder, "decoder"), "way", None)


def listed(field: str) -> str:
    """The config classes that go under `field`, as a refusal lists them."""
    return ", ".join(f"remask.{config.__name__}" for config in names(field).values())


def check_decoder(decoder: Any) -> None:
    """None, or a registered method's `decoder=` config."""
    if decoder is not None and not is_config("decoder", decoder):
        raise ValueError(f"decoder must be one of {listed('decoder')}, got {type(decoder).__name__}")


def from_json(field: str, value: dict) -> Any:
    """A config from its JSON form `{"name": "freedave", "draft_steps": 4}`, its `nested` fields' objects too
    (`{"name": "sdar", "rule": {"name": "freedave"}}`); errors name the field (`decoder.name`, `decoder (freedave):
    ... unexpected keyword ...`, `decoder (canvas): rule must be ...`)."""
    known = names(field)
    settings = dict(value)
    name = settings.pop("name", None)
    if name not in known:
        raise ValueError(f"{field}.name must be one of {sorted(known)}, got {name!r}")
    try:
        for key, kind in (METHODS[name].nested or {}).items():   # a field holding an object of its own
            if isinstance(settings.get(key), dict):
                settings[key] = from_json(kind, settings[key]) if isinstance(kind, str) else kind(**settings[key])
        return known[name](**settings)
    except (TypeError, ValueError) as err:   # an unknown field (a ValueError), a bad value: its JSON path named
        raise (ValueError if type(err) is TypeError else type(err))(f"{field} ({name}): {err}") from None


# --- a request's settings ------------------------------------------------------------------------------

def check_settings(params: Any) -> None:
    """The decoding settings of `params` (`SamplingParams`, its `decoder` / `use_cache` JSON forms built), the one
    check the engine's requests get: the flat vLLM / Fast-dLLM ones (`steps` and the block layout, `remasking`, the
    parallel rules, `use_cache`, Dream's `alg`, `sparse`), the method's config, the settings its way of decoding does
    not read (`parts.checks.WAYS`), then the configs' work bounds for its lengths."""
    # LLaDA's block rule and Dream's sampler commit at least one token a step: more steps than
    # max_tokens only repeat forwards (and sized O(steps) buffers: steps=10**9 was an OOM kill)
    check_steps("steps", params.steps, params.max_tokens, "max_tokens")
    check_int("block_length", params.block_length, minimum=1, allow_none=True)
    check_choice("remasking", params.remasking, REMASKING)
    validate_rule(params.threshold, params.factor, params.frechet_margin)
    check_real("cfg_scale", params.cfg_scale, low=0)
    check_decoder(params.decoder)
    # blocks tile max_tokens, except for a method whose canvas grows up to it (`Method.length_bound`) or whose last
    # block may be partial (`Method.partial_blocks`: SGLang's multi-block port; its config checks the layout)
    entry = method_of(params.method)
    if entry is None or not (entry.length_bound or switch(entry.partial_blocks, params.method)):
        validate_block_args(params.max_tokens, params.block_length or params.max_tokens,
                            params.steps or params.max_tokens)
    if not (is_config("use_cache", params.use_cache)
            or isinstance(params.use_cache, (str, type(None))) and params.use_cache in CACHE_MODES):
        raise ValueError(f"use_cache must be one of {list(CACHE_MODES)} or a remask cache config "
                         f"({listed('use_cache')}), got {params.use_cache!r}")
    if params.use_cache is not None and params.cfg_scale > 0:
        raise ValueError("cfg_scale > 0 cannot be combined with use_cache")
    for name in ("early_stop", "logits_eos_inf", "reference_rng", "reference_ties"):
        check_bool(name, getattr(params, name))
    if params.ignore_eos and params.early_stop:
        raise ValueError("ignore_eos makes EOS an ordinary token; early_stop ends a row at the first block holding "
                         "EOS: not both")
    check_choice("confidence_eos_eot_inf", params.confidence_eos_eot_inf, (False, True, "corrected"))
    check_instance("sparse", params.sparse, SparseConfig, "a remask.SparseConfig")
    if params.sparse is not None:
        params.sparse.validate(params.block_length or params.max_tokens)
        if params.use_cache is not None or params.cfg_scale > 0:
            raise ValueError("sparse keeps its own cache and has no CFG pass: not with use_cache or cfg_scale")
    check_real("alg_temp", params.alg_temp, low=0, high=MAX_TEMPERATURE, allow_none=True)
    check_real("eps", params.eps, low=0, high=1, high_open=True)
    if params.alg is not None:
        check_choice("alg", params.alg, ALGORITHMS)
    elif params.alg_temp is not None or params.eps != 1e-3:
        raise ValueError("alg_temp and eps belong to Dream's sampler: set alg= (e.g. 'entropy') to use them")
    # the settings this request's way of decoding does not read (a family's loop refuses its own at add_request)
    if params.way == "method":   # `steps`: max_tokens is one token a step, unless the method reads steps itself
        # a cache method reads what its loop reads; its way: a method's, or a family's
        entry = method_of(params.use_cache, "use_cache") or entry
        refuse_unread(params, entry.way, entry.reads + (("steps",) if params.steps == params.max_tokens else ()),
                      name=type(params.method).__name__)
    elif params.way == "dream":   # Dream's own sampler reads reference_ties; its block decoder frechet_margin
        refuse_unread(params, "dream", (("threshold",) if params.alg == "confidence_threshold" else ()) + (
            ("reference_ties",) if params.block_length is None and params.use_cache is None else ("frechet_margin",)),
            alg=params.alg)
    elif params.way == "apd":
        refuse_unread(params, "apd")
    # the configs' work bounds that the lengths set here fix (docs/parameters.md, "Work bounds"); the
    # method's own checks run them again at add_request, with the prompt and the model's block
    for config in (params.decoder, params.use_cache, params.sparse):
        if config is not None and not isinstance(config, str):
            config.check_request(gen_length=params.max_tokens, block_length=params.block_length, steps=params.steps)

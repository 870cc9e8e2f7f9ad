"""`SamplingParams`: every decoding setting of one request, validated when it is built.

The checks are those of `remask.generate` / `ar_generate` (`remask/diffusion/parts/checks.py`), so a
request that would fail there fails here; model-dependent ones run at `LLMEngine.add_request`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from remask.diffusion.families.dream import ALGORITHMS
from remask.diffusion.families.llada import REMASKING, validate_block_args, validate_rule
from remask.diffusion.parts.cache import CACHE_MODES
from remask.diffusion.parts.checks import (MAX_LOGPROBS, MAX_TEMPERATURE, ParameterTypeError, check_bool, check_choice,
                                           check_instance, check_int, check_min_tokens, check_real, check_seed,
                                           check_steps, check_stop, refuse_unread)
from remask.diffusion.parts.sparse import SparseConfig


@dataclass(frozen=True)
class SamplingParams:
    """Decoding settings of one request, vLLM's names where vLLM has the setting (docs/parameters.md
    maps each field; docs/engine.md which decoders take `ignore_eos` / `min_tokens`).

    `max_tokens`: diffusion models fill exactly this many positions (at most, with `decoder=DAEDAL`, whose
    canvas grows); sample i of `n` draws from
    `seed + i` (None: from the engine's seed and the prompt). Diffusion: `remask.generate`'s keywords
    (LLaDA's block rule), `alg` (Dream's sampler), `decoder=` (docs/decoders.md): a method's config (`APDConfig`: APD,
    docs/apd.md), or the config of the model family's own loop (`SDARDecoding`, `LLaDA2Decoding`, `FastDLLMV2Decoding`:
    docs/block-diffusion.md; `CanvasDecoding`: docs/diffusion-gemma.md).
    `structured_outputs` (remask/structured.py) does not combine with `ignore_eos`, `min_tokens` or `stop`.
    """

    max_tokens: int = 16
    n: int = 1
    seed: int | None = None
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    steps: int | None = None
    block_length: int | None = None
    remasking: str = "low_confidence"
    threshold: float | None = None
    factor: float | None = None
    cfg_scale: float = 0.0
    use_cache: Any = None
    early_stop: bool = False
    logits_eos_inf: bool = False
    confidence_eos_eot_inf: bool | str = False
    reference_rng: bool = False
    reference_ties: bool = False
    sparse: SparseConfig | None = None
    alg: str | None = None
    alg_temp: float | None = None
    eps: float = 1e-3
    decoder: Any = None
    # vLLM's (last, so positional use of the fields above is unchanged)
    ignore_eos: bool = False
    min_tokens: int = 0
    structured_outputs: Any = None
    # Fast-dLLM++'s Fréchet profile rule beside threshold / factor (added after vLLM's: positions unchanged)
    frechet_margin: float | None = None
    # the log-probability of each generated token and its `logprobs` most likely alternatives
    # (vLLM's field; autoregressive models: docs/engine.md)
    logprobs: int | None = None

    def __post_init__(self) -> None:
        check_int("max_tokens", self.max_tokens, minimum=1)
        check_int("n", self.n, minimum=1)
        check_seed(self.seed, self.n)
        check_real("temperature", self.temperature, low=0, high=MAX_TEMPERATURE)
        check_real("top_p", self.top_p, low=0, high=1, low_open=True, allow_none=True)
        check_int("top_k", self.top_k, minimum=1, allow_none=True)
        object.__setattr__(self, "stop", check_stop(self.stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)):
            raise ParameterTypeError(f"stop_token_ids must be a list of ints, got {ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(check_int("stop_token_ids", i, minimum=0) for i in ids))
        check_bool("ignore_eos", self.ignore_eos)
        check_min_tokens(self.min_tokens, self.max_tokens)
        check_int("logprobs", self.logprobs, minimum=0, maximum=MAX_LOGPROBS, allow_none=True)
        if self.structured_outputs is not None:
            from remask.structured import StructuredOutputsParams

            object.__setattr__(self, "structured_outputs", StructuredOutputsParams.from_json(self.structured_outputs))
            clashes = [name for name, on in (("ignore_eos", self.ignore_eos), ("min_tokens", self.min_tokens > 0),
                                             ("stop", bool(self.stop))) if on]
            if clashes:
                raise ValueError(f"structured_outputs does not combine with {clashes}: the answer ends where its "
                                 "structure is complete, and these could end or cut it elsewhere")
        # LLaDA's block rule and Dream's sampler commit at least one token a step: more steps than
        # max_tokens only repeat forwards (and sized O(steps) buffers: steps=10**9 was an OOM kill)
        check_steps("steps", self.steps, self.max_tokens, "max_tokens")
        check_int("block_length", self.block_length, minimum=1, allow_none=True)
        from remask.diffusion.methods import registry
        from remask.diffusion.methods.decoders import check_decoder

        check_choice("remasking", self.remasking, REMASKING)
        validate_rule(self.threshold, self.factor, self.frechet_margin)
        check_real("cfg_scale", self.cfg_scale, low=0)
        # JSON forms (HTTP bodies, the CLI): {"name": ..., fields...} → the config objects
        for name in ("decoder", "use_cache"):
            if isinstance(getattr(self, name), dict):
                object.__setattr__(self, name, registry.from_json(name, getattr(self, name)))
        if self.decoder is not None:
            check_decoder(self.decoder)
        method = self.method
        # blocks tile max_tokens, except for a method whose canvas grows up to it (`Method.length_bound`)
        if method is None or not registry.method_of(method).length_bound:
            validate_block_args(self.max_tokens, self.block_length or self.max_tokens, self.steps or self.max_tokens)
        if not (registry.is_config("use_cache", self.use_cache)
                or isinstance(self.use_cache, (str, type(None))) and self.use_cache in CACHE_MODES):
            configs = "remask.VicinityCache, remask.DKVCache, remask.D2Cache, remask.ElasticCache"
            raise ValueError(f"use_cache must be one of {list(CACHE_MODES)} or a remask cache config ({configs}), "
                             f"got {self.use_cache!r}")
        if self.use_cache is not None and self.cfg_scale > 0:
            raise ValueError("cfg_scale > 0 cannot be combined with use_cache")
        for name in ("early_stop", "logits_eos_inf", "reference_rng", "reference_ties"):
            check_bool(name, getattr(self, name))
        if self.ignore_eos and self.early_stop:
            raise ValueError("ignore_eos makes EOS an ordinary token; early_stop ends a row at the first block holding "
                             "EOS: not both")
        check_choice("confidence_eos_eot_inf", self.confidence_eos_eot_inf, (False, True, "corrected"))
        check_instance("sparse", self.sparse, SparseConfig, "a remask.SparseConfig")
        if self.sparse is not None:
            self.sparse.validate(self.block_length or self.max_tokens)
            if self.use_cache is not None or self.cfg_scale > 0:
                raise ValueError("sparse keeps its own cache and has no CFG pass: not with use_cache or cfg_scale")
        check_real("alg_temp", self.alg_temp, low=0, high=MAX_TEMPERATURE, allow_none=True)
        check_real("eps", self.eps, low=0, high=1, high_open=True)
        if self.alg is not None:
            check_choice("alg", self.alg, ALGORITHMS)
        elif self.alg_temp is not None or self.eps != 1e-3:
            raise ValueError("alg_temp and eps belong to Dream's sampler: set alg= (e.g. 'entropy') to use them")
        # the settings this request's way of decoding does not read (a family's loop refuses its own at add_request)
        if self.way == "method":   # `steps`: max_tokens is one token a step, unless the method reads steps itself
            cache = registry.is_config("use_cache", self.use_cache)   # a cache method reads what its loop reads
            entry = registry.method_of(self.use_cache if cache else method)   # its way: a method's, or a family's
            refuse_unread(self, entry.way, entry.reads + (("steps",) if self.steps == self.max_tokens else ()),
                          name=type(method).__name__)
        elif self.way == "dream":   # Dream's own sampler reads reference_ties; its block decoder frechet_margin
            refuse_unread(self, "dream", (("threshold",) if self.alg == "confidence_threshold" else ()) + (
                ("reference_ties",) if self.block_length is None and self.use_cache is None else ("frechet_margin",)),
                alg=self.alg)
        elif self.way == "apd":
            refuse_unread(self, "apd")
        # the configs' work bounds that the lengths set here fix (docs/parameters.md, "Work bounds"); the
        # method's own checks run them again at add_request, with the prompt and the model's block
        for config in (self.decoder, self.use_cache, self.sparse):
            if config is not None and not isinstance(config, str):
                config.check_request(gen_length=self.max_tokens, block_length=self.block_length, steps=self.steps)

    @property
    def method(self) -> Any:
        """The registered method's config these params run (`decoder=`, else a cache config), or None."""
        if self.decoder is not None:
            return self.decoder
        from remask.diffusion.methods import registry

        return self.use_cache if registry.is_config("use_cache", self.use_cache) else None

    @property
    def way(self) -> str:
        """How these params decode on a bidirectional mask model (a key of `parts.checks.WAYS`): APD ("apd",
        `decoder=APDConfig(...)`), another registered method's loop ("method": a family's config too, whose loop
        refuses it on another model), Dream's sampler ("dream", `alg=`) or LLaDA's block rule ("llada"). The model
        may have a loop of its own (`presets.way_of`)."""
        from remask.diffusion.methods import registry

        if self.method is not None:
            return "apd" if registry.way_of(self.decoder) == "apd" else "method"
        return "dream" if self.alg is not None else "llada"

    @property
    def gen_length(self) -> int:
        return self.max_tokens

    def generate_kwargs(self) -> dict[str, Any]:
        """`remask.generate`'s keyword arguments that decode like these params (the engine's block decoder too)."""
        same = ("temperature", "cfg_scale", "remasking", "logits_eos_inf", "confidence_eos_eot_inf", "threshold",
                "factor", "frechet_margin", "early_stop", "reference_rng", "use_cache", "sparse", "reference_ties")
        return dict(steps=self.steps or self.max_tokens, gen_length=self.max_tokens,
                    block_length=self.block_length or self.max_tokens, **{name: getattr(self, name) for name in same})

    def diffusion_generate_kwargs(self) -> dict[str, Any]:
        """`remask.diffusion_generate`'s keyword arguments (Dream's sampler, `alg` set) for these params."""
        kw = dict(max_new_tokens=self.max_tokens, steps=self.steps or self.max_tokens, eps=self.eps, alg=self.alg,
                  alg_temp=self.alg_temp, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
        # block_length / use_cache: Fast-dLLM's Dream block decoder
        kw.update({name: getattr(self, name) for name in ("threshold", "frechet_margin", "block_length", "use_cache")
                   if getattr(self, name) is not None})
        if self.block_length is None and self.use_cache is None:   # Dream's own sampler: its tie order
            kw["reference_ties"] = self.reference_ties
        return kw

    def ar_kwargs(self, eos_ids: list[int]) -> dict[str, Any]:
        """The keyword arguments of `remask.ar_generate` (EOS ids: the model's plus `stop_token_ids`;
        with `ignore_eos` only `stop_token_ids`, which still end the answer, as in vLLM)."""
        ends = set(self.stop_token_ids) if self.ignore_eos else set(eos_ids) | set(self.stop_token_ids)
        return dict(max_new_tokens=self.max_tokens, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                    eos_token_id=sorted(ends))

    def replace(self, **changes: Any) -> "SamplingParams":
        return dataclasses.replace(self, **changes)

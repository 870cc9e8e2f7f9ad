"""`SamplingParams`: every decoding setting of one request, validated when it is built.

The checks are those of `remask.generate` / `ar_generate` (`remask/diffusion/parts/checks.py`), so a
request that would fail there fails here; the diffusion settings and the method's config are checked by one function
of the registry (`remask.diffusion.methods.registry.check_settings`); model-dependent checks run at
`LLMEngine.add_request`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from remask.diffusion.methods import registry
from remask.diffusion.parts.checks import (MAX_LOGPROBS, MAX_TEMPERATURE, ParameterTypeError, changed, check_bool,
                                           check_choice, check_int, check_ints, check_min_tokens, check_real,
                                           check_seed, check_stop)

OUTPUT_KINDS = ("cumulative", "final_only")


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
    sparse: Any = None   # a remask.SparseConfig
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
    # what `LLMEngine.step` reports of the request (vLLM's `output_kind`): "cumulative", its output whenever its
    # final tokens grow; "final_only", one output when it finishes (`LLM.generate`'s: no per-step text or lists)
    output_kind: str = "cumulative"

    def __post_init__(self) -> None:
        check_ints(1, max_tokens=self.max_tokens, n=self.n)
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
        check_choice("output_kind", self.output_kind, OUTPUT_KINDS)
        if self.structured_outputs is not None:
            from remask.structured import StructuredOutputsParams

            object.__setattr__(self, "structured_outputs", StructuredOutputsParams.from_json(self.structured_outputs))
            clashes = changed(self, ("ignore_eos", "min_tokens", "stop"))
            if clashes:
                raise ValueError(f"structured_outputs does not combine with {clashes}: the answer ends where its "
                                 "structure is complete, and these could end or cut it elsewhere")
        for name in ("decoder", "use_cache"):   # JSON forms (HTTP bodies, the CLI): {"name": ..., fields...} → configs
            if isinstance(getattr(self, name), dict):
                object.__setattr__(self, name, registry.from_json(name, getattr(self, name)))
        registry.check_settings(self)   # the diffusion settings, the method's config, what its way does not read

    @property
    def method(self) -> Any:
        """The registered method's config these params run (`decoder=`, else a cache config), or None."""
        if self.decoder is not None:
            return self.decoder
        return self.use_cache if registry.is_config("use_cache", self.use_cache) else None

    @property
    def way(self) -> str:
        """How these params decode on a bidirectional mask model (a key of `parts.checks.WAYS`): APD ("apd",
        `decoder=APDConfig(...)`), another registered method's loop ("method": a family's config too, whose loop
        refuses it on another model), Dream's sampler ("dream", `alg=`) or LLaDA's block rule ("llada"). The model
        may have a loop of its own (`presets.way_of`)."""
        if self.method is not None:
            return "apd" if registry.way_of(self.decoder) == "apd" else "method"
        return "dream" if self.alg is not None else "llada"

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

"""The validation layer: every public entry point (the drop-in functions, the configs, `SamplingParams`, the
server) checks its arguments here, once per call, before the model. Every error names the parameter, the value and
what is allowed. A wrong type raises `ParameterTypeError`, both a `TypeError` and a `ValueError`, so
`except ValueError` catches every bad argument (a server's HTTP 400). Tensor checks cost a host sync or two per call.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import os
import reprlib
import sys
import warnings
from typing import Any, Iterable, Sequence

import torch

from remask.models.spec import ModelSpec

from .stats import GenerationStats


class CombinationError(ValueError, NotImplementedError):
    """Parts that do not combine (both named): a ValueError, and a NotImplementedError for older callers."""


class ParameterTypeError(TypeError, ValueError):
    """A parameter of the wrong type (a string or tensor where a number belongs, …)."""


def _type_name(value: Any) -> str:
    return f"a {value.dtype} tensor of shape {tuple(value.shape)}" if torch.is_tensor(value) else type(value).__name__


def check_bool(name: str, value: Any, allow_none: bool = False) -> bool | None:
    """`value` must be True or False (not 0/1, not a string), or None with `allow_none`."""
    if not isinstance(value, bool) and not (value is None and allow_none):
        raise ParameterTypeError(f"{name} must be True or False, got {value!r} ({_type_name(value)})")
    return value


def check_bools(**flags: Any) -> None:
    """`check_bool` of each named flag, in order."""
    for name, value in flags.items():
        check_bool(name, value)


def check_int(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None,
              allow_none: bool = False) -> int | None:
    """An integer (not a bool, float or tensor) in [minimum, maximum]."""
    if value is None and allow_none:
        return None
    bounds = "" if minimum is None and maximum is None else (f" >= {minimum}" if maximum is None else (
        f" <= {maximum}" if minimum is None else f" in [{minimum}, {maximum}]"))
    allowed = f"an int{bounds}" + (" or None" if allow_none else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ParameterTypeError(f"{name} must be {allowed}, got {value!r} ({_type_name(value)})")
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be {allowed}, got {value}")
    return value


# Work bounds (docs/parameters.md): the largest value of each setting sizing a request's work that can
# still change the answer; beyond them a request only burns memory and time (`steps=10**9` OOM-killed a server).
MAX_N = 128                 # samples per prompt: OpenAI's cap (a server may set its own: build_app(max_n=...))
SEED_LIMIT = 1 << 64        # torch.Generator.manual_seed takes [0, 2**64) (it wraps negatives, overflows beyond)
MAX_LOGPROBS = 20           # alternatives per token (`logprobs`): OpenAI's top_logprobs cap, vLLM's default
MAX_TEMPERATURE = 100.0     # far past uniform sampling already (logits are O(10)); 1e308 is a typo, not a setting
MAX_LOOP_STEPS = 1024       # ~20x the defaults of DiffusionGemma's max_denoising_steps (48), LLaDA2.1's max_post_steps
MAX_STOP_STRINGS = 64       # `stop` strings per request, each searched in every sample's growing text (OpenAI: 4)
MAX_STOP_LENGTH = 256       # characters per `stop` string: a marker that ends the text, not a document


def check_stop(stop: Any) -> tuple[str, ...]:
    """`stop`: a non-empty string or a list of ≤ MAX_STOP_STRINGS of them (≤ MAX_STOP_LENGTH each), as a tuple."""
    strings = (stop,) if isinstance(stop, str) else stop
    if not isinstance(strings, (list, tuple)) or not all(isinstance(s, str) and s for s in strings):
        raise ParameterTypeError(f"stop must be a non-empty string or a list of them, got {reprlib.repr(stop)}")
    if len(strings) > MAX_STOP_STRINGS:
        raise ValueError(f"stop must hold at most {MAX_STOP_STRINGS} strings (MAX_STOP_STRINGS), got {len(strings)}")
    longest = max(range(len(strings)), key=lambda i: len(strings[i]), default=None)
    if longest is not None and len(strings[longest]) > MAX_STOP_LENGTH:
        raise ValueError(f"stop strings must have at most {MAX_STOP_LENGTH} characters (MAX_STOP_LENGTH); "
                         f"stop[{longest}] has {len(strings[longest])}")
    return tuple(strings)


def check_at_most(name: str, value: int | None, maximum: int, what: str, default: int | None = None) -> None:
    """A config's int setting at most `maximum`, the largest value that can still change the decoding (`what` names
    it: "the block length"); past it the setting would silently act as `maximum`. The config's `default` always
    passes: the bound is max(maximum, default)."""
    bound = maximum if default is None else max(maximum, default)
    if value is not None and value > bound:
        also = "" if bound == maximum else f"; its default {default} always passes"
        raise ValueError(f"{name} must be <= {maximum} ({what}{also}), got {value}: a larger value acts as {maximum}")


def check_config_bounds(config: Any, prefix: str, bounds: dict[str, tuple[int, str]]) -> None:
    """`check_at_most` for a dataclass config's fields (`bounds`: field → (maximum, what)), named ``prefix.field``."""
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    for field, (maximum, what) in bounds.items():
        check_at_most(f"{prefix}.{field}", getattr(config, field), maximum, what, defaults[field])


def check_seed(seed: Any, n: int = 1) -> int | None:
    """None, or an int seed with `seed + n - 1` (sample i draws from `seed + i`) below 2**64, as
    `torch.Generator.manual_seed` needs (rather than torch's "Overflow when unpacking long long")."""
    check_int("seed", seed, minimum=0, allow_none=True)
    if seed is not None and seed + n - 1 >= SEED_LIMIT:
        raise ValueError(f"seed must be an int in [0, 2**64 - n] (sample i draws from seed + i; n = {n}), got {seed}")
    return seed


def check_steps(name: str, steps: Any, maximum: int, what: str, allow_none: bool = True) -> int | None:
    """A step count in [1, `maximum`]: each step commits a token, so more than `what` cannot change the answer."""
    check_int(name, steps, minimum=1, allow_none=allow_none)
    if steps is not None and steps > maximum:
        raise ValueError(f"{name} must be <= {what} ({maximum}): each step commits at least one token, so more "
                         f"steps only repeat forwards; got {steps}")
    return steps


def check_min_tokens(min_tokens: Any, max_tokens: int) -> int:
    """`min_tokens` (vLLM's): the tokens before an end token or `stop` string may end the answer, in [0, max_tokens]."""
    check_int("min_tokens", min_tokens, minimum=0)
    if min_tokens > max_tokens:
        raise ValueError(f"min_tokens must be <= max_tokens ({max_tokens}), got {min_tokens}")
    return int(min_tokens)


def check_real(name: str, value: Any, *, low: float | None = None, high: float | None = None,
               low_open: bool = False, high_open: bool = False, allow_none: bool = False) -> float | None:
    """A finite real (int or float, not a bool or tensor) in [low, high], each end open with `low_open`/`high_open`."""
    if value is None and allow_none:
        return None
    interval = "" if low is None and high is None else (
        f" in {'(' if low_open else '['}{'-inf' if low is None else low}, "
        f"{'inf' if high is None else high}{')' if high_open or high is None else ']'}")
    allowed = f"a finite number{interval}" + (" or None" if allow_none else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ParameterTypeError(f"{name} must be {allowed}, got {value!r} ({_type_name(value)})")
    value = float(value)
    too_low = low is not None and (value < low or (low_open and value == low))
    too_high = high is not None and (value > high or (high_open and value == high))
    if not math.isfinite(value) or too_low or too_high:
        raise ValueError(f"{name} must be {allowed}, got {value}")
    return value


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> Any:
    """`value` must be one of `choices`, compared by type and value (so 1 is not True)."""
    choices = list(choices)
    if not any(type(value) is type(c) and value == c for c in choices):
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def check_instance(name: str, value: Any, cls: type, what: str | None = None, allow_none: bool = True) -> Any:
    if value is None and allow_none:
        return None
    if not isinstance(value, cls):
        raise ParameterTypeError(f"{name} must be {what or cls.__name__}{' or None' if allow_none else ''}, "
                                 f"got {_type_name(value)}")
    return value


def check_generator(generator: Any, device: torch.device) -> torch.Generator | None:
    """None, or a `torch.Generator` on the device the sampling runs on."""
    check_instance("generator", generator, torch.Generator, "a torch.Generator")
    if generator is not None and generator.device.type != torch.device(device).type:
        raise ValueError(f"generator is on {generator.device.type} but decoding runs on {device}; "
                         f"pass torch.Generator(device={str(torch.device(device).type)!r})")
    return generator


def check_stats(name: str, stats: Any) -> Any:
    return check_instance(name, stats, GenerationStats, "a remask.GenerationStats")


def model_device(model: torch.nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:  # pragma: no cover - parameterless stand-ins
        return torch.device("cpu")


def check_model_kind(spec: ModelSpec, *, diffusion: bool, entry: str) -> None:
    """A diffusion model where one is needed, an autoregressive one where that is needed."""
    if diffusion and spec.kind == "ar":
        raise ValueError(f"{entry} decodes diffusion models (LLaDA, Dream); model is autoregressive: "
                         "use remask.ar_generate")
    if diffusion and spec.attention == "block-causal":
        raise ValueError(f"{entry} decodes bidirectional mask models (LLaDA, Dream); the {spec.kind} model is "
                         "block-causal: use remask.compat.sdar.block_diffusion_generate")
    if not diffusion and spec.kind != "ar":
        raise ValueError(f"{entry} decodes autoregressive (causal) models; model is a {spec.kind} diffusion model: "
                         "use remask.generate or remask.diffusion_generate")


# What `check_prompt` refuses of an attention mask, in the order of its facts: not 0/1, not left-padded, a row empty.
_MASK_REFUSALS = ("attention_mask must hold only 0 (pad) and 1 (token)",
                  "attention_mask must be left-padded (0s, then 1s in every row): remask appends the generation after "
                  "the last column; set tokenizer.padding_side = 'left'",
                  "attention_mask has a row with no real token (all 0): every row needs at least one")


_PROMPT_READ_WHOLE = 4096   # ids of a CPU prompt without attention mask that `check_prompt` reads in Python


def check_prompt(device: torch.device, prompt: Any, attention_mask: Any, name: str = "prompt",
                 spec: ModelSpec | None = None, mask_in_prompt: str = "allow") -> None:
    """A `[B, P]` integer tensor of in-vocabulary ids on the model's `device` (`ModelSpec.device`), and an optional
    0/1 `attention_mask` of its shape, left-padded (the samplers append after the last column), a real token in every
    row. `mask_in_prompt`: "allow" (the sampler infills masks anywhere, as Dream's) or "refuse" (it decodes only after
    the prompt)."""
    if not torch.is_tensor(prompt) or prompt.dim() != 2:
        raise ValueError(f"{name} must be a 2-D LongTensor [batch, length], got "
                         f"{type(prompt).__name__}{tuple(prompt.shape) if torch.is_tensor(prompt) else ''}")
    if prompt.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must hold integer token ids (torch.long), got dtype {prompt.dtype}")
    if prompt.shape[0] == 0 or prompt.shape[1] == 0:
        raise ValueError(f"{name} must have at least one row and one token, got shape {tuple(prompt.shape)}")
    if prompt.device != device:
        raise ValueError(f"{name} is on {prompt.device} but the model is on {device}; move them to one device")
    if attention_mask is not None:
        if not torch.is_tensor(attention_mask) or attention_mask.shape != prompt.shape:
            raise ValueError(f"attention_mask must have the shape of {name} {tuple(prompt.shape)}, got "
                             f"{tuple(attention_mask.shape) if torch.is_tensor(attention_mask) else attention_mask!r}")
        if attention_mask.device != prompt.device:
            raise ValueError(f"attention_mask is on {attention_mask.device} but {name} is on {prompt.device}")
        if attention_mask.is_complex():
            raise ValueError(f"attention_mask must hold 0/1 values, got dtype {attention_mask.dtype}")
    if spec is None or prompt.device.type == "meta":
        return
    mask = attention_mask
    refuse_mask = mask_in_prompt == "refuse" and spec.mask_id is not None
    if mask is None and prompt.device.type == "cpu" and prompt.numel() <= _PROMPT_READ_WHOLE:
        # an engine request's prompt: its ids read once beat five tensor calls
        ids = prompt.reshape(-1).tolist()
        facts = [min(ids), max(ids), *([int(spec.mask_id in ids)] if refuse_mask else [])]
    else:   # one host sync for every tensor check
        facts = [prompt.min(), prompt.max()]
        if mask is not None:
            facts += [((mask != 0) & (mask != 1)).any(), (mask[:, 1:] < mask[:, :-1]).any(), (mask[:, -1] != 1).any()]
        if refuse_mask:
            facts.append((prompt == spec.mask_id).any())
        facts = [int(f) for f in torch.stack([f.to(device=prompt.device, dtype=torch.long) for f in facts]).tolist()]
    bad = facts[0] if facts[0] < 0 else facts[1]   # the min if negative, else the max
    if spec.vocab_size is not None and not 0 <= bad < spec.vocab_size:
        raise ValueError(f"{name} holds token id {bad}, outside the model's vocabulary [0, {spec.vocab_size})")
    for fact, refusal in zip(facts[2:5] if mask is not None else (), _MASK_REFUSALS):
        if fact:
            raise ValueError(refusal)
    if refuse_mask and facts[-1]:
        where = (prompt == spec.mask_id).nonzero()[0].tolist()
        raise ValueError(f"{name} holds the mask token id {spec.mask_id} (row {where[0]}, position {where[1]}); "
                         "this sampler decodes only the positions after the prompt and would return it: remove it, "
                         "or infill with remask.diffusion_generate (Dream's sampler fills masks anywhere)")


def check_mask_id(spec: ModelSpec) -> None:
    if spec.mask_id is None:
        raise ValueError(f"the model ({spec.kind}) has no mask token: pass mask_id=<id of the mask token>")
    check_token_id(spec, spec.mask_id, "mask_id")
    if spec.pad_id is not None and spec.mask_id == spec.pad_id:
        raise ValueError(f"mask_id={spec.mask_id} equals the pad token id; the mask id must differ from pad_id")


def check_length(spec: ModelSpec, total: int, what: str) -> None:
    if spec.max_length is not None and total > spec.max_length:
        raise ValueError(f"{what} = {total} exceeds the model's maximum sequence length {spec.max_length}")


def check_context(spec: ModelSpec, prompt_length: int, max_tokens: int) -> None:
    """The prompt and `max_tokens` within the model's context: checked before anything is sized by `max_tokens`."""
    if spec.max_length is None:
        return
    if prompt_length >= spec.max_length:
        raise ValueError(f"prompt has {prompt_length} tokens; the model's maximum sequence length is "
                         f"{spec.max_length}, which leaves no room for an answer")
    if prompt_length + max_tokens > spec.max_length:
        raise ValueError(f"max_tokens = {max_tokens} with a prompt of {prompt_length} tokens exceeds the model's "
                         f"maximum sequence length {spec.max_length}: max_tokens <= {spec.max_length - prompt_length} "
                         "here")


def check_token_id(spec: ModelSpec, value: int | None, name: str) -> int:
    if value is None:
        raise ValueError(f"{name} is needed here but the model declares none; pass it explicitly")
    check_int(name, value)
    if spec.vocab_size is not None and not 0 <= value < spec.vocab_size:
        raise ValueError(f"{name}={value} is outside the vocabulary [0, {spec.vocab_size})")
    return value


def check_optional_token_id(spec: ModelSpec, value: Any, name: str) -> int | None:
    """None, or a token id inside the vocabulary."""
    return None if value is None else check_token_id(spec, value, name)


def warn(message: str) -> None:
    """A UserWarning attributed to the caller's line, outside remask and torch (whose decorators add frames)."""
    inner = tuple(os.path.dirname(sys.modules[name].__file__) + os.sep for name in (
        "torch", "remask", "remask.diffusion", "remask.models", "remask.kernels") if name in sys.modules)
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(inner):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, UserWarning, stacklevel=level)


def warn_if_padded_without_mask(prompt: torch.Tensor, attention_mask: Any, pad_id: int | None) -> None:
    """transformers' warning: a batch that holds pad tokens but comes without an attention mask."""
    if attention_mask is None and pad_id is not None and bool((prompt == pad_id).any()):
        warn("Padding was detected but no attention mask is passed here. For correct generation results, "
             "please set `attention_mask` when batch-padding inputs.")


def warn_if_longer_than_trained(spec: ModelSpec, gen_length: int) -> None:
    """Warn past the answer length a model declares it was trained on (remask's tiny models): nonsense beyond it."""
    if spec.trained_gen_length is not None and gen_length > spec.trained_gen_length:
        warn(f"gen_length={gen_length} is longer than the answers this model was trained on "
             f"({spec.trained_gen_length} positions, config.trained_gen_length): expect nonsense beyond them")


def check_settings(field: str, settings: Any, allowed: Sequence[str]) -> dict:
    """A dict of settings (e.g. Prophet's `early_exit_thresholds`) with keys in `allowed`, copied for per-key checks."""
    if not isinstance(settings, dict):
        raise ParameterTypeError(f"{field} must be a dict of {list(allowed)}, got {type(settings).__name__}")
    unknown = sorted(set(settings) - set(allowed))
    if unknown:
        raise ValueError(f"{field}: unknown setting(s) {unknown}; allowed: {list(allowed)}")
    return dict(settings)


def changed(obj: Any, names: Iterable[str]) -> list[str]:
    """The settings among `names` that `obj` holds away from their defaults, in `names`' order: `obj` a dataclass (its
    fields' defaults) or a drop-in call's arguments, name → (value, default); names it lacks are skipped."""
    if isinstance(obj, dict):
        return [name for name in names if name in obj and obj[name][0] != obj[name][1]]
    defaults = _defaults(type(obj))
    return [name for name in names if name in defaults and getattr(obj, name) != defaults[name]]


@functools.lru_cache(maxsize=None)
def _defaults(cls: type) -> dict[str, Any]:
    """A dataclass's field defaults by name, read once per class (every request's admission asks)."""
    return {f.name: f.default for f in dataclasses.fields(cls)}


# The settings that choose and steer a request's decoding (`SamplingParams` fields, `remask.generate`'s keywords)
# and what each way of decoding reads of them, with its refusal: one set away from its default that the request's
# way does not read is refused by name (`refuse_unread`). A registered method (`decoder=`, a cache config) reads
# "method"'s plus its registry line's `reads`; a block-causal family's loop "family"'s (`parts.blocks.engine_settings`).
DECODING = ("temperature", "top_p", "top_k", "steps", "block_length", "remasking", "threshold", "factor",
            "frechet_margin", "cfg_scale", "use_cache", "early_stop", "logits_eos_inf", "confidence_eos_eot_inf",
            "reference_rng", "reference_ties", "sparse", "alg", "alg_temp", "eps", "apd", "decoder", "on_step",
            "eos_id", "eot_id")
WAYS: dict[str, tuple[tuple[str, ...], str]] = {
    "llada": (tuple(n for n in DECODING if n not in ("top_p", "top_k", "alg", "alg_temp", "eps", "apd", "decoder")),
              "{unread}: top_p / top_k filter autoregressive sampling and Dream's (alg=...); LLaDA's block rule "
              "samples with Gumbel-max over the full vocabulary: leave them None"),
    "dream": (("temperature", "top_p", "top_k", "steps", "block_length", "use_cache", "alg", "alg_temp", "eps"),
              "alg={alg!r} selects Dream's sampler, which does not read {unread} (LLaDA's block rule does)"),
    "method": (("block_length", "use_cache", "decoder", "eps"),
               "{name} runs its own rule (greedy) and does not read {unread}"),
    "apd": (("temperature", "top_p", "top_k", "decoder"),
            "apd decodes left to right with its verifier; it does not combine with {unread}"),
    "ar": (("temperature", "top_p", "top_k"), "the model is autoregressive; these settings are for diffusion models: "
           "{unread}"),
    "canvas": (("reference_rng", "decoder"), "a uniform-noise model (DiffusionGemma) does not read {unread}; its "
               "settings are decoder=remask.CanvasDecoding(...) (max_denoising_steps, t_min, t_max, entropy_bound, "
               "stability_threshold, confidence_threshold, sampler) and reference_rng"),
    "family": (("decoder",), "{name} (a block-causal model's own loop) does not read {unread}; it reads temperature, "
               "top_p, top_k (not Fast-dLLM v2), threshold and decoder= (its family's config, remask.FreeDave or a "
               "commit rule; docs/block-diffusion.md)"),
}


def refuse_unread(params: Any, way: str, also: Iterable[str] = (), **words: Any) -> None:
    """Refuse the decoding settings of `params` (`SamplingParams`, or a drop-in call's arguments as `changed` takes
    them) set away from their defaults that `way` (a key of WAYS) does not read, besides `also`; `words` fill its
    message."""
    reads, message = WAYS[way]
    unread = [name for name in changed(params, DECODING) if name not in reads and name not in also]
    if unread:
        raise ValueError(message.format(unread=unread, **words))


def check_method_call(spec: ModelSpec, prompt: Any, attention_mask: Any, stats: Any, entry: str | None = None,
                      name: str = "prompt", generator: Any = None, **ids: Any) -> tuple[ModelSpec, Any]:
    """What a method's loop checks at its call, in order: `generator` (on the model's device; None: none given), `stats`
    (None: a fresh one, counted, then dropped), a diffusion model (`entry`: the caller named in the refusal; None:
    not checked), the model's spec (`ids` override its token ids) with a mask token, then `prompt` (named `name`) /
    `attention_mask`, the mask token refused in the prompt."""
    check_generator(generator, spec.device)
    stats = check_stats("stats", stats) or GenerationStats()
    spec = spec.with_overrides(**ids)
    if entry is not None:
        check_model_kind(spec, diffusion=True, entry=entry)
    check_mask_id(spec)
    check_prompt(spec.device, prompt, attention_mask, name, spec=spec, mask_in_prompt="refuse")
    return spec, stats


def check_config(name: str, config: Any, cls: type, what: str) -> Any:
    """A method's config: an instance of `cls` (`what` names it in the refusal); None is `cls()`, its defaults."""
    return check_instance(name, cls() if config is None else config, cls, what, allow_none=False)


def check_ints(minimum: int, **values: Any) -> None:
    """`check_int` of each named value with the one lower bound `minimum` (a loop's settings)."""
    for name, value in values.items():
        check_int(name, value, minimum=minimum)


def checked(default: Any, check: Any, **bounds: Any) -> Any:
    """A config field with its `default` that `check(name, value, **bounds)` (`check_int`, `check_real`,
    `check_bool`, `check_choice`, ...) checks by the field's name when the config is built (`Checked`)."""
    return dataclasses.field(default=default, metadata={"check": (check, bounds)})


class Checked:
    """The base of a method's config (a frozen dataclass): its `checked` fields are checked, in field order, when it
    is built; a config with checks across fields runs them after ``super().__post_init__()``. `qualified`: refusals
    name a field as ``ConfigName.field`` (a family's config, whose fields repeat its loop's argument names)."""

    qualified = False

    def __post_init__(self) -> None:
        prefix = f"{type(self).__name__}." if self.qualified else ""
        for field in dataclasses.fields(self):
            if "check" in field.metadata:
                check, bounds = field.metadata["check"]
                check(prefix + field.name, getattr(self, field.name), **bounds)


class NoWorkBound(Checked):
    """The base of a method's config whose settings bound no work (docs/parameters.md, "Work bounds", "Not
    bounded"): values past what can change the decoding read "at most" and cost no more (the config's docstring
    says why); its `check_request`, which `SamplingParams` and the entry points call on every config, refuses
    nothing."""

    def check_request(self, *, gen_length: int | None = None, block_length: int | None = None,
                      steps: int | None = None, prompt_length: int | None = None) -> None:
        """Nothing to refuse (the class docstring)."""

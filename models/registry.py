"""One place per model family: each model module ends with `register_family(Family(...))`.

A family is what remask needs to know to take a `config.model_type`: how to build its `ModelSpec`
from a config, which of remask's own classes (if any) transformers' Auto classes should map it to
(so official checkpoints load without `trust_remote_code`), and which Auto class loads a whole
checkpoint of it (`remask.load`). Adding a family touches its own module and nothing else;
samplers read the spec, never the family.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from .spec import ModelSpec

logger = logging.getLogger("remask.models")

# The attention implementations remask's own model classes run (SDPA, or the same maths eagerly).
ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa")
_NOTIFIED: set[tuple[str, str]] = set()


def accept_attn_implementation(config_name: str, kwargs: dict[str, Any]) -> None:
    """Drop an `attn_implementation` key of a checkpoint's config.json that remask's model class
    does not offer (SDAR's released configs name `flex_attention`): a key a loader does not use is
    accepted, never an exception, and the model runs the attention it has (SDPA), with a one-line
    notice. Called from each family config's `__post_init__`, before transformers reads the key."""
    requested = kwargs.get("attn_implementation")
    if requested is not None and requested not in ATTENTION_IMPLEMENTATIONS:
        kwargs.pop("attn_implementation")
        if (config_name, requested) in _NOTIFIED:   # configs are rebuilt while loading: say it once
            return
        _NOTIFIED.add((config_name, requested))
        logger.warning("%s: config.json names attn_implementation=%r, which remask's implementation does not "
                       "offer; using sdpa (same outputs)", config_name, requested)


@dataclass(frozen=True)
class Family:
    """model_type: `config.model_type` (matched case-insensitively). spec: config → `ModelSpec`.
    config_class / model_class: remask's classes, registered with AutoConfig and `auto_classes`
    (None for models transformers ships itself). load_class: the Auto class `remask.load` uses.
    generate: ``"module:function"`` of the family's drop-in entry point, called as
    `function(model, *args, **kwargs)`; `remask.patch(model)` attaches it as `model.generate`
    (None: the diffusion models' `generate` / `diffusion_generate` pair).
    settings: the `SamplingParams` field holding a request's settings for this family's decoder
    (e.g. ``"sdar"``); the engine refuses it for models of other families.
    engine_decoder: ``"module:function"`` building the decoder of one engine request,
    `function(engine, params)`; None: the engine's own choice by the spec (LLaDA, Dream, AR, ...)."""

    model_type: str
    spec: Callable[[Any], ModelSpec]
    config_class: type | None = None
    model_class: type | None = None
    auto_classes: tuple[str, ...] = ()
    load_class: str = "AutoModel"
    generate: str | None = None
    settings: str | None = None
    engine_decoder: str | None = None

    def entry_point(self) -> Callable[..., Any] | None:
        """The function named by `generate`, imported on first use (it lives outside `models`)."""
        return _resolve(self.generate)

    def decoder_factory(self) -> Callable[..., Any] | None:
        """The function named by `engine_decoder`, imported on first use."""
        return _resolve(self.engine_decoder)


def _resolve(target: str | None) -> Callable[..., Any] | None:
    if target is None:
        return None
    import importlib

    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Make `family` known: its spec to `get_spec`, its loader to `remask.load`, and its classes
    (when remask provides them) to transformers' Auto classes. Returns the family."""
    FAMILIES[family.model_type.lower()] = family
    if family.config_class is not None:
        import transformers

        transformers.AutoConfig.register(family.config_class.model_type, family.config_class, exist_ok=True)
        for name in family.auto_classes:
            getattr(transformers, name).register(family.config_class, family.model_class, exist_ok=True)
    return family


def family_of(model_type: str) -> Family | None:
    """The registered family of a `config.model_type`, or None (an autoregressive model)."""
    return FAMILIES.get(str(model_type).lower())

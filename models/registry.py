"""One place per model family: each model module ends with `register_family(Family(...))`.

A family is what remask needs to know to take a `config.model_type`: how to build its `ModelSpec`
from a config, which of remask's own classes (if any) transformers' Auto classes should map it to
(so official checkpoints load without `trust_remote_code`), and which Auto class loads a whole
checkpoint of it (`remask.load`). Adding a family touches its own module and nothing else;
samplers read the spec, never the family.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .spec import ModelSpec


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

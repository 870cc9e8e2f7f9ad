"""One place per model family: each model module ends with `register_family(Family(...))`.

A family is what remask needs to know to take a `config.model_type`: how to build its `ModelSpec`
from a config, which of remask's own classes (if any) transformers' Auto classes should map it to
(so official checkpoints load without `trust_remote_code`), and which Auto class loads a whole
checkpoint of it (`remask.load`). Adding a family touches its own module (and, for one of remask's
own, `FAMILY_MODULES` and `configs.py`); samplers read the spec, never the family.

Family modules are imported on demand, so that `import remask` stays light: `family_of` imports
the module of a known model type the first time it is asked, and each config class of
`configs.py` imports its family module when it is built (which registers the model classes with
the Auto classes before transformers looks them up).
"""
from __future__ import annotations

import importlib
import logging
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:   # an annotation only: spec.py looks families up here
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
    engine_decoder: ``"module:function"`` building the decoder of one engine request,
    `function(spec, params, *, store, stop_ids)`: the model's `ModelSpec`, the request's `SamplingParams`, the
    engine's paged KV store (`runner.store`) and its stop ids (never the engine itself); None: the engine's own
    choice by the spec (LLaDA, Dream, AR, ...)."""

    model_type: str
    spec: Callable[[Any], ModelSpec]
    config_class: type | None = None
    model_class: type | None = None
    auto_classes: tuple[str, ...] = ()
    load_class: str = "AutoModel"
    generate: str | None = None
    engine_decoder: str | None = None

    def entry_point(self) -> Callable[..., Any] | None:
        """The function named by `generate`, imported on first use (it lives outside `models`)."""
        return resolve(self.generate)

    def decoder_factory(self) -> Callable[..., Any] | None:
        """The function named by `engine_decoder`, imported on first use."""
        return resolve(self.engine_decoder)


def resolve(target: str | None) -> Callable[..., Any] | None:
    """The function a "module:function" string names, imported on first use: how a model family
    reaches the decoding code above it (its drop-in, its engine decoder, its official model methods)
    without importing it — the registry's late binding, as entry points are."""
    if target is None:
        return None
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


FAMILIES: dict[str, Family] = {}

# Where each of remask's families lives: `config.model_type` (lower case) → the module whose
# `register_family` call registers it. `family_of` imports the module the first time it is asked.
FAMILY_MODULES: dict[str, str] = {
    "llada": "remask.models.llada",
    "dream": "remask.models.dream",
    "sdar": "remask.models.sdar",
    "sdar_moe": "remask.models.sdar",
    "llada2_moe": "remask.models.llada2",
    "fast_dllm_qwen": "remask.models.fast_dllm_v2",
    "diffusion_gemma": "remask.models.diffusion_gemma",
}


def load_family_module(model_type: str) -> bool:
    """Import the module of `model_type`'s family, if remask has one (a no-op once it is imported;
    a module in the middle of its own import is returned as it is). True if there is one."""
    module = FAMILY_MODULES.get(str(model_type).lower())
    if module is None:
        return False
    importlib.import_module(module)
    return True


def all_families() -> dict[str, Family]:
    """`FAMILIES` with every family module imported (for code that iterates over all families)."""
    for module in dict.fromkeys(FAMILY_MODULES.values()):
        importlib.import_module(module)
    return FAMILIES


def register_family(family: Family) -> Family:
    """Make `family` known: its spec to `get_spec`, its loader to `remask.load`, and its classes
    (when remask provides them) to transformers' Auto classes (with the tensor-parallel style
    their `_tp_plan` names). Returns the family."""
    module = FAMILY_MODULES.get(family.model_type.lower())
    if module is not None and module not in sys.modules:
        importlib.import_module(module)   # remask's own registration first, so that this one replaces it
    FAMILIES[family.model_type.lower()] = family
    if family.config_class is not None:
        import transformers

        transformers.AutoConfig.register(family.config_class.model_type, family.config_class, exist_ok=True)
        for name in family.auto_classes:
            getattr(transformers, name).register(family.config_class, family.model_class, exist_ok=True)
        if family.model_class is not None:
            from .parallel import register_tp_styles

            register_tp_styles()   # the "vocab_parallel" style remask's models name in their _tp_plan
    return family


def family_of(model_type: str) -> Family | None:
    """The registered family of a `config.model_type`, or None (an autoregressive model). A family
    of remask's whose module is not imported yet is imported first (`FAMILY_MODULES`)."""
    key = str(model_type).lower()
    family = FAMILIES.get(key)
    if family is None and load_family_module(key):
        family = FAMILIES.get(key)
    return family

"""Model families: LLaDA and Dream (remask's implementations, registered with transformers' Auto
classes when this package is imported — plain `AutoConfig.register` / `AutoModel*.register` calls;
every remask API that touches a model imports it, and so does the first use of any name of
`remask` — so official checkpoints load without trust_remote_code) and
DiffusionGemma (transformers' own classes), SDAR and SDAR-MoE (block diffusion on Qwen3 / Qwen3-MoE backbones). Each module registers its family in one call at its
end (`registry.register_family`); `get_spec` gives the spec samplers use for any model.

Importing this package registers the config classes (`configs.py`) with `AutoConfig` and nothing
heavier: a family module (its model classes, which import `transformers.modeling_utils`) is
imported when a config of it is built, when `family_of` / `get_spec` meets its model type, or when
one of its names below is first used."""
from __future__ import annotations

import importlib
from typing import Any

from .configs import (DreamConfig, FastDLLMV2Config, LLaDA2MoeConfig, LLaDAConfig, SDARConfig, SDARMoeConfig,
                      register_configs)
from .registry import Family, all_families, family_of, register_family
from .spec import ModelSpec, get_spec, register_spec

# Names resolved on first use (PEP 562): name → the module of this package that defines it.
_LAZY = {
    "DreamModel": "dream",
    "FastDLLMV2ForCausalLM": "fast_dllm_v2",
    "KVCache": "layers",
    "LLaDAModelLM": "llada",
    "LLaDA2MoeModelLM": "llada2",
    "SDARForCausalLM": "sdar",
    "SDARMoeForCausalLM": "sdar",
}


def __getattr__(name: str) -> Any:
    if name == "FAMILIES":   # every family, so its module is imported first
        value: Any = all_families()
    elif name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def register_with_transformers() -> None:
    """Register every family's classes with transformers' Auto classes again (they are registered
    at import; this is for a transformers whose registries were reset)."""
    register_configs()
    for family in list(all_families().values()):
        register_family(family)


register_configs()

__all__ = [
    "DreamConfig", "DreamModel", "FAMILIES", "FastDLLMV2Config", "FastDLLMV2ForCausalLM", "Family", "KVCache", "LLaDAConfig", "LLaDAModelLM", "LLaDA2MoeConfig", "LLaDA2MoeModelLM",
    "ModelSpec",
    "SDARConfig", "SDARForCausalLM", "SDARMoeConfig", "SDARMoeForCausalLM", "family_of", "get_spec", "register_family", "register_spec", "register_with_transformers",
]

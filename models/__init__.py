"""Model families: LLaDA and Dream (remask's implementations, registered with transformers' Auto
classes when `remask` is imported, so official checkpoints load without trust_remote_code) and
DiffusionGemma (transformers' own classes), SDAR and SDAR-MoE (block diffusion on Qwen3 / Qwen3-MoE backbones). Each module registers its family in one call at its
end (`registry.register_family`); `get_spec` gives the spec samplers use for any model."""
from . import diffusion_gemma   # noqa: F401  (transformers' own classes: only its family)
from .dream import DreamConfig, DreamModel
from .layers import KVCache
from .llada import LLaDAConfig, LLaDAModelLM
from .llada2 import LLaDA2MoeConfig, LLaDA2MoeModelLM
from .parallel import register_tp_styles
from .sdar import SDARConfig, SDARForCausalLM, SDARMoeConfig, SDARMoeForCausalLM
from .fast_dllm_v2 import FastDLLMV2Config, FastDLLMV2ForCausalLM
from .registry import FAMILIES, Family, family_of, register_family
from .spec import ModelSpec, get_spec, register_spec


def register_with_transformers() -> None:
    """Register every family's classes with transformers' Auto classes again (they are registered
    at import; this is for a transformers whose registries were reset)."""
    for family in list(FAMILIES.values()):
        register_family(family)


register_tp_styles()

__all__ = [
    "DreamConfig", "DreamModel", "FAMILIES", "FastDLLMV2Config", "FastDLLMV2ForCausalLM", "Family", "KVCache", "LLaDAConfig", "LLaDAModelLM", "LLaDA2MoeConfig", "LLaDA2MoeModelLM",
    "ModelSpec",
    "SDARConfig", "SDARForCausalLM", "SDARMoeConfig", "SDARMoeForCausalLM", "family_of", "get_spec", "register_family", "register_spec", "register_with_transformers",
]

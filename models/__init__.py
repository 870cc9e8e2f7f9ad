"""Model implementations and specs: LLaDA and Dream (registered with transformers' Auto classes
when `remask` is imported), plus the spec lookup samplers use for any model."""
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from . import diffusion_gemma   # registers the DiffusionGemma spec (transformers' own classes)
from .dream import DreamConfig, DreamModel
from .layers import KVCache
from .llada import LLaDAConfig, LLaDAModelLM
from .parallel import register_tp_styles
from .spec import ModelSpec, get_spec, register_spec


def register_with_transformers() -> None:
    """Map `model_type` "llada" / "Dream" to remask's classes in AutoConfig, AutoModel and
    AutoModelForCausalLM, so official checkpoint directories load without trust_remote_code."""
    for config_cls, model_cls in ((LLaDAConfig, LLaDAModelLM), (DreamConfig, DreamModel)):
        AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
        AutoModel.register(config_cls, model_cls, exist_ok=True)
        AutoModelForCausalLM.register(config_cls, model_cls, exist_ok=True)


register_with_transformers()
register_tp_styles()

__all__ = [
    "DreamConfig", "DreamModel", "KVCache", "LLaDAConfig", "LLaDAModelLM", "ModelSpec", "get_spec",
    "register_spec", "register_with_transformers",
]

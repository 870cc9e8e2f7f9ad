"""remask: reference-exact samplers and fused kernels for diffusion LLMs (LLaDA, Dream, DiffusionGemma) and AR models.

    import remask
    from transformers import AutoModel
    model = AutoModel.from_pretrained("path/to/LLaDA-8B-Instruct")   # no trust_remote_code needed
    out = remask.generate(model, prompt_ids, steps=128, gen_length=128, block_length=32)
"""
from remask import _noise  # noqa: F401  (first: quiets two third-party import messages, see the module)
from remask import models as _models  # noqa: F401  (registers LLaDA and Dream with transformers)
from remask.diffusion.checks import ParameterTypeError
from remask.diffusion import (
    APDConfig, CanvasSampler, DreamGenerationConfig, DreamModelOutput, GenerationStats, SparseConfig, ar_generate, diffusion_generate,
    generate)
from remask.engine import LLM, LLMEngine, RequestOutput, SamplingParams
from remask.diffusion.dinfer import (CreditDecoding, HierarchicalDecoding, IterationSmoothing, ThresholdDecoding,
                                     VicinityCache)
from remask.diffusion.d2cache import D2Cache
from remask.diffusion.dkv import DKVCache
from remask.diffusion.elastic import ElasticCache
from remask.diffusion.freedave import FreeDave
from remask.diffusion.wino import WINO
from remask.models import DreamConfig, DreamModel, LLaDAConfig, LLaDAModelLM, ModelSpec, get_spec
from remask.patching import patch
from remask.text import answer_text, stop_token_ids
from remask.zoo import load

__version__ = "0.1.0"

__all__ = [
    "APDConfig", "CanvasSampler", "CreditDecoding", "D2Cache", "DKVCache", "DreamConfig", "ElasticCache", "FreeDave", "HierarchicalDecoding", "ThresholdDecoding",
    "VicinityCache", "IterationSmoothing", "WINO", "DreamGenerationConfig", "DreamModel", "DreamModelOutput", "GenerationStats",
    "LLM", "LLMEngine", "LLaDAConfig", "LLaDAModelLM", "ModelSpec", "ParameterTypeError", "RequestOutput", "SamplingParams", "SparseConfig", "answer_text", "ar_generate",
    "diffusion_generate", "generate", "get_spec", "load", "patch", "stop_token_ids",
]

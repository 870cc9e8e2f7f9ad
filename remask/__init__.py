"""remask: reference-exact samplers and fused kernels for diffusion LLMs (LLaDA, Dream, DiffusionGemma) and AR models.

    import remask.models   # registers LLaDA, Dream, ... with transformers' Auto classes
    from transformers import AutoModel
    model = AutoModel.from_pretrained("path/to/LLaDA-8B-Instruct")   # no trust_remote_code needed
    out = remask.generate(model, prompt_ids, steps=128, gen_length=128, block_length=32)

`import remask` imports neither torch nor transformers (`remask --help` stays fast): the public
names below are imported on first use. remask's model families are registered with transformers'
Auto classes when `remask.models` is imported; every public name imports it first, so using any
of them (or importing `remask.models`) registers them. `import remask` alone does not.
"""
from __future__ import annotations

import importlib
from typing import Any

from remask import _noise  # noqa: F401  (first: quiets two third-party import messages, see the module)

__version__ = "0.1.0"

# The public names, each imported from its module on first use (PEP 562).
_EXPORTS = {
    "ParameterTypeError": "remask.diffusion.parts.checks",
    **dict.fromkeys(("APDConfig", "CanvasSampler", "DreamGenerationConfig", "DreamModelOutput", "GenerationStats",
                     "SparseConfig", "ar_generate", "diffusion_generate", "generate"), "remask.diffusion"),
    **dict.fromkeys(("LLM", "LLMEngine", "RequestOutput", "SamplingParams"), "remask.engine"),
    **dict.fromkeys(("CreditDecoding", "HierarchicalDecoding", "IterationSmoothing", "ThresholdDecoding",
                     "VicinityCache"), "remask.diffusion.methods.dinfer"),
    "D2Cache": "remask.diffusion.methods.d2cache",
    "DAEDAL": "remask.diffusion.methods.daedal",
    "DKVCache": "remask.diffusion.methods.dkv",
    "ElasticCache": "remask.diffusion.methods.elastic",
    "FreeDave": "remask.diffusion.methods.freedave",
    "MarginDecoding": "remask.diffusion.methods.margin",
    "EBSampler": "remask.diffusion.methods.eb_sampler",
    "FrechetRule": "remask.diffusion.methods.frechet",
    "KLASS": "remask.diffusion.methods.klass",
    "WINO": "remask.diffusion.methods.wino",
    "Prophet": "remask.diffusion.methods.prophet",
    "MultiBlock": "remask.diffusion.methods.multiblock",
    "SDARDecoding": "remask.diffusion.families.sdar",
    "LLaDA2Decoding": "remask.diffusion.families.llada2",
    "FastDLLMV2Decoding": "remask.diffusion.families.fast_dllm_v2",
    "CanvasDecoding": "remask.diffusion.families.canvas",
    **dict.fromkeys(("DreamConfig", "DreamModel", "LLaDAConfig", "LLaDAModelLM", "ModelSpec", "get_spec"),
                    "remask.models"),
    "patch": "remask.patching",
    **dict.fromkeys(("answer_text", "stop_token_ids"), "remask.text"),
    "load": "remask.zoo",
    "StructuredOutputsParams": "remask.structured",
}
# Subpackages `import remask` used to import, reachable as attributes (`remask.diffusion.families.llada`).
_SUBMODULES = ("caches", "diffusion", "engine", "kernels", "models", "patching", "structured", "text", "zoo")


def __getattr__(name: str) -> Any:
    if name in _EXPORTS or name in _SUBMODULES:
        importlib.import_module("remask.models")   # registers the families with transformers' Auto classes
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_SUBMODULES))


__all__ = [
    "APDConfig", "CanvasDecoding", "CanvasSampler", "EBSampler", "CreditDecoding", "D2Cache", "DAEDAL", "DKVCache", "DreamConfig", "ElasticCache", "FastDLLMV2Decoding", "FrechetRule", "FreeDave", "HierarchicalDecoding", "KLASS", "MarginDecoding", "ThresholdDecoding",
    "VicinityCache", "IterationSmoothing", "WINO", "MultiBlock", "DreamGenerationConfig", "DreamModel", "DreamModelOutput", "GenerationStats",
    "LLM", "LLMEngine", "LLaDA2Decoding", "LLaDAConfig", "LLaDAModelLM", "ModelSpec", "ParameterTypeError", "Prophet", "RequestOutput", "SDARDecoding", "SamplingParams", "SparseConfig", "StructuredOutputsParams", "answer_text", "ar_generate",
    "diffusion_generate", "generate", "get_spec", "load", "patch", "stop_token_ids",
]

"""The engine: many requests decoded together, step by step (nano-vllm's shape).

`SamplingParams` (validated settings) → `LLMEngine.add_request` → `Scheduler` (who runs this
step) → `ModelRunner` (the forwards, shared where shapes allow) → the samplers' own commit
(`BlockDecoder.commit`, `ARDecoder.step`) → `RequestOutput`. `LLM` drives it offline.
"""
from .llm import LLM
from .llm_engine import EngineState, LLMEngine
from .sampling_params import SamplingParams
from .sequence import CompletionOutput, RequestOutput, SequenceStatus

__all__ = ["CompletionOutput", "EngineState", "LLM", "LLMEngine", "RequestOutput", "SamplingParams", "SequenceStatus"]

"""The engine: many requests decoded together, step by step (nano-vllm's shape).

`SamplingParams` → `LLMEngine.add_request` → `Scheduler` (who runs this step: admission,
preemption) → `ModelRunner` (the forwards, shared where shapes allow) → the samplers' own commit →
`RequestOutput`. `LLM` drives it offline; `PageManager` is the page allocator.
"""
from __future__ import annotations

import importlib
from typing import Any

# Imported on first use: `from remask.engine import SamplingParams` (the server's protocol, the
# integrations) loads that module alone, not the engine with every decoder family.
_EXPORTS = {
    "LLM": ".llm", "LLMEngine": ".llm_engine", "EngineState": ".llm_engine", "SamplingParams": ".sampling_params",
    "CompletionOutput": ".sequence", "Logprob": ".sequence", "RequestOutput": ".sequence", "SequenceStatus": ".sequence",
    "PageManager": "remask.caches.page_manager",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

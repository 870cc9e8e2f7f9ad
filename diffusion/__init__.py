"""Samplers: small functions over tensors composed by short generate loops.

`scoring.score_tokens` (vocabulary-wide: logits → token, confidence) and `selection` (which
positions to commit) are the two seams the Triton kernels fill.
"""
from .ar import ar_generate
from .dream import DreamGenerationConfig, DreamModelOutput, diffusion_generate
from .llada import block_diffusion_generate, generate
from .scoring import score_tokens
from .selection import commit, schedule_counts, select_factor, select_threshold, select_topk
from .stats import GenerationStats

__all__ = [
    "DreamGenerationConfig", "DreamModelOutput", "GenerationStats", "ar_generate", "block_diffusion_generate",
    "commit", "diffusion_generate", "generate", "schedule_counts", "score_tokens", "select_factor",
    "select_threshold", "select_topk",
]

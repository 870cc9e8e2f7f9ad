"""Samplers: small functions over tensors composed by short generate loops.

Each loop is forward → `scoring.score_rows` (the fused confidence kernel) → `remask.kernels.unmask`
(select and commit in one launch); `scoring.score_tokens` keeps the reference formulations for
reference-stream and Dream categorical sampling.
"""
from .apd import APDConfig, apd_generate
from .ar import ar_generate
from .dream import DreamGenerationConfig, DreamModelOutput, diffusion_generate
from .llada import block_diffusion_generate, generate
from .scoring import score_rows, score_tokens
from .selection import schedule_counts
from .sparse import SparseConfig
from .stats import GenerationStats

__all__ = [
    "APDConfig", "apd_generate", "DreamGenerationConfig", "DreamModelOutput", "GenerationStats", "ar_generate", "block_diffusion_generate",
    "diffusion_generate", "generate", "schedule_counts", "score_rows", "score_tokens", "SparseConfig",
]

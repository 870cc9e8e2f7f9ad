"""Samplers: small functions over tensors composed by short generate loops.

Each sampler is a decoder with a state and a step (`BlockDecoder`, `DreamDecoder`, `ARDecoder`),
which the generate functions drive for one batch and the engine for many. Each step is forward → `scoring.score_rows` (the fused confidence kernel) → `remask.kernels.unmask`
(select and commit in one launch); `scoring.score_tokens` keeps the reference formulations for
reference-stream and Dream categorical sampling.
"""
from .apd import APDConfig, apd_generate
from .ar import ARDecoder, ar_generate
from .canvas import CanvasSampler, canvas_generate
from .dream import DreamDecoder, DreamGenerationConfig, DreamModelOutput, diffusion_generate
from .llada import BlockDecoder, block_diffusion_generate, generate
from .scoring import score_rows, score_tokens
from .selection import schedule_counts
from .sparse import SparseConfig
from .stats import GenerationStats

__all__ = [
    "APDConfig", "ARDecoder", "BlockDecoder", "CanvasSampler", "DreamDecoder", "DreamGenerationConfig", "DreamModelOutput",
    "GenerationStats", "SparseConfig", "apd_generate", "ar_generate", "block_diffusion_generate", "canvas_generate", "diffusion_generate",
    "generate", "schedule_counts", "score_rows", "score_tokens",
]

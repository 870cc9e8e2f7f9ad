"""Triton kernels with torch references beside them (fused confidence scoring, unmasking, paged KV,
block-sparse attention). The samplers reach them through `remask.diffusion.scoring.score_tokens`
and `remask.diffusion.selection`."""

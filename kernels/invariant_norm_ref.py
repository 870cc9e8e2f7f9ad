"""Torch reference of the batch-invariant RMSNorm (`invariant_norm.py`): the CPU runtime and the
tests' oracle. The arithmetic of `models/layers.py`'s `RMSNorm` (LLaDA, Dream) and transformers'
`Qwen2RMSNorm` / `LlamaRMSNorm`: statistics in float32, the normalised row cast back to the input
dtype, then multiplied by the weight as it is (``weight * x̂``, not Gemma's ``(1 + weight)``; a
caller with that convention passes ``1 + weight``).
"""
from __future__ import annotations

import torch

# (rtol, atol) of the kernel against `rms_norm_torch`: the mean of squares is summed in another
# order, so the reciprocal square root may differ in its last float32 bit, and a 16-bit output by
# one rounding of x̂ before the weight multiply.
NORM_TOLERANCE = {torch.float32: (1e-5, 1e-6), torch.float16: (2e-3, 1e-3), torch.bfloat16: (1.6e-2, 1e-2)}


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x · rsqrt(mean(x²) + eps))`` per row of x `[..., D]`, as `models/layers.py`'s RMSNorm."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)

"""Torch reference of the batch-invariant linear (`invariant_matmul.py`): the tests' and benchmarks'
oracle. It is not the CPU runtime — the dispatcher runs `F.linear` there — and it is not bitwise
the kernel (another summation order): results agree within the usual float32-accumulation
tolerance of the input dtype (`LINEAR_TOLERANCE`).
"""
from __future__ import annotations

import torch

# (rtol, atol) of the kernel against `invariant_linear_torch`, per input dtype: the kernel and the
# reference both accumulate in float32, in other orders; the 16-bit outputs round once at the end.
LINEAR_TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1e-2)}


def invariant_linear_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` in float32 (x `[M, K]`, weight `[N, K]`, bias `[N]`), cast back to x's dtype."""
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)

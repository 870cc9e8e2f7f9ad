"""A batch-invariant RMSNorm: every output row bitwise the same whatever other rows share the
launch (issue 38).

One program per row; the row is read in chunks of a fixed `NORM_CHUNK` (or the row's next power
of two, if shorter — a function of D only), the squares summed in float32 into a `[BLOCK_D]`
accumulator chunk after chunk, from the first, then reduced once (`tl.sum`, a fixed tree for the
block); ``rstd = 1 / sqrt(mean + eps)`` correctly rounded (`div_rn`, `sqrt_rn`). A second pass
writes ``weight · (x · rstd → x's dtype)`` — the arithmetic of `models/layers.py`'s RMSNorm (and
transformers' Qwen2 / Llama RMSNorm): the normalised row is rounded to the input dtype before the
weight multiply, which is done in float32 and rounded once (the product of two 16-bit floats is
exact in float32, so this is torch's 16-bit multiply bit for bit). Nothing depends on the number
of rows: ``invariant_rms_norm(x)[i] == invariant_rms_norm(x[i:i+1])[0]`` bit for bit.

x `[M, D]` (rows may be strided, D contiguous), weight `[D]` of x's dtype (taken as it is: Gemma's
``1 + weight`` convention is the caller's to pass), eps a float; returns `[M, D]` in x's dtype.
`invariant_rms_norm` dispatches: Triton on CUDA (or ``REMASK_TRITON=1``), `invariant_norm_ref.
rms_norm_torch` elsewhere. It is not wired into the models (their RMSNorm modules are torch ops).
"""
from __future__ import annotations

import torch

from .dispatch import HAS_TRITON, check_like, next_power_of_2, use_triton
from .invariant_norm_ref import rms_norm_torch

NORM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
NORM_CHUNK = 1024      # elements per chunk (8 float32 per thread at 4 warps)

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def invariant_rms_norm_kernel(x_ptr, w_ptr, y_ptr, D, stride_xm, stride_ym, eps, BLOCK_D: tl.constexpr):
        """Program r: row r of x `[M, D]` → row r of y; two passes over the row in BLOCK_D chunks."""
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * stride_xm
        y_row = y_ptr + row * stride_ym
        offs = tl.arange(0, BLOCK_D)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + offs
            v = tl.load(x_row + d, mask=d < D, other=0.0).to(tl.float32)
            acc += v * v
        mean = tl.sum(acc, axis=0) / D
        rstd = tl.math.div_rn(1.0, tl.math.sqrt_rn(mean + eps))
        for d0 in range(0, D, BLOCK_D):
            d = d0 + offs
            ok = d < D
            v = tl.load(x_row + d, mask=ok, other=0.0).to(tl.float32)
            h = (v * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
            w = tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)
            tl.store(y_row + d, (w * h).to(y_ptr.dtype.element_ty), mask=ok)


def invariant_rms_norm_block(D: int) -> int:
    """The chunk: `NORM_CHUNK`, or the next power of two of a shorter row (a function of D only)."""
    return min(NORM_CHUNK, next_power_of_2(max(D, 1)))


def _check(x, weight, eps) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D tensor [M, D], got shape {tuple(getattr(x, 'shape', ())) or None}")
    if x.dtype not in NORM_DTYPES:
        raise ValueError(f"x dtype must be one of {[str(d) for d in NORM_DTYPES]}, got {x.dtype}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"weight must be a 1-D tensor [D={x.shape[1]}], got shape "
                         f"{tuple(getattr(weight, 'shape', ())) or None}")
    check_like("weight", weight, x)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a float >= 0, got {eps!r}")


def invariant_rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Launch the kernel (arguments as `invariant_rms_norm`; checked here too)."""
    _check(x, weight, eps)
    M, D = x.shape
    y = torch.empty((M, D), dtype=x.dtype, device=x.device)
    if M == 0 or D == 0:
        return y
    if D > 1 and x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(0) != 1:
        weight = weight.contiguous()
    invariant_rms_norm_kernel[(M,)](x, weight, y, D, x.stride(0), y.stride(0), float(eps),
                                    BLOCK_D=invariant_rms_norm_block(D), num_warps=4)
    return y


def invariant_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x `[M, D]`: ``weight · (x / sqrt(mean(x²) + eps))``, statistics in
    float32, every row independent of the others bit for bit (module docstring). Triton on CUDA
    (or with ``REMASK_TRITON=1``), the torch reference elsewhere."""
    _check(x, weight, eps)
    if not use_triton(x):
        return rms_norm_torch(x, weight, eps)
    return invariant_rms_norm_triton(x, weight, eps)

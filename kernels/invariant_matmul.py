"""A batch-invariant linear layer: ``y = x · Wᵀ + b`` whose every output row is bitwise the same
whatever other rows share the launch (issue 38).

A GEMM library picks its kernel (tile shape, split-K, the K order) by the problem's shape,
including M, the number of rows: a row's bits can then depend on how many rows share its matmul.
Here nothing the arithmetic depends on comes from M:

* the tile (BLOCK_M, BLOCK_N, BLOCK_K), `num_warps` and `num_stages` are chosen from (N, K, dtype)
  only (`invariant_linear_config`), one fixed configuration, no autotuning;
* every program owns whole output tiles and walks K from 0 upwards in BLOCK_K steps (no split-K, no
  atomics): output element (i, j) is the float32 accumulation of the same BLOCK_K-wide MMA steps in
  the same order for every M, and row i's value never reads another row (rows past M load zeros);
* M is not specialised (``do_not_specialize``): one compiled binary serves every M, so even the
  compiler's choices cannot follow the batch. Which program computes which tile (the grouped
  launch order) depends on M, but not what a tile computes.

So ``invariant_linear(x)[i] == invariant_linear(x[i:i+1])[0]`` bit for bit, for any x and any
batch composition (`tests/test_kernel_invariant.py`, under the interpreter). The price is that a
handful of rows (an autoregressive step, the LM head over a few positions) runs on the same 64-row
tile as a full block: what that costs against cuBLAS is for a GPU to measure (`make gpu-day`).

Operands: x `[M, K]`, weight `[N, K]` (`F.linear`'s layout; any strides), bias `[N]` or None, all
float32, float16 or bfloat16 and of one dtype; the output `[M, N]` has x's dtype. Accumulation is
float32; the bias is added after the K loop in float32, then the tile is cast once. 16-bit
operands go to `tl.dot` as they are (HMMA / HGMMA / tcgen05 kind::f16: `LOW_PRECISION_DOT`, as
`paged.low_precision_dot` chooses; bf16 under the interpreter is upcast right after the load, the
interpreter's bf16 dot being wrong); float32 operands use ``input_precision="ieee"`` — float32
FMAs, not TF32 — as `F.linear` with torch's default (TF32 off for matmuls).

`invariant_linear` is the dispatcher: Triton on CUDA (or with ``REMASK_TRITON=1``), `F.linear`
otherwise (not batch-invariant by itself: `remask.engine.batch_invariant` handles the CPU).
`invariant_matmul_ref.invariant_linear_torch` is the tests' float32 oracle.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .dispatch import HAS_TRITON, check_like, next_power_of_2, use_triton

LINEAR_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK_M = 64           # rows per tile, whatever M is
MAX_BLOCK_N = 128
MAX_BLOCK_K = 64       # 16-bit operands; float32 (FMA dots) takes 32
GROUP_M = 8            # tiles of 8 row blocks share a weight column block in the launch order (L2 reuse)

if HAS_TRITON:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    @triton.jit(do_not_specialize=["M"])
    def invariant_linear_kernel(
        x_ptr, w_ptr, b_ptr, y_ptr, M, N, K,
        stride_xm, stride_xk, stride_wn, stride_wk, stride_b, stride_ym,
        HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, LOW_PRECISION_DOT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        """One program per [BLOCK_M, BLOCK_N] output tile of y `[M, N]` (contiguous rows):
        acc = Σ over K in BLOCK_K steps, from 0 upwards, of x[rows, k] · W[cols, k]ᵀ in float32;
        then + bias (float32) and one cast to y's dtype. Row i's sum reads row i of x only."""
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * num_n
        first_m = (pid // per_group) * GROUP_M
        group_rows = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_rows
        pid_n = (pid % per_group) // group_rows

        rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < M
        col_ok = cols < N
        ks = tl.arange(0, BLOCK_K).to(tl.int64)
        x_rows = x_ptr + rows[:, None] * stride_xm
        w_cols = w_ptr + cols[None, :] * stride_wn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            if EVEN_K:
                a = tl.load(x_rows + k[None, :] * stride_xk, mask=row_ok[:, None], other=0.0)
                b = tl.load(w_cols + k[:, None] * stride_wk, mask=col_ok[None, :], other=0.0)
            else:
                k_ok = k < K
                a = tl.load(x_rows + k[None, :] * stride_xk, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(w_cols + k[:, None] * stride_wk, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if LOW_PRECISION_DOT:
                acc = tl.dot(a, b, acc, out_dtype=tl.float32)
            else:
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee", out_dtype=tl.float32)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols * stride_b, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


def invariant_linear_config(N: int, K: int, dtype: torch.dtype) -> dict:
    """The launch configuration for a weight `[N, K]` of `dtype` — a function of (N, K, dtype) only,
    never of the row count: BLOCK_M 64; BLOCK_N the next power of two of N up to 128; BLOCK_K the
    next power of two of K up to 64 (16-bit) or 32 (float32, whose FMA dot holds float32 operand
    tiles); all at least 16 (`tl.dot`'s minimum). 16-bit: 4 warps (a 64 × 128 float32 accumulator
    is 64 registers a thread), 3 pipeline stages; float32: 2 stages, and 8 warps for a 128-wide tile
    (at 4 its FMA dot took all 255 registers and spilled on sm_90), 4 for a narrower one (at 8 a
    64 × 64 tile spilled 12 B on sm_90 and sm_100)."""
    low = dtype in (torch.float16, torch.bfloat16)
    block_k = min(MAX_BLOCK_K if low else MAX_BLOCK_K // 2, max(16, next_power_of_2(K)))
    block_n = min(MAX_BLOCK_N, max(16, next_power_of_2(N)))
    return dict(BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=GROUP_M, EVEN_K=K % block_k == 0,
                num_warps=8 if not low and block_n == MAX_BLOCK_N else 4, num_stages=3 if low else 2)


def low_precision_dot(kernel, dtype: torch.dtype) -> bool:
    """`LOW_PRECISION_DOT`: 16-bit operands go to the MMA as they are, except bf16 under the
    interpreter (its bf16 dot is wrong; its fp16 one is right)."""
    if dtype not in (torch.float16, torch.bfloat16):
        return False
    return not (dtype == torch.bfloat16 and HAS_TRITON and isinstance(kernel, InterpretedFunction))


def _check(x, weight, bias) -> None:
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D tensor, got shape {tuple(getattr(t, 'shape', ())) or None}")
    if x.dtype not in LINEAR_DTYPES:
        raise ValueError(f"x dtype must be one of {[str(d) for d in LINEAR_DTYPES]}, got {x.dtype}")
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight has shape {tuple(weight.shape)}: expected [N, K={x.shape[1]}] for x {tuple(x.shape)}")
    check_like("weight", weight, x)
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.dim() != 1 or bias.shape[0] != weight.shape[0]:
            raise ValueError(f"bias must be a 1-D tensor [N={weight.shape[0]}], got shape "
                             f"{tuple(getattr(bias, 'shape', ())) or None}")
        check_like("bias", bias, x)


def invariant_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the kernel (arguments as `invariant_linear`; checked here too)."""
    _check(x, weight, bias)
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    cfg = invariant_linear_config(N, K, x.dtype)
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
    invariant_linear_kernel[grid](
        x, weight, bias if bias is not None else y, y, M, N, K,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), bias.stride(0) if bias is not None else 0,
        y.stride(0),
        HAS_BIAS=bias is not None, LOW_PRECISION_DOT=low_precision_dot(invariant_linear_kernel, x.dtype), **cfg)
    return y


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x · weightᵀ + bias`` with every row of the result independent of the others, bit for bit.

    Args:
        x: `[M, K]` float32 / float16 / bfloat16 (any strides; flatten leading dims first).
        weight: `[N, K]` of x's dtype (`nn.Linear.weight`). bias: `[N]` of x's dtype, or None.

    Returns `[M, N]` in x's dtype. On CUDA (or with ``REMASK_TRITON=1``) the Triton kernel, whose
    tile and K order do not depend on M (module docstring); elsewhere `F.linear`.
    """
    _check(x, weight, bias)
    if not use_triton(x):
        return F.linear(x, weight, bias)
    return invariant_linear_triton(x, weight, bias)

"""Batch-invariant linear layers: each batch row computed with the shapes it has alone.

A GEMM library picks its kernel by the problem's shape: on x86 CPUs a 1–3 row `F.linear`
(M = rows) takes another path than a larger one, so a row's bits can depend on how many rows share
its matmul. Inside `batch_invariant_linear()`, `F.linear` on a `[B, L, K]` input with B > 1 runs as
a batched GEMM of B problems of shape `[L, K]` — the problem each sequence poses alone — so every
sequence's result is the one `remask.generate` computes for it alone, whatever else is in the batch.
Measured bitwise on the shipped tiny models at one intra-op thread (`tests/test_engine.py`); with
several threads a batched GEMM may split the work otherwise than a single one, so the engine runs
its batched forwards on one thread when `batch_invariant=True` on CPU.

On CUDA (with Triton; not with ``REMASK_TRITON=0``) a plain-tensor weight's linear instead runs as
ONE `remask.kernels.invariant_matmul.invariant_linear` over all the rows, flattened to `[B·L, K]`:
that kernel's tile shape and K order do not depend on the number of rows, so each row's result is
bitwise the same in any batch, and every weight is read once per step rather than once per
sequence. It does not equal cuBLAS's `F.linear` bit for bit, so a forward is invariant only against
other forwards under this mode (the engine enters it for batched forwards; a batch of one must
enter it as well to give the same bits). Quantized weights (tensor subclasses) and dtypes the
kernel does not take keep the per-sequence path; what the kernel costs against cuBLAS is for a GPU
to measure (`make gpu-day`).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def _batched_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`[B, L, K]` → `[B, L, N]`, each of the B problems the GEMM `[L, K]·[K, N]` it is alone."""
    if type(weight) not in (torch.Tensor, torch.nn.Parameter):
        # A quantized weight (a tensor subclass: torchao's int8, ...) has its own kernel, which a
        # batched GEMM would bypass: each problem runs through it as alone, one after another.
        return torch.cat([F.linear(x[i:i + 1], weight, bias) for i in range(x.shape[0])])
    w_t = weight.t().expand(x.shape[0], *weight.t().shape)
    if bias is None:
        return torch.bmm(x, w_t)
    # addmm alone adds the bias inside the GEMM (C = bias; C += x·Wᵀ): the same here
    return torch.baddbmm(bias.expand(x.shape[0], x.shape[1], -1), x, w_t)


def _kernel_device(x: torch.Tensor) -> bool:
    """Where the batch-invariant kernel replaces the per-sequence GEMMs: CUDA tensors (the tests
    widen it to CPU tensors under the Triton interpreter)."""
    return x.is_cuda


def _invariant_kernel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """`F.linear` as one row-invariant launch over all of x's rows (`[..., K]` → `[..., N]`), or
    None where the kernel does not apply (off CUDA, Triton off, a quantized weight, other dtypes,
    or a forward that records gradients: the kernel has no backward)."""
    if not _kernel_device(x) or type(weight) not in (torch.Tensor, torch.nn.Parameter) or x.dim() < 2:
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return None
    from remask.kernels.dispatch import use_triton
    from remask.kernels.invariant_matmul import LINEAR_DTYPES, invariant_linear_triton

    if (not use_triton(x) or x.dtype not in LINEAR_DTYPES or weight.dtype != x.dtype or weight.dim() != 2
            or (bias is not None and (bias.dtype != x.dtype or type(bias) not in (torch.Tensor, torch.nn.Parameter)))):
        return None
    y = invariant_linear_triton(x.reshape(-1, x.shape[-1]), weight, bias)
    return y.view(*x.shape[:-1], weight.shape[0])


# Rows per flat GEMM call at most: the probe measures every size up to it, so a longer flat batch
# is cut into calls of at most this many rows (each at least half of it: above any threshold).
FLAT_ROWS = 1024
_PROBE_SIZES = tuple(range(1, 65)) + (80, 96, 127, 128, 160, 200, 255, 256, 300, 384, 500, 512, 640, 768, 900,
                                       1000, 1023, 1024)
_flat_thresholds: dict[tuple, int | None] = {}
# Weights up to this many elements are probed (a few seconds at most on one core); a larger one
# keeps the per-sequence GEMMs (its rows are compute-bound: one flat GEMM would save little).
PROBE_MAX_WEIGHT = 1 << 22


def flat_threshold(weight: torch.Tensor, bias: torch.Tensor | None) -> int | None:
    """The smallest M from which this CPU's `F.linear` gives every row the same bits whatever the
    number of rows M (up to `FLAT_ROWS`), measured once per (shape, dtype, bias, threads) on random
    data; None where no such M was found (the per-sequence GEMMs are then the only invariant path).

    BLAS libraries pick a kernel by the problem's shape: small M takes another path (measured here:
    M < 16 differs, M >= 16 agrees, under oneDNN/MKL on AVX-512, AVX2 and the default capability).
    Above that threshold a flat GEMM over every sequence's rows is row-invariant, so sequences of at
    least that many rows share one GEMM and read each weight once per step."""
    if weight.device.type != "cpu" or type(weight) not in (torch.Tensor, torch.nn.Parameter) \
            or weight.numel() > PROBE_MAX_WEIGHT:
        return None
    key = (tuple(weight.shape), weight.dtype, bias is not None, torch.get_num_threads())
    if key not in _flat_thresholds:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(weight.shape, generator=g).to(weight.dtype)
        b = torch.randn(weight.shape[0], generator=g).to(weight.dtype) if bias is not None else None
        x = torch.randn(FLAT_ROWS + 37, weight.shape[1], generator=g).to(weight.dtype)
        full = F.linear(x[:FLAT_ROWS], w, b)
        threshold = None
        for m in reversed(_PROBE_SIZES):
            if not all(torch.equal(F.linear(x[o:o + m], w, b), full[o:o + m]) for o in (0, 37) if o + m <= FLAT_ROWS):
                break
            threshold = m
        _flat_thresholds[key] = threshold if threshold is not None and threshold <= 64 else None
    return _flat_thresholds[key]


def _flat_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`[M, K]` rows, M at least the threshold: one GEMM, or GEMMs of at most `FLAT_ROWS` rows
    written straight into the output (the kernel `F.linear` calls: addmm, or mm without a bias)."""
    M = x.shape[0]
    if M <= FLAT_ROWS:
        return F.linear(x, weight, bias)
    parts = -(-M // FLAT_ROWS)
    size = -(-M // parts)
    x = x.contiguous()
    out = x.new_empty(M, weight.shape[0])
    for i in range(0, M, size):
        if bias is None:
            torch.mm(x[i:i + size], weight.t(), out=out[i:i + size])
        else:
            torch.addmm(bias, x[i:i + size], weight.t(), out=out[i:i + size])
    return out


class _PerSequenceLinear(TorchFunctionMode):
    """`token_groups`: for a flat (varlen) forward `[1, T, K]`, the rows of each group of
    equal-length sequences `(length, row indices)`; a `[1, S, K]` input with one row per sequence
    (the LM head over each sequence's last position) is S problems of one row."""

    def __init__(self, token_groups: list[tuple[int, torch.Tensor]] | None = None) -> None:
        super().__init__()
        self.token_groups = token_groups
        self.total = sum(len(rows) for _, rows in token_groups) if token_groups else 0
        self.num_seqs = sum(len(rows) // length for length, rows in token_groups) if token_groups else 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            y = _invariant_kernel_linear(x, weight, bias)
            if y is not None:          # CUDA: every row in one launch, whatever the layout
                return y
            if x.dim() == 3 and x.shape[0] > 1:
                return self._problems(x.reshape(-1, x.shape[-1]), weight, bias,
                                      [(x.shape[1], None)]).view(*x.shape[:2], -1)
            if x.dim() == 3 and self.token_groups is not None:
                if x.shape[1] == self.total:
                    return self._problems(x[0], weight, bias, self.token_groups)[None]
                if x.shape[1] == self.num_seqs and x.shape[1] > 1:
                    return _batched_linear(x.view(-1, 1, x.shape[2]), weight, bias).view(1, x.shape[1], -1)
        return func(*args, **kwargs)

    @staticmethod
    def _problems(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  groups: list[tuple[int, torch.Tensor | None]]) -> torch.Tensor:
        """`[N, K]` rows made of GEMM problems of `length` consecutive rows each (per group: its
        rows, None for all), each computed with the bits it has alone: the problems of at least
        `flat_threshold` rows in one flat GEMM, the shorter ones as a batched GEMM per length."""
        threshold = flat_threshold(weight, bias)
        flat = [(length, rows) for length, rows in groups if threshold is not None and length >= threshold]
        if len(flat) == len(groups):     # every problem long enough (the groups cover every row)
            return _flat_linear(x, weight, bias)
        out = x.new_empty(x.shape[0], weight.shape[0])
        if flat:
            rows = torch.cat([r for _, r in flat]) if len(flat) > 1 else flat[0][1]
            out.index_copy_(0, rows, _flat_linear(x.index_select(0, rows), weight, bias))
        for length, rows in groups:
            if threshold is not None and length >= threshold:
                continue
            part = x if rows is None else x.index_select(0, rows)
            part = part.view(-1, length, x.shape[1])
            y = F.linear(part, weight, bias) if part.shape[0] == 1 else _batched_linear(part, weight, bias)
            if rows is None:
                return y.reshape(x.shape[0], -1)
            out.index_copy_(0, rows, y.reshape(-1, y.shape[-1]))
        return out


@contextlib.contextmanager
def batch_invariant_linear(enabled: bool = True, single_thread: bool = True,
                           token_groups: list[tuple[int, torch.Tensor]] | None = None) -> Iterator[None]:
    """Run the block's forwards with per-sequence linear layers (and, on CPU, one intra-op thread).
    `token_groups`: the layout of a flat forward (see `_PerSequenceLinear`)."""
    if not enabled:
        yield
        return
    if single_thread:
        _one_thread.enter()
    try:
        with _PerSequenceLinear(token_groups):   # a mode stack is per thread: other threads are untouched
            yield
    finally:
        if single_thread:
            _one_thread.exit()


class _OneThread:
    """`torch.set_num_threads` is process-wide: with several engines (a server with several models)
    in one process, the first to enter sets one thread and the last to leave restores the count,
    so no engine restores it under another's forward."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.saved = 1

    def enter(self) -> None:
        with self.lock:
            if self.depth == 0:
                self.saved = torch.get_num_threads()
                if self.saved != 1:
                    torch.set_num_threads(1)
            self.depth += 1

    def exit(self) -> None:
        with self.lock:
            self.depth -= 1
            if self.depth == 0 and self.saved != 1:
                torch.set_num_threads(self.saved)


_one_thread = _OneThread()

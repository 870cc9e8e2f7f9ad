"""Batch-invariant linear layers: each batch row computed with the shapes it has alone.

A GEMM library picks its kernel by the problem's shape (on x86 CPUs a 1–3 row `F.linear` takes
another path), so a row's bits can depend on how many rows share its matmul. Inside
`batch_invariant_linear()`, `F.linear` on `[B, L, K]` runs as a batched GEMM of the B problems
`[L, K]` each sequence poses alone: its bits are those of `remask.generate` on it alone (measured at
one intra-op thread, `tests/test_engine.py`; several threads may split the work otherwise, so on CPU
the engine's batched forwards run on one thread). On CUDA with Triton a plain-tensor weight's linear
runs instead as ONE `remask.kernels.invariant_matmul.invariant_linear` over all rows: its tiling and
K order do not depend on the row count, but it does not equal cuBLAS bit for bit, so a forward is
invariant only against others under this mode (a batch of one must enter it too).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F


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
    """Where the invariant kernel replaces the per-sequence GEMMs (tests widen it to CPU tensors)."""
    return x.is_cuda


def _invariant_kernel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """`F.linear` as one row-invariant launch over all of x's rows, or None where the kernel does not
    apply (off CUDA, Triton off, a quantized weight, other dtypes, gradients: it has no backward)."""
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
# Weights up to this many elements are probed (seconds at most on one core); larger ones are
# compute-bound and keep the per-sequence GEMMs (one flat GEMM would save little).
PROBE_MAX_WEIGHT = 1 << 22


def flat_threshold(weight: torch.Tensor, bias: torch.Tensor | None) -> int | None:
    """The smallest M from which this CPU's `F.linear` gives every row the same bits whatever the
    number of rows (up to `FLAT_ROWS`), probed once per (shape, dtype, bias, threads); None if none
    (measured: M >= 16 under oneDNN/MKL). Sequences of at least M rows share one flat GEMM."""
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


class _PerSequenceLinear:
    """`F.linear` per GEMM problem. `token_groups`: for a flat (varlen) forward `[1, T, K]`, the rows of each group
    of equal-length sequences `(length, row indices)`; a `[1, S, K]` input with one row per sequence (the LM head
    over each sequence's last position) is S problems of one row."""

    def __init__(self, token_groups: list[tuple[int, torch.Tensor]] | None = None) -> None:
        self.regroup(token_groups)

    def regroup(self, token_groups: list[tuple[int, torch.Tensor]] | None) -> None:
        """A new layout (a request of a packed forward changed its rows between layers)."""
        self.token_groups = token_groups
        self.total = sum(len(rows) for _, rows in token_groups) if token_groups else 0
        self.num_seqs = sum(len(rows) // length for length, rows in token_groups) if token_groups else 0

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
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
        return _RAW_LINEAR(x, weight, bias)

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


class Seam:
    """`namespace.name` (a torch function) made a seam while any thread is inside `active` (torch's own again when
    the last leaves): a call runs that thread's innermost handler, whose own calls of the function run the handler
    outside it, the outermost's torch's (`raw`); another thread's calls meanwhile are torch's. Not a
    `TorchFunctionMode`: a mode sees every torch call of the forward in Python (in a 32-request d2Cache engine
    step, about 180 per request), a seam only its function's."""

    def __init__(self, namespace: Any, name: str) -> None:
        self.namespace, self.name, self.raw = namespace, name, getattr(namespace, name)
        self.lock, self.depth, self.local = threading.Lock(), 0, threading.local()

        def seamed(*args: Any, **kwargs: Any) -> Any:
            handlers = getattr(self.local, "handlers", None)
            if not handlers:
                return self.raw(*args, **kwargs)
            handler = handlers.pop()
            try:
                return handler(*args, **kwargs)
            finally:
                handlers.append(handler)
        self.seamed = seamed

    def handler(self) -> Any:
        """This thread's innermost handler (None outside)."""
        handlers = getattr(self.local, "handlers", None)
        return handlers[-1] if handlers else None

    @contextlib.contextmanager
    def active(self, handler: Callable[..., Any]) -> Iterator[Any]:
        with self.lock:
            if self.depth == 0:
                setattr(self.namespace, self.name, self.seamed)
            self.depth += 1
        handlers = self.local.__dict__.setdefault("handlers", [])
        handlers.append(handler)
        try:
            yield handler
        finally:
            handlers.pop()
            with self.lock:
                self.depth -= 1
                if self.depth == 0 and getattr(self.namespace, self.name) is self.seamed:
                    setattr(self.namespace, self.name, self.raw)


_RAW_LINEAR = F.linear
linear_seam = Seam(F, "linear")   # the linears of a thread inside `batch_invariant_linear` run per sequence


@contextlib.contextmanager
def batch_invariant_linear(enabled: bool = True, single_thread: bool = True,
                           token_groups: list[tuple[int, torch.Tensor]] | None = None) -> Iterator[None]:
    """Run the block's forwards with per-sequence linear layers (`enabled`) and, with `single_thread` (on CPU),
    at one intra-op thread, whether or not `enabled` (a lone forward of a model whose bits depend on the thread
    count: `ModelSpec.thread_sensitive`). `token_groups`: the layout of a flat forward (see `_PerSequenceLinear`)."""
    if single_thread:
        _one_thread.enter()
    try:
        if enabled:
            with linear_seam.active(_PerSequenceLinear(token_groups)) as mode:   # this thread's; others untouched
                yield mode
        else:
            yield None
    finally:
        if single_thread:
            _one_thread.exit()


class _OneThread:
    """`torch.set_num_threads` is process-wide: with several engines in one process, the first to
    enter sets one thread and the last to leave restores the count (never under another's forward)."""

    def __init__(self) -> None:
        self.lock, self.depth, self.saved = threading.Lock(), 0, 1

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

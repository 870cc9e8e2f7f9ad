"""tests/interpreter_speedups.py's forms of the Triton interpreter's reduce, scan and builtin patching give
the interpreter's own results, bit for bit: each kernel here runs under both and the outputs are compared."""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton interpreter's internals")

triton = pytest.importorskip("triton")
tl = triton.language
from triton.runtime import interpreter  # noqa: E402

if not hasattr(interpreter.ReduceOps, "original_generic_reduce"):   # this triton's interpreter kept its own forms
    pytest.skip("the speedups are not installed on this triton (tests/interpreter_speedups.py)", allow_module_level=True)


@contextlib.contextmanager
def interpreter_s_own():
    fast = (interpreter.ReduceOps.generic_reduce, interpreter.ScanOps.generic_scan, interpreter._patch_builtin)
    interpreter.ReduceOps.generic_reduce = interpreter.ReduceOps.original_generic_reduce
    interpreter.ScanOps.generic_scan = interpreter.ScanOps.original_generic_scan
    interpreter._patch_builtin = interpreter.original_patch_builtin
    try:
        yield
    finally:
        interpreter.ReduceOps.generic_reduce, interpreter.ScanOps.generic_scan, interpreter._patch_builtin = fast


@triton.jit
def _argmax_combine(a, ia, b, ib):   # a tuple combine, ties to the lower index
    take_b = (b > a) | ((b == a) & (ib < ia))
    return tl.where(take_b, b, a), tl.where(take_b, ib, ia)


@triton.jit
def _sum_in_order(a, b):   # float addition: the fold's order shows in the rounding
    return a + b * 1.0


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _reductions_kernel(x_ptr, k_ptr, out_ptr, idx_ptr, sorted_ptr, keys_ptr, scan_ptr, rscan_ptr, all_ptr, N: tl.constexpr,
                       M: tl.constexpr):
    rows = tl.arange(0, N)[:, None]
    cols = tl.arange(0, M)[None, :]
    x = tl.load(x_ptr + rows * M + cols)
    k = tl.load(k_ptr + rows * M + cols)
    i = tl.broadcast_to(cols, (N, M))
    best, best_i = tl.reduce((x, i), 1, _argmax_combine)
    tl.store(out_ptr + tl.arange(0, N), tl.reduce(x, 1, _sum_in_order))
    tl.store(idx_ptr + tl.arange(0, N), best_i)
    tl.store(sorted_ptr + rows * M + cols, tl.sort(x, 1, descending=True))
    tl.store(keys_ptr + rows * M + cols, tl.sort(k, 1))
    tl.store(scan_ptr + rows * M + cols, tl.associative_scan(k, 1, _max_combine))
    tl.store(rscan_ptr + rows * M + cols, tl.associative_scan(x, 0, _sum_in_order, reverse=True))
    tl.store(all_ptr, tl.reduce(k, None, _max_combine) ^ tl.xor_sum(tl.reshape(k, (N * M,)), 0))


def _run():
    g = torch.Generator().manual_seed(3)
    N, M = 4, 64
    x = torch.randn(N, M, generator=g) * torch.logspace(-8, 8, M)   # sums whose order shows in the rounding
    x[1, :7] = x[1, 7]    # ties for the argmax
    k = torch.randint(-2 ** 62, 2 ** 62, (N, M), generator=g)
    outs = [torch.full((N,), float("nan")), torch.full((N,), -1, dtype=torch.int32),
            torch.full((N, M), float("nan")), torch.zeros(N, M, dtype=torch.int64), torch.zeros(N, M, dtype=torch.int64),
            torch.full((N, M), float("nan")), torch.zeros(1, dtype=torch.int64)]
    _reductions_kernel[(1,)](x, k, *outs, N=N, M=M)
    return outs


def test_the_fast_reduce_scan_and_patching_give_the_interpreter_s_own_bits():
    fast = _run()
    with interpreter_s_own():
        own = _run()
    for a, b in zip(fast, own):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.int8 if a.is_floating_point() else a.dtype),
                                                  b.view(torch.int8 if b.is_floating_point() else b.dtype))
    assert not any(o.is_floating_point() and o.isnan().any() for o in fast)   # every output written


def test_the_patched_builtins_are_the_interpreter_s_own_and_are_restored():
    """After a kernel the language modules hold their builtins again, under both forms; inside a nested
    `@triton.jit` call they are wrapped under both (the kernel above calls helpers and `tl.sort`)."""
    def builtins():
        return {name for pkg in (tl, tl.core, tl.tensor, tl.math) for name in dir(pkg)
                if tl.core.is_builtin(getattr(pkg, name, None))}

    before = builtins()
    _run()
    after_fast = builtins()
    with interpreter_s_own():
        _run()
        after_own = builtins()
    assert after_fast == after_own and after_fast <= before

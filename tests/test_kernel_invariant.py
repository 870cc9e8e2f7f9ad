"""The batch-invariant kernels (issue 38): `invariant_linear` (kernels/invariant_matmul.py) and
`invariant_rms_norm` (kernels/invariant_norm.py) against their torch references, and — the point of
them — each output row bitwise the same whatever rows share the launch: alone, permuted, among
other rows, in another M tile, from a strided view. Under the interpreter on CPU (compiled on a
GPU): odd shapes, K loops of one and of several BLOCK_K steps, NaN-poisoned outputs. Also the
launch configuration (never a function of M), the argument checks, and the engine's wire-in
(`remask.kernels.batch_invariant`, exercised on CPU through the interpreter)."""
from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE
from remask.kernels.invariant_matmul import (BLOCK_M, invariant_linear, invariant_linear_config,
                                             invariant_linear_triton)
from remask.kernels.invariant_matmul_ref import LINEAR_TOLERANCE, invariant_linear_torch
from remask.kernels.invariant_norm import (NORM_CHUNK, invariant_rms_norm, invariant_rms_norm_block,
                                           invariant_rms_norm_triton)
from remask.kernels.invariant_norm_ref import NORM_TOLERANCE, rms_norm_torch

matmul_module = importlib.import_module("remask.kernels.invariant_matmul")
norm_module = importlib.import_module("remask.kernels.invariant_norm")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _linear_case(seed, M, K, N, dtype, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g) / K ** 0.5
    b = torch.randn(N, generator=g) if bias else None
    return [t.to(dtype).to(DEVICE) if t is not None else None for t in (x, w, b)]


def _assert_close(got, want, tolerance):
    rtol, atol = tolerance[want.dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    assert not got.isnan().any(), "an output was left unwritten (NaN-poisoned)"
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


# --- invariant_linear against the reference --------------------------------------------------------

# (M, K, N): 1–7 rows; K = 37 (one BLOCK_K step) and K > BLOCK_K (several, the last partial; float32
# takes BLOCK_K = 32: 200 → 7 steps); an even K (no K mask); two M tiles and two N tiles; K = 0.
LINEAR_SHAPES = [(1, 37, 45), (3, 37, 45), (7, 37, 45), (5, 200, 45), (3, 128, 17), (67, 130, 150), (2, 0, 9)]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M, K, N", LINEAR_SHAPES, ids=[f"M{m}-K{k}-N{n}" for m, k, n in LINEAR_SHAPES])
def test_linear_equals_reference(poisoned_outputs, M, K, N, dtype, bias):
    x, w, b = _linear_case(M * 1000 + K + N, M, K, N, dtype, bias)
    got = invariant_linear_triton(x, w, b)
    _assert_close(got, invariant_linear_torch(x, w, b), LINEAR_TOLERANCE)


def test_linear_strided_operands(poisoned_outputs):
    """Strided rows of x (a column slice of a wider tensor), a transposed weight, a strided bias."""
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(5, 80, generator=g).to(DEVICE)
    x = wide[:, 7:7 + 41]
    w = torch.randn(41, 33, generator=g).to(DEVICE).T          # [33, 41], stride (1, 33)
    b = torch.randn(66, generator=g).to(DEVICE)[::2]
    _assert_close(invariant_linear_triton(x, w, b), invariant_linear_torch(x, w, b), LINEAR_TOLERANCE)


def test_linear_reference_is_float32_linear():
    x, w, b = _linear_case(1, 4, 19, 11, torch.float32)
    torch.testing.assert_close(invariant_linear_torch(x, w, b), F.linear(x.double(), w.double(), b.double()).float())


# --- invariant_linear: bitwise row invariance -------------------------------------------------------

@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter's dot")
def test_the_interpreter_s_dot_computes_every_row_of_a_tile_alike():
    """What the bitwise tests below stand on under the interpreter: numpy's matmul (its `tl.dot`) gives a
    row the same bits wherever it sits in the tile (tests/conftest.py picks such OpenBLAS kernels)."""
    import numpy as np

    g = np.random.default_rng(0)
    a, b = g.standard_normal((BLOCK_M, 32)).astype(np.float32), g.standard_normal((32, 48)).astype(np.float32)
    full, alone = a @ b, np.zeros_like(a)
    for i in range(BLOCK_M):
        alone[0] = a[i]
        assert np.array_equal((alone @ b)[0], full[i]), f"row {i}: numpy's BLAS kernel depends on the row's place"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("K", [37, 200], ids=["K37", "K200"])
def test_linear_rows_are_bitwise_batch_invariant(poisoned_outputs, dtype, K):
    """70 rows (two M tiles of 64): each row computed alone, in a permuted batch, after 13 other rows
    (other tile positions and tiles), in a batch of 2, and from a strided view is bitwise the row of
    the full batch."""
    M, N = BLOCK_M + 6, 45
    x, w, b = _linear_case(K, M, K, N, dtype)
    full = invariant_linear_triton(x, w, b)
    for i in range(M):
        assert torch.equal(invariant_linear_triton(x[i:i + 1], w, b)[0], full[i]), i
    perm = torch.randperm(M, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    assert torch.equal(invariant_linear_triton(x[perm], w, b), full[perm])
    others = _linear_case(K + 1, 13, K, N, dtype)[0]
    mixed = invariant_linear_triton(torch.cat([others, x, others]), w, b)
    assert torch.equal(mixed[13:13 + M], full)
    assert torch.equal(mixed[:13], mixed[13 + M:])            # the same rows at other positions, other tiles
    for i in range(0, M - 1, 9):
        assert torch.equal(invariant_linear_triton(x[i:i + 2], w, b), full[i:i + 2])
    padded = torch.zeros(M, K + 5, dtype=dtype, device=DEVICE)
    padded[:, 3:3 + K] = x
    assert torch.equal(invariant_linear_triton(padded[:, 3:3 + K], w, b), full)


def test_linear_launch_does_not_depend_on_rows(monkeypatch):
    """What the kernel is launched with, apart from the pointers, M and the grid, is the same for
    every row count: the tile, K order (EVEN_K), warps and stages come from (N, K, dtype)."""
    seen = []

    class Record:
        def __getitem__(self, grid):
            return lambda *args, **meta: seen.append((grid, args, meta))

    monkeypatch.setattr(matmul_module, "invariant_linear_kernel", Record())
    for dtype in DTYPES:
        for N, K in ((45, 37), (4096, 4096), (126464, 4096), (512, 3584), (3584, 18944)):
            launches = []
            for M in (1, 2, 3, 16, 63, 64, 65, 256, 1000, 4097):
                seen.clear()
                w = torch.empty(1, 1, dtype=dtype).expand(N, K)       # shapes without the memory
                invariant_linear_triton(torch.empty(M, K, dtype=dtype), w, None)     # (never touched)
                (grid, args, meta), = seen
                assert grid == (-(-M // BLOCK_M) * -(-N // meta["BLOCK_N"]),)
                assert args[4] == M
                launches.append((args[5:], meta))
            assert all(launch == launches[0] for launch in launches), (N, K, dtype)
            assert launches[0][1] == {**invariant_linear_config(N, K, dtype), "HAS_BIAS": False,
                                      "LOW_PRECISION_DOT": dtype != torch.float32}   # not interpreted


def test_linear_config():
    for dtype in DTYPES:
        low = dtype != torch.float32
        cfg = invariant_linear_config(126464, 4096, dtype)
        assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]) == (64, 128, 64 if low else 32)
        assert cfg["EVEN_K"] and cfg["num_warps"] == (4 if low else 8)
        cfg = invariant_linear_config(9, 37, dtype)
        assert (cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["EVEN_K"]) == (16, 64 if low else 32, False)


def test_linear_rows_are_not_specialised():
    """The kernel is declared with M unspecialised, and the compiled-code gate honours it: the
    specialisation is the same for M = 1, 64 and 70 (one binary for every batch)."""
    from remask.kernels import aot

    kernel = matmul_module.invariant_linear_kernel
    assert "M" in (aot._jit_options(kernel).get("do_not_specialize") or [])
    w = torch.empty(4096, 4096, dtype=torch.bfloat16)
    specs = []
    for M in (1, 64, 70):
        with aot._recording("sm90") as log:
            matmul_module.invariant_linear_triton(torch.empty(M, 4096, dtype=torch.bfloat16), w, None)
        (name, fn, args, kwargs), = log
        specs.append(aot._specialise(fn, args, kwargs, "sm90"))
    assert specs[0] == specs[1] == specs[2]
    signature, constexprs, attrs, options = specs[0]
    assert signature["M"] == "i32" and "M" not in constexprs and "M" not in attrs
    assert constexprs["LOW_PRECISION_DOT"] is True     # the GPU's choice, whatever the interpreter does


def test_linear_empty():
    x, w, b = _linear_case(0, 0, 8, 5, torch.float32)
    assert invariant_linear_triton(x, w, b).shape == (0, 5)


def test_linear_dispatcher(monkeypatch):
    calls = []
    real = matmul_module.invariant_linear_triton
    monkeypatch.setattr(matmul_module, "invariant_linear_triton", lambda *a: calls.append(1) or real(*a))
    x, w, b = _linear_case(2, 3, 37, 45, torch.float32)
    monkeypatch.setenv("REMASK_TRITON", "0")
    assert torch.equal(invariant_linear(x, w, b), F.linear(x, w, b)) and not calls
    monkeypatch.setenv("REMASK_TRITON", "1")
    _assert_close(invariant_linear(x, w, b), invariant_linear_torch(x, w, b), LINEAR_TOLERANCE)
    assert calls == [1]


@pytest.mark.parametrize("fn", [invariant_linear, invariant_linear_triton], ids=["dispatcher", "launcher"])
@pytest.mark.parametrize("change, match", [
    (dict(x=torch.zeros(2, 3, 4)), "x must be a 2-D"),
    (dict(x=torch.zeros(4)), "x must be a 2-D"),
    (dict(weight=torch.zeros(5)), "weight must be a 2-D"),
    (dict(weight=torch.zeros(5, 7)), "weight has shape"),
    (dict(weight=torch.zeros(5, 4, dtype=torch.float16)), "weight dtype"),
    (dict(x=torch.zeros(2, 4, dtype=torch.float64), weight=torch.zeros(5, 4, dtype=torch.float64),
          bias=None), "x dtype"),
    (dict(bias=torch.zeros(6)), "bias must be"),
    (dict(bias=torch.zeros(5, 1)), "bias must be"),
    (dict(bias=torch.zeros(5, dtype=torch.bfloat16)), "bias dtype"),
])
def test_linear_bad_input_names_the_argument(fn, change, match):
    args = dict(x=torch.zeros(2, 4), weight=torch.zeros(5, 4), bias=torch.zeros(5))
    args.update(change)
    with pytest.raises(ValueError, match=match):
        fn(args["x"], args["weight"], args["bias"])


# --- invariant_rms_norm -----------------------------------------------------------------------------

NORM_SHAPES = [(1, 45), (3, 45), (7, 37), (3, 2 * NORM_CHUNK + 53), (2, 1)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M, D", NORM_SHAPES, ids=[f"M{m}-D{d}" for m, d in NORM_SHAPES])
def test_norm_equals_reference(poisoned_outputs, M, D, dtype):
    g = torch.Generator().manual_seed(M * 100 + D)
    x = (torch.randn(M, D, generator=g) * 3).to(dtype).to(DEVICE)
    w = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype).to(DEVICE)
    _assert_close(invariant_rms_norm_triton(x, w, 1e-6), rms_norm_torch(x, w, 1e-6), NORM_TOLERANCE)


def test_norm_reference_is_the_models_rmsnorm():
    from remask.models.layers import RMSNorm

    g = torch.Generator().manual_seed(1)
    for dtype in DTYPES:
        norm = RMSNorm(37, 1e-5).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(37, generator=g))
        x = torch.randn(4, 37, generator=g).to(dtype)
        with torch.no_grad():
            assert torch.equal(rms_norm_torch(x, norm.weight, 1e-5), norm(x))


def test_norm_strided_rows(poisoned_outputs):
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(4, 100, generator=g).to(DEVICE)
    x, w = wide[:, 5:5 + 61], torch.randn(61, generator=g).to(DEVICE)
    _assert_close(invariant_rms_norm_triton(x, w, 1e-5), rms_norm_torch(x, w, 1e-5), NORM_TOLERANCE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D", [37, NORM_CHUNK + 77], ids=["D37", "D1101"])
def test_norm_rows_are_bitwise_batch_invariant(poisoned_outputs, dtype, D):
    M = 9
    g = torch.Generator().manual_seed(D)
    x = (torch.randn(M, D, generator=g) * 2).to(dtype).to(DEVICE)
    w = torch.randn(D, generator=g).to(dtype).to(DEVICE)
    full = invariant_rms_norm_triton(x, w, 1e-6)
    for i in range(M):
        assert torch.equal(invariant_rms_norm_triton(x[i:i + 1], w, 1e-6)[0], full[i]), i
    perm = torch.randperm(M, generator=g).to(DEVICE)
    assert torch.equal(invariant_rms_norm_triton(x[perm], w, 1e-6), full[perm])
    mixed = invariant_rms_norm_triton(torch.cat([x[:4] * 5, x]), w, 1e-6)
    assert torch.equal(mixed[4:], full)


def test_norm_block_depends_on_the_width_only():
    assert invariant_rms_norm_block(4096) == invariant_rms_norm_block(3584) == NORM_CHUNK
    assert invariant_rms_norm_block(45) == 64 and invariant_rms_norm_block(1) == 1


def test_norm_dispatcher(monkeypatch):
    x, w = torch.randn(3, 45).to(DEVICE), torch.randn(45).to(DEVICE)
    monkeypatch.setenv("REMASK_TRITON", "0")
    assert torch.equal(invariant_rms_norm(x, w, 1e-6), rms_norm_torch(x, w, 1e-6))
    monkeypatch.setenv("REMASK_TRITON", "1")
    _assert_close(invariant_rms_norm(x, w, 1e-6), rms_norm_torch(x, w, 1e-6), NORM_TOLERANCE)


@pytest.mark.parametrize("fn", [invariant_rms_norm, invariant_rms_norm_triton], ids=["dispatcher", "launcher"])
@pytest.mark.parametrize("change, match", [
    (dict(x=torch.zeros(2, 3, 4)), "x must be a 2-D"),
    (dict(x=torch.zeros(4)), "x must be a 2-D"),
    (dict(x=torch.zeros(2, 4, dtype=torch.float64), weight=torch.zeros(4, dtype=torch.float64)), "x dtype"),
    (dict(weight=torch.zeros(5)), "weight must be"),
    (dict(weight=torch.zeros(4, 1)), "weight must be"),
    (dict(weight=torch.zeros(4, dtype=torch.float16)), "weight dtype"),
    (dict(eps=-1.0), "eps"),
    (dict(eps=None), "eps"),
])
def test_norm_bad_input_names_the_argument(fn, change, match):
    args = dict(x=torch.zeros(2, 4), weight=torch.zeros(4), eps=1e-6)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        fn(args["x"], args["weight"], args["eps"])


# --- the engine's wire-in ----------------------------------------------------------------------------

@pytest.fixture
def kernel_on_cpu(monkeypatch):
    """`batch_invariant`'s CUDA path, on CPU tensors too (the kernel under the interpreter); counts
    launches."""
    from remask.kernels import batch_invariant

    monkeypatch.setenv("REMASK_TRITON", "1")
    monkeypatch.setattr(batch_invariant, "_kernel_device", lambda x: True)
    calls = []
    real = matmul_module.invariant_linear_triton
    monkeypatch.setattr(matmul_module, "invariant_linear_triton", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    return calls


def test_wire_in_runs_one_launch_over_all_rows(kernel_on_cpu):
    from remask.kernels.batch_invariant import batch_invariant_linear

    x, w, b = _linear_case(4, 21, 37, 45, torch.float32)
    x3 = x.view(3, 7, 37)
    groups = [(3, torch.tensor([0, 1, 2, 9, 10, 11])), (5, torch.tensor([3, 4, 5, 6, 7, 12, 13, 14, 15, 16]))]
    with batch_invariant_linear():
        batched = F.linear(x3, w, b)
    with batch_invariant_linear(token_groups=groups):
        flat = F.linear(x[:17].unsqueeze(0), w, b)
    assert kernel_on_cpu == [21, 17]
    full = invariant_linear_triton(x, w, b)
    assert torch.equal(batched.reshape(21, 45), full) and torch.equal(flat[0], full[:17])


def test_wire_in_keeps_other_weights_per_sequence(kernel_on_cpu):
    from remask.kernels.batch_invariant import batch_invariant_linear

    class Sub(torch.Tensor):
        pass

    x, w, b = _linear_case(5, 6, 37, 45, torch.float32)
    with batch_invariant_linear():
        F.linear(x.view(2, 3, 37), w.as_subclass(Sub), b)
        F.linear(x.view(2, 3, 37).double(), w.double(), b.double())   # a dtype the kernel does not take
        F.linear(x.view(2, 3, 37), w.requires_grad_(), b)                # a forward recording gradients
        with torch.no_grad():
            F.linear(x.view(2, 3, 37), w, b)
    assert kernel_on_cpu == [6]


def test_wire_in_is_off_on_cpu(monkeypatch):
    """Without the CUDA predicate (CPU tensors) the mode keeps today's per-sequence GEMMs."""
    from remask.kernels.batch_invariant import batch_invariant_linear

    monkeypatch.setenv("REMASK_TRITON", "1")
    calls = []
    monkeypatch.setattr(matmul_module, "invariant_linear_triton", lambda *a: calls.append(1))
    x, w, b = (t.cpu() for t in _linear_case(6, 6, 37, 45, torch.float32))
    with batch_invariant_linear():
        y = F.linear(x.view(2, 3, 37), w, b)
    assert not calls and y.shape == (2, 3, 45)


@pytest.mark.skipif(DEVICE == "cuda", reason="the CPU model through the interpreter; on a GPU the other "
                    "ops' invariance is measured by bench/gpu_day.py's bitwise part")
def test_wire_in_model_forward_is_bitwise_the_forward_alone(kernel_on_cpu, load_model):
    """tiny LLaDA (vocabulary 300) through the kernel path: a batch's logits equal each sequence's
    forward alone (also in the mode), bit for bit, and the float32 forward without the mode within
    the kernel's tolerance."""
    from remask.kernels.batch_invariant import batch_invariant_linear

    model = load_model("llada_small")
    x = torch.randint(8, 290, (3, 5), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        with batch_invariant_linear():
            batched = model(x).logits
            n = len(kernel_on_cpu)
            alone = torch.cat([model(x[i:i + 1]).logits for i in range(3)])
        plain = model(x).logits
    assert n > 0 and set(kernel_on_cpu[:n]) == {15}        # every linear one launch over the 3 × 5 rows
    assert torch.equal(batched, alone)
    torch.testing.assert_close(batched, plain, rtol=1e-4, atol=1e-4)


def test_the_linear_seam_is_per_thread_nested_and_restored():
    """`batch_invariant_linear` replaces `F.linear` only while a thread is inside it (not a mode that sees every
    torch call): that thread's linears run per sequence (a batch's rows the bits of each alone), nested layouts
    restore the outer one, another thread's `F.linear` meanwhile is the plain one, and on leaving `F.linear` is
    torch's again. A handler inside another (DiffusionGemma's per-request split) hands its own calls to the outer
    one."""
    import threading

    from remask.kernels.batch_invariant import _PerSequenceLinear, batch_invariant_linear, linear_seam

    raw = F.linear
    g = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(5, 3, 37, generator=g), torch.randn(45, 37, generator=g), torch.randn(45, generator=g)
    alone = torch.cat([raw(x[i:i + 1], w, b) for i in range(5)])
    seen: dict[str, object] = {}

    def other_thread() -> None:
        seen["mode"] = linear_seam.handler()
        seen["y"] = F.linear(x, w, b)

    with batch_invariant_linear(single_thread=False) as outer:
        assert F.linear is not raw and isinstance(outer, _PerSequenceLinear)
        assert torch.equal(F.linear(x, w, b), alone)
        with batch_invariant_linear(single_thread=False, token_groups=[(3, torch.arange(3))]) as inner:
            assert linear_seam.handler() is inner
        assert linear_seam.handler() is outer
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    assert seen["mode"] is None and torch.equal(seen["y"], raw(x, w, b))
    assert F.linear is raw and linear_seam.handler() is None
    seen_inside: list[object] = []

    def tracing(*args):   # a handler's own call of the function runs the handler outside it
        seen_inside.append(linear_seam.handler())
        return F.linear(*args)
    with batch_invariant_linear(single_thread=False) as outer, linear_seam.active(tracing):
        assert torch.equal(F.linear(x, w, b), alone) and seen_inside == [outer]
    assert F.linear is raw

"""The attention kernels' MMA operand dtype (issue 31): bf16/fp16 q, k, v run q·kᵀ and p·v as 16-bit
MMAs with float32 accumulation on a GPU; float32 (or mixed) inputs get float32 dots (input_precision=
"ieee": FMAs, never TF32; tests/test_compiled_gate.py checks every compiled specialisation's SASS);
under the interpreter, whose bf16 tl.dot is wrong, bf16 falls back to float32 operands."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from remask.kernels import aot, paged, sparse_attention  # noqa: E402
from remask.kernels.dispatch import INTERPRETING  # noqa: E402


class _Launches:
    """Stands in for a compiled kernel (as on a GPU): records each launch's keyword arguments."""

    def __init__(self) -> None:
        self.kwargs: list[dict] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.kwargs.append(kwargs)


@pytest.fixture
def compiled(monkeypatch):
    """The attention launchers on their GPU path: kernels replaced by recorders, Triton dispatch forced."""
    launches = {"paged": _Launches(), "sparse": _Launches()}
    monkeypatch.setattr(paged, "paged_attention_kernel", launches["paged"])
    monkeypatch.setattr(paged, "use_triton", lambda *a, **k: True)
    monkeypatch.setattr(sparse_attention, "block_sparse_attention_kernel", launches["sparse"])
    return launches


def _paged_call(dtype, new_dtype=None, block_size=None):
    B, M, Hq, Hkv, D, page = 1, 32, 4, 2, 128, 32
    kc, vc = torch.zeros(8, page, Hkv, D, dtype=dtype), torch.zeros(8, page, Hkv, D, dtype=dtype)
    q = torch.zeros(B, M, Hq, D, dtype=dtype)
    new = torch.zeros(B, M, Hkv, D, dtype=new_dtype or dtype)
    paged.paged_attention(q, kc, vc, torch.zeros(B, 4, dtype=torch.int32), torch.tensor([100], dtype=torch.int32),
                          new, new.clone(), block_size=block_size)


def _sparse_call(dtype, kv_dtype=None):
    B, H, L, D, bs = 1, 2, 128, 128, 64
    q = torch.zeros(B, H, L, D, dtype=dtype)
    k = torch.zeros(B, H, L, D, dtype=kv_dtype or dtype)
    num = torch.ones(B, H, L // bs, dtype=torch.int32)
    idx = torch.zeros(B, H, L // bs, L // bs, dtype=torch.int32)
    sparse_attention.block_sparse_attention_triton(q, k, k.clone(), num, idx, q_block_size=bs, kv_block_size=bs)


@pytest.mark.parametrize("dtype,expected", [(torch.bfloat16, True), (torch.float16, True), (torch.float32, False)])
def test_gpu_launchers_pick_the_input_dtype_for_the_dots(compiled, dtype, expected):
    _paged_call(dtype)
    _paged_call(dtype, block_size=16)
    _sparse_call(dtype)
    launches = compiled["paged"].kwargs + compiled["sparse"].kwargs
    assert [kw["LOW_PRECISION_DOT"] for kw in launches] == [expected] * 3
    if not expected:      # float32 FMA dots hold float32 operand tiles: 8 warps (block-sparse: no prefetch)
        assert [kw["num_warps"] for kw in launches] == [8] * 3 and launches[2]["num_stages"] == 1


def test_mixed_dtypes_keep_float32_dots(compiled):
    _paged_call(torch.bfloat16, new_dtype=torch.float32)
    _sparse_call(torch.bfloat16, kv_dtype=torch.float16)
    assert [kw["LOW_PRECISION_DOT"] for kw in compiled["paged"].kwargs + compiled["sparse"].kwargs] == [False, False]


def test_the_gate_records_the_gpu_choice():
    """The compiled-code gate specialises the launchers as a GPU run would, even under the interpreter."""
    specs = {s.id: s for s in aot.specs_for("sm90")}
    for gate_id in ("paged_attention_kernel[sdar,D=128,page=32,M=32,sm90]",
                    "block_sparse_attention_kernel[sdar,D=128,block=64,sm90]"):
        assert specs[gate_id].signature["q_ptr"] == "*bf16"
        assert specs[gate_id].constexprs["LOW_PRECISION_DOT"] is True


@pytest.mark.skipif(not INTERPRETING, reason="the interpreter's fallback")
def test_interpreter_keeps_bf16_dots_in_float32():
    for kernel in (paged.paged_attention_kernel, sparse_attention.block_sparse_attention_kernel):
        assert paged.interpreted(kernel)
        bf16, fp16 = torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.float16)
        assert not paged.low_precision_dot(kernel, bf16, bf16, bf16)
        assert paged.low_precision_dot(kernel, fp16, fp16, fp16)      # its fp16 tl.dot is right


def _ptxas_available() -> bool:
    try:
        return os.access(aot._tool("ptxas"), os.X_OK)
    except Exception:  # noqa: BLE001 - no CUDA backend in this Triton
        return False


@pytest.mark.skipif(not _ptxas_available(), reason="needs Triton's ptxas")
def test_bf16_attention_compiles_to_bf16_mma_for_sm90():
    """One shipped bf16 specialisation compiled for sm_90 (a few seconds): BF16 MMAs only, no spills."""
    spec = next(s for s in aot.specs_for("sm90") if s.id == "block_sparse_attention_kernel[sdar,D=128,block=64,sm90]")
    result = aot.compile_one(spec)
    assert result["compiled"], result.get("error")
    kinds = result["mma_kinds"]
    assert kinds and all(kind.endswith(".BF16") for kind in kinds), kinds
    assert not any("TF32" in kind for kind in kinds), kinds
    assert result["spill_stores"] == 0 and result["spill_loads"] == 0, result

"""Select-and-commit: remask's unmask (one launch on GPU, vectorised torch on CPU) against the
reference per-row loop of `torch.topk` (LLaDA / Fast-dLLM `get_num_transfer_tokens` commit).

Each timed call reuses the same tensors; the committed positions stay committed, which changes
neither implementation's work (both rank the whole row)."""
from __future__ import annotations

import pytest
import torch

from conftest import DEVICE, run
from remask.kernels import unmask
from remask.kernels.unmask_ref import unmask_reference_loop

SHAPES = [(B, L) for B in (1, 8) for L in (32, 256, 1024, 4096)]


@pytest.mark.parametrize("impl", ["remask", "reference"])
@pytest.mark.parametrize("B, L", SHAPES, ids=[f"B{b}-L{l}" for b, l in SHAPES])
def test_unmask(benchmark, impl, B, L):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    conf = torch.rand(B, L, device=DEVICE, generator=g)
    mask = torch.rand(B, L, device=DEVICE, generator=g) < 0.5
    x = torch.zeros(B, L, dtype=torch.long, device=DEVICE)
    x0 = torch.ones(B, L, dtype=torch.long, device=DEVICE)
    k = torch.full((B,), max(1, L // 8), dtype=torch.long, device=DEVICE)
    if impl == "remask":
        fn = lambda: unmask(x, mask, x0, conf, k=k)  # noqa: E731
    else:
        fn = lambda: unmask_reference_loop(x, mask, x0, conf, k)  # noqa: E731
    run(benchmark, fn, rounds=50 if DEVICE.type == "cuda" else 20, group=f"unmask B{B} L{L}", kernel="unmask",
        impl=impl, baseline="reference", B=B, L=L)

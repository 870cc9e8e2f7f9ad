"""Select-and-commit: remask's unmask (one launch on GPU, vectorised torch on CPU) against the
reference per-row loop of `torch.topk` (LLaDA / Fast-dLLM `get_num_transfer_tokens` commit).

Each timed call reuses the same tensors; the committed positions stay committed, which changes
neither implementation's work (both rank the whole row)."""
from __future__ import annotations

import pytest
import torch

from conftest import DEVICE, ON_GPU, run
from remask.kernels import roofline, unmask
from remask.kernels.unmask import unmask_triton
from remask.kernels.unmask_ref import unmask_reference_loop, unmask_torch

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
    committed = int(torch.minimum(mask.sum(1), k).sum())   # the first call's; later calls commit fewer
    run(benchmark, fn, rounds=50 if DEVICE.type == "cuda" else 20, group=f"unmask B{B} L{L}", kernel="unmask",
        impl=impl, baseline="reference", B=B, L=L, cost=roofline.cost_unmask(B, L, conf.dtype, committed=committed))


@pytest.mark.parametrize("impl", ["count", "sort", "torch"])
@pytest.mark.parametrize("B", [1, 8])
def test_unmask_long_rows(benchmark, impl, B):
    """Whole-sequence steps (L = 2048): the kernel's counting path against its sort path, the torch
    reference (`unmask_torch`, what the dispatcher runs on CPU) as the baseline. On CPU "count" and
    "sort" also go through the dispatcher, i.e. run the torch reference: CPU numbers do not time the
    kernel (extra_info kernel_timed says which rows do); only GPU runs compare the two paths. Each
    call first restores the mask (a copy of B·L bytes in every impl), so every call commits L/8."""
    L = 2048
    g = torch.Generator(device=DEVICE).manual_seed(0)
    conf = torch.rand(B, L, device=DEVICE, generator=g)
    mask0 = torch.rand(B, L, device=DEVICE, generator=g) < 0.5
    mask = mask0.clone()
    x = torch.zeros(B, L, dtype=torch.long, device=DEVICE)
    x0 = torch.ones(B, L, dtype=torch.long, device=DEVICE)
    k = torch.full((B,), L // 8, dtype=torch.long, device=DEVICE)
    if impl == "torch":
        step = lambda: unmask_torch(x, mask, x0, conf, k=k)  # noqa: E731
    elif ON_GPU:
        step = lambda: unmask_triton(x, mask, x0, conf, k=k, path=impl)  # noqa: E731
    else:
        step = lambda: unmask(x, mask, x0, conf, k=k)  # noqa: E731  (the torch reference: no kernel on CPU)

    def fn():
        mask.copy_(mask0)
        return step()
    committed = int(torch.minimum(mask0.sum(1), k).sum())
    cost = roofline.cost_unmask(B, L, conf.dtype, committed=committed, path=None if impl == "torch" else impl)
    cost += roofline.Cost(2 * B * L)   # the mask restore: B·L bytes read and written
    run(benchmark, fn, rounds=50 if ON_GPU else 20, group=f"unmask long B{B} L{L}", kernel="unmask",
        impl=impl, baseline="torch", B=B, L=L, kernel_timed=ON_GPU and impl != "torch", cost=cost)

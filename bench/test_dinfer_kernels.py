"""dInfer's step: remask's kernels (`credit_confidence` + `dinfer_select`; their torch references
on CPU) against dInfer's formulation (softmax over `[B, L, V]`, fused logits materialised, then the
rule), the same math in the same run."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE, run
from remask.kernels import credit_confidence, dinfer_select, roofline

SHAPES = [(1, 32, 32768), (4, 32, 126464)]


def _dinfer_reference(logits, credit, masked, x):
    credit.mul_(0.8)
    top_p, top_i = F.softmax(logits.float(), dim=-1).max(dim=-1)
    credit.scatter_add_(2, top_i[..., None], (top_p.pow(0.2) * masked.float())[..., None])
    fused = logits + 0.7 * torch.log(credit + 1)
    p = F.softmax(fused.float(), dim=-1)
    conf, x0 = p.max(dim=-1)
    conf = torch.where(masked & (x0 != 0), conf, -torch.inf)
    bar = (conf.max(dim=1, keepdim=True).values - 1e-5).clamp(-1000, 0.9)
    return torch.where(conf >= bar, x0, x)


@pytest.mark.parametrize("impl", ["remask", "reference"])
@pytest.mark.parametrize("B, L, V", SHAPES, ids=[f"B{b}-L{l}-V{v}" for b, l, v in SHAPES])
def test_credit_step(benchmark, impl, B, L, V):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    logits = torch.randn(B, L, V, device=DEVICE, generator=g, dtype=torch.bfloat16 if DEVICE == "cuda" else torch.float32)
    credit = torch.zeros(B, L, V, device=DEVICE)
    x = torch.zeros(B, L, dtype=torch.long, device=DEVICE)
    masked = x == 0

    def remask_step():
        x0, conf = credit_confidence(logits, credit, masked, False, 0.7, 0.2, 0.8)
        return dinfer_select(x.clone(), x0, conf, 0, "threshold", 0.9)

    fn = remask_step if impl == "remask" else (lambda: _dinfer_reference(logits, credit, masked, x))
    cost = roofline.cost_credit_confidence(B, L, V, logits.dtype) + roofline.cost_dinfer_select(B, L, "threshold")
    run(benchmark, fn, group=f"dinfer credit step B{B} L{L} V{V}", kernel="dinfer", impl=impl,
        baseline="reference", B=B, L=L, V=V, cost=cost)

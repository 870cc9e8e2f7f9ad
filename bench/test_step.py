"""One sampler step after the forward pass, LLaDA-style: score, then commit the block's budget.

reference: LLaDA `generate.py` — argmax over the whole [B, T, V] logits, float64 softmax and
gather, confidence −inf outside the current block's masks, a per-row `torch.topk` loop.
remask: the fused confidence kernel over the block's rows only, then one unmask launch."""
from __future__ import annotations

import pytest
import torch

from conftest import CPU_MAX_ROWS, DEVICE, ON_GPU, run
from remask.kernels import confidence, roofline, unmask
from remask.kernels.confidence_ref import confidence_reference_formulation
from remask.kernels.unmask_ref import unmask_reference_loop

V, T, BLOCK, START = 126464, 256, 32, 128  # 256 positions, decoding the block at 128..160


def reference_step(logits, x, mask, k):
    B = x.shape[0]
    x0, p = confidence_reference_formulation(logits.reshape(B * T, V))
    x0, p = x0.view(B, T), p.view(B, T)
    block_mask = mask.clone()
    block_mask[:, :START] = False
    block_mask[:, START + BLOCK:] = False
    return unmask_reference_loop(x, block_mask, x0, p, k)


def remask_step(logits, x, mask, k):
    B = x.shape[0]
    rows = (torch.arange(B, device=DEVICE)[:, None] * T + torch.arange(START, START + BLOCK, device=DEVICE)).reshape(-1)
    x0, conf = confidence(logits.reshape(B * T, V), rows=rows)
    block_mask = mask[:, START:START + BLOCK].clone()
    return unmask(x[:, START:START + BLOCK], block_mask, x0.view(B, BLOCK), conf.view(B, BLOCK), k=k)


@pytest.mark.parametrize("impl", ["remask", "reference"])
@pytest.mark.parametrize("B", [1, 8])
def test_sampler_step(benchmark, impl, B):
    if not ON_GPU and B * T > CPU_MAX_ROWS:
        pytest.skip(f"CPU grid stops at {CPU_MAX_ROWS} rows (the float64 reference needs rows·V·16 bytes)")
    logits = torch.randn(B, T, V, device=DEVICE, dtype=torch.bfloat16)
    x = torch.zeros(B, T, dtype=torch.long, device=DEVICE)
    mask = torch.ones(B, T, dtype=torch.bool, device=DEVICE)
    k = torch.full((B,), 4, dtype=torch.long, device=DEVICE)
    step = remask_step if impl == "remask" else reference_step
    # The step's necessary work, whichever impl: score the block's B·32 rows (the others never read),
    # then commit k = 4 of each row's 32 (both impls compute the same tokens).
    cost = (roofline.cost_confidence(B * BLOCK, V, logits.dtype, row_index=True)
            + roofline.cost_unmask(B, BLOCK, torch.float32, committed=B * 4))
    run(benchmark, lambda: step(logits, x, mask, k), group=f"sampler step B{B} T{T} block{BLOCK}",
        kernel="step", impl=impl, baseline="reference", B=B, cost=cost)

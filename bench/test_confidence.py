"""Confidence scoring: remask (Triton on GPU, the float64 chunked torch path on CPU) against
(a) the reference formulation (LLaDA / Fast-dLLM: float64 softmax over [rows, V], gather) and
(b) the best plain-torch formulation (float32 logsumexp, argmax and gather: two reads of the logits).

Shapes: LLaDA (V = 126464) and Dream (V = 152064) vocabularies, B ∈ {1, 8} rows of N ∈ {32, 256,
1024} positions, bf16 logits. Effective bandwidth and the roofline (`remask.kernels.roofline`) count
the one necessary read of the logits and the x0 / conf writes.
"""
from __future__ import annotations

import pytest
import torch

from conftest import CPU_MAX_ROWS, DEVICE, ON_GPU, peak_extra_bytes, run
from remask.kernels import confidence, roofline
from remask.kernels.confidence_ref import confidence_reference_formulation, gumbel

VOCABS = {"llada": 126464, "dream": 152064}


def torch_best(logits: torch.Tensor, temperature: float = 0.0):
    """The fastest plain-torch way to the same result: float32, no float64, no [N, V] softmax."""
    l = logits.float()
    if temperature > 0:
        x0 = torch.argmax(l + temperature * gumbel(torch.rand_like(l)), dim=-1)
    else:
        x0 = torch.argmax(l, dim=-1)
    return x0, torch.exp(l.gather(-1, x0[:, None])[:, 0] - torch.logsumexp(l, dim=-1))


IMPLS = {
    "remask": lambda logits, T: confidence(logits, temperature=T, seed=0 if T > 0 else None),
    "reference": lambda logits, T: confidence_reference_formulation(logits, temperature=T),
    "torch_best": torch_best,
}

SHAPES = [(model, B, N, 0.0) for model in VOCABS for B in (1, 8) for N in (32, 256, 1024)]
SHAPES += [("llada", 1, 256, 1.0)]  # sampling: Philox in the kernel vs float64 torch noise


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("model, B, N, temperature", SHAPES,
                         ids=[f"{m}-B{b}-N{n}-T{t:g}" for m, b, n, t in SHAPES])
def test_confidence(benchmark, copy_bandwidth, impl, model, B, N, temperature):
    V, rows = VOCABS[model], B * N
    if not ON_GPU and rows > CPU_MAX_ROWS:
        pytest.skip(f"CPU grid stops at {CPU_MAX_ROWS} rows (the float64 reference needs rows·V·16 bytes)")
    logits = torch.randn(rows, V, device=DEVICE, dtype=torch.bfloat16)
    fn = IMPLS[impl]
    extra = peak_extra_bytes(lambda: fn(logits, temperature))
    run(benchmark, lambda: fn(logits, temperature), group=f"confidence {model} B{B} N{N} T{temperature:g}",
        kernel="confidence", impl=impl, baseline="reference", rows=rows, V=V,
        copy_bandwidth=copy_bandwidth, peak_extra_bytes=extra,
        cost=roofline.cost_confidence(rows, V, logits.dtype, temperature=temperature))

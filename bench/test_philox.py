"""Device-independent seeds (`remask.kernels.philox`): the Gumbel noise of a seeded sample over
`[B, V]` logits drawn from Triton's Philox stream in torch (what the CPU path computes so that it
matches the kernels bit for bit) against torch's own generator (`torch.rand` with a seeded
`torch.Generator`, whose draws differ between CPU and GPU) as the baseline. On a GPU the Triton
kernels draw the same stream inside their launch; this measures what the CPU pays for it."""
from __future__ import annotations

import pytest
import torch

from conftest import DEVICE, run
from remask.kernels import roofline
from remask.kernels.philox import grid_offsets, gumbel_from_uniform, philox_uniform

SHAPES = [(B, V) for B in (1, 8) for V in (32768, 126464)]


@pytest.mark.parametrize("impl", ["philox", "torch_generator"])
@pytest.mark.parametrize("B, V", SHAPES, ids=[f"B{b}-V{v}" for b, v in SHAPES])
def test_seeded_gumbel_noise(benchmark, impl, B, V):
    rows = torch.arange(B, device=DEVICE)
    cols = torch.arange(V, device=DEVICE)
    if impl == "philox":
        fn = lambda: gumbel_from_uniform(philox_uniform(1234, grid_offsets(rows, V, cols)))  # noqa: E731
    else:
        def fn():
            g = torch.Generator(device=DEVICE).manual_seed(1234)
            u = torch.rand(B, V, device=DEVICE, generator=g)
            return -torch.log(-torch.log(u))
    noise = fn()
    assert noise.shape == (B, V) and bool(torch.isfinite(noise).float().mean() > 0.99)
    # Roofline: B·V float32 written; Philox4x32-10 per draw (one word kept per counter, as tl.rand),
    # or per four draws (torch's generator keeps all four words).
    cost = roofline.cost_philox(B * V, draws_per_philox=1 if impl == "philox" else 4)
    run(benchmark, fn, rounds=20 if DEVICE.type == "cuda" else 5, group=f"seeded gumbel B{B} V{V}",
        kernel="philox", impl=impl, baseline="torch_generator", B=B, V=V, cost=cost)

"""APD's accept test: remask's fused `apd_accept` (Triton on GPU, the chunked float32 torch path on
CPU) against the reference formulation (danielmisrael/apd `apd_accept_criterion`: the mixture
`R·l_dLLM + (1 − R)·l_AR` built at `[N, V]` in the logits' dtype, argmax, compare, cumprod).

Shapes: Dream's 152 064-id dLLM logits against Qwen2.5's 151 936-id verifier logits (the shared
vocabulary is the verifier's), N ∈ {16, 100, 200} draft positions (APD's lookahead M is 100 or
200), bf16 logits. Effective bandwidth and the roofline (`remask.kernels.roofline`) count the one
necessary read of both logit rows over the shared vocabulary, the draft read and the target written.
"""
from __future__ import annotations

import pytest
import torch

from conftest import DEVICE, peak_extra_bytes, run
from remask.kernels import apd_accept, roofline

V_DLLM, V_AR = 152064, 151936
R = 0.7


def reference(draft, dllm_logits, verifier_logits):
    target = (R * dllm_logits[:, :V_AR] + (1 - R) * verifier_logits).argmax(-1)
    accept = draft == target
    accept[0] = True
    return target, torch.cumprod(accept.long(), dim=0).sum()


IMPLS = {
    "remask": lambda d, dl, vl: apd_accept(d, dl, vl, R),
    "reference": reference,
}


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("N", [16, 100, 200])
def test_accept(benchmark, copy_bandwidth, impl, N):
    g = torch.Generator(device=DEVICE).manual_seed(N)
    dllm_logits = torch.randn(N, V_DLLM, device=DEVICE, generator=g)
    verifier_logits = torch.randn(N, V_AR, device=DEVICE, generator=g)
    # Peaked rows, as a language model's: a clear winner, so bf16 rounding (the reference mixes in
    # bf16, remask in float32) cannot move the argmax and both give the same accepted length.
    winner = torch.randint(0, V_AR, (N, 1), device=DEVICE, generator=g)
    dllm_logits.scatter_add_(1, winner, torch.full((N, 1), 8.0, device=DEVICE))
    verifier_logits.scatter_add_(1, winner, torch.full((N, 1), 8.0, device=DEVICE))
    dllm_logits, verifier_logits = dllm_logits.to(torch.bfloat16), verifier_logits.to(torch.bfloat16)
    draft = reference(torch.zeros(N, dtype=torch.long, device=DEVICE), dllm_logits, verifier_logits)[0]
    draft[N // 2] = (draft[N // 2] + 1) % V_AR    # reject half-way, as a round of APD would
    want = reference(draft, dllm_logits, verifier_logits)
    fn = IMPLS[impl]
    got = fn(draft, dllm_logits, verifier_logits)
    assert int(got[1]) == int(want[1]) == N // 2
    extra = peak_extra_bytes(lambda: fn(draft, dllm_logits, verifier_logits))
    run(benchmark, lambda: fn(draft, dllm_logits, verifier_logits), group=f"apd accept N{N}", kernel="accept",
        impl=impl, baseline="reference", rows=N, V=V_AR, copy_bandwidth=copy_bandwidth, peak_extra_bytes=extra,
        cost=roofline.cost_accept(N, V_AR, dllm_logits.dtype, verifier_logits.dtype))

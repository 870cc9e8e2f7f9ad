"""Torch reference for APD's fused accept kernel: the CPU runtime and the oracle of tests and
benchmarks.

Same contract as `remask.kernels.accept.apd_accept_triton`: the mixture target
``argmax_v (R·l_dLLM[j, v] + (1 − R)·l_AR[j, v] + T·g[j, v])`` over the shared vocabulary
``v < vocab`` (float32, g = −log(−log u) only when T > 0), compared with the draft; the first draft
token is always accepted and the accepted length is the longest all-accepted prefix. The logits are
raw: adding a per-row constant (log-softmax normalisation) does not move an argmax.
"""
from __future__ import annotations

import torch

from .confidence_ref import CHUNK_ELEMENTS, gumbel


def apd_accept_torch(
    draft: torch.Tensor,
    dllm_logits: torch.Tensor,
    verifier_logits: torch.Tensor,
    mixture_weight: float,
    *,
    vocab: int,
    temperature: float = 0.0,
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (target `[N]` int64, accepted length: a 0-d int64 tensor, 1 ≤ n ≤ N when N > 0).

    Rows are processed a few at a time, so the float32 mixture never exists at `[N, V]`."""
    n_rows = draft.shape[0]
    target = torch.empty(n_rows, dtype=torch.long, device=draft.device)
    rows_per_chunk = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    for lo in range(0, n_rows, rows_per_chunk):
        hi = min(lo + rows_per_chunk, n_rows)
        mix = (mixture_weight * dllm_logits[lo:hi, :vocab].float()
               + (1 - mixture_weight) * verifier_logits[lo:hi, :vocab].float())
        if temperature > 0:
            mix = mix + temperature * gumbel(noise[lo:hi, :vocab].float())
        target[lo:hi] = torch.argmax(mix, dim=-1)
    accept = draft == target
    if n_rows:
        accept[0] = True
    return target, torch.cumprod(accept.long(), dim=0).sum()

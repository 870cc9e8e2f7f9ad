"""Torch reference for the confidence kernel: the CPU runtime and the oracle of tests and benchmarks.

Same contract as `remask.kernels.confidence.confidence_triton`, computed by the definition in
float64 (softmax, gather / top-2 / Σ p log p) a few rows at a time, so the extra memory is a few
float64 chunks of about `CHUNK_ELEMENTS` logits, never `[N, V]`.

Also holds the reference *formulation* (`confidence_reference_formulation`): how the LLaDA and
Fast-dLLM code compute the same quantity (float64 Gumbel score and softmax over the whole `[N, V]`
tensor, then a gather). Benchmarks use it as the baseline; tests check both agree.
"""
from __future__ import annotations

from typing import Sequence

import torch

CONFIDENCE_MODES = ("prob", "margin", "neg_entropy")
CHUNK_ELEMENTS = 1 << 19  # float64 logits per chunk: 4 MB (a few rows, cache-sized)


def gumbel(uniform: torch.Tensor) -> torch.Tensor:
    """Gumbel noise ``-log(-log u)`` (u in (0, 1))."""
    return -torch.log(-torch.log(uniform))


def id_tensor(ids: Sequence[int] | torch.Tensor | None, device) -> torch.Tensor | None:
    """Token ids as an int64 tensor on `device`, or None when there are none."""
    if ids is None:
        return None
    ids = torch.as_tensor(ids, dtype=torch.long, device=device).reshape(-1)
    return ids if ids.numel() else None


def confidence_torch(
    logits: torch.Tensor,
    *,
    temperature: float = 0.0,
    mode: str = "prob",
    rows: torch.Tensor | None = None,
    argmax_ids: Sequence[int] | torch.Tensor | None = None,
    softmax_ids: Sequence[int] | torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    seed: int | None = None,
    out_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x0 and its confidence for each selected row of `logits` `[N, V]`, in float64.

    x0 = argmax of ``l + T·g`` over the tokens not in `argmax_ids` (g: Gumbel noise from the
    uniforms `noise` `[N, V]`, or from a generator seeded with `seed`; plain argmax at T=0), the
    lowest index winning ties as `torch.argmax` does. The confidence of x0 is taken under the
    untempered softmax of `l` with the `softmax_ids` removed: ``prob`` p(x0), ``margin`` p1 − p2
    (the two largest probabilities), ``neg_entropy`` Σ p log p.

    Returns x0 (int64 `[R]`) and confidence (`out_dtype`, `[R]`), R = len(rows) or N.
    """
    n_rows, V = logits.shape
    device = logits.device
    if rows is not None:
        n_rows = rows.numel()
    x0 = torch.empty(n_rows, dtype=torch.long, device=device)
    conf = torch.empty(n_rows, dtype=torch.float64, device=device)
    argmax_ids = id_tensor(argmax_ids, device)
    softmax_ids = id_tensor(softmax_ids, device)
    sampling = temperature > 0
    generator = None
    if sampling and noise is None:
        generator = torch.Generator(device=device).manual_seed(int(seed))
    chunk = max(1, CHUNK_ELEMENTS // max(V, 1))
    for r0 in range(0, n_rows, chunk):
        index = slice(r0, min(r0 + chunk, n_rows)) if rows is None else rows[r0:r0 + chunk]
        l = logits[index].to(torch.float64)
        if sampling or argmax_ids is not None:
            score = l if argmax_ids is None else l.index_fill(1, argmax_ids, -torch.inf)
            if sampling:
                u = (noise[index].to(torch.float64) if noise is not None else
                     torch.rand(l.shape, dtype=torch.float64, device=device, generator=generator))
                score = score + temperature * gumbel(u)
            x0_chunk = torch.argmax(score, dim=1)
            del score
        else:
            x0_chunk = torch.max(l, dim=1).indices  # the first maximal index, like argmax (and faster)
        if softmax_ids is not None:
            l = l.index_fill(1, softmax_ids, -torch.inf)
        p = torch.softmax(l, dim=1)  # one fused pass per row; rows are cache-sized
        if mode == "prob":
            c = p.gather(1, x0_chunk[:, None])[:, 0]
        elif mode == "margin":
            top2 = torch.topk(p, min(2, V), dim=1).values
            c = top2[:, 0] - (top2[:, 1] if V > 1 else 0.0)
        else:
            c = torch.special.xlogy(p, p).sum(dim=1)
        x0[r0:r0 + len(x0_chunk)] = x0_chunk
        conf[r0:r0 + len(c)] = c
    return x0, conf.to(out_dtype)


def confidence_reference_formulation(
    logits: torch.Tensor, *, temperature: float = 0.0, noise: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The LLaDA / Fast-dLLM formulation, whole tensors in float64: x0 = argmax of
    ``exp(l) / (−log u)^T``, confidence = float64 softmax(l) gathered at x0 (mode ``prob``)."""
    logits64 = logits.to(torch.float64)
    if temperature > 0:
        if noise is None:
            noise = torch.rand(logits.shape, dtype=torch.float64, device=logits.device, generator=generator)
        scores = logits64.exp() / (-torch.log(noise.to(torch.float64))) ** temperature
    else:
        scores = logits
    x0 = torch.argmax(scores, dim=-1)
    p = torch.softmax(logits64, dim=-1)
    return x0, torch.gather(p, -1, x0[..., None])[..., 0]

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


# --- Vocabulary-parallel scoring (tensor parallel): per-shard partial state, then a combine -------
#
# A rank holding the logit columns [vocab_start, vocab_start + V_shard) of a vocabulary of
# `vocab_size` summarises each row in PARTIAL_FIELDS; the ranks exchange those few numbers per row
# (never the logits) and `combine_partials_torch` merges them in rank order, i.e. in ascending
# column order, so the lowest index still wins ties. The random draws are the unsharded call's.

PARTIAL_FIELDS = ("max", "sum_exp", "sum_exp_shift", "best_score", "best_logit", "second")
NO_INDEX = 2**31 - 1   # a shard with no candidate (every column removed) reports this index


def confidence_partials_torch(
    logits: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    temperature: float = 0.0,
    mode: str = "prob",
    rows: torch.Tensor | None = None,
    argmax_ids: Sequence[int] | torch.Tensor | None = None,
    softmax_ids: Sequence[int] | torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    seed: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The partial state of the shard `logits` `[N, V_shard]` (global columns from `vocab_start`).

    Returns part `[6, R, 1]` float64 (PARTIAL_FIELDS: max m and Σ e^(l−m), Σ e^(l−m)(l−m) of the
    softmax logits, the best selection score, the softmax logit at that token, the runner-up
    softmax logit) and part_idx `[R, 1]` int64 (the best token's global id). Ids are global;
    `noise` is the shard's columns of the uniforms; with `seed` the draws are `confidence_torch`'s
    over the whole vocabulary (same chunks, same generator), cut to the shard.
    """
    n_rows, V = logits.shape
    device = logits.device
    if rows is not None:
        n_rows = rows.numel()
    part = torch.empty((6, n_rows, 1), dtype=torch.float64, device=device)
    part_idx = torch.empty((n_rows, 1), dtype=torch.long, device=device)
    shard = slice(vocab_start, vocab_start + V)

    def local(ids):
        ids = id_tensor(ids, device)
        if ids is None:
            return None
        ids = ids[(ids >= vocab_start) & (ids < vocab_start + V)] - vocab_start
        return ids if ids.numel() else None

    argmax_ids, softmax_ids = local(argmax_ids), local(softmax_ids)
    sampling = temperature > 0
    generator = None
    if sampling and noise is None:
        generator = torch.Generator(device=device).manual_seed(int(seed))
    chunk = max(1, CHUNK_ELEMENTS // max(vocab_size, 1))   # the unsharded call's chunks: its draws
    neg_inf = torch.tensor(-torch.inf, dtype=torch.float64, device=device)
    for r0 in range(0, n_rows, chunk):
        index = slice(r0, min(r0 + chunk, n_rows)) if rows is None else rows[r0:r0 + chunk]
        l = logits[index].to(torch.float64)
        out = slice(r0, r0 + l.shape[0])
        score = l if argmax_ids is None else l.index_fill(1, argmax_ids, -torch.inf)
        if sampling:
            u = (noise[index].to(torch.float64) if noise is not None else torch.rand(
                (l.shape[0], vocab_size), dtype=torch.float64, device=device, generator=generator)[:, shard])
            score = score + temperature * gumbel(u)
        best, best_idx = torch.max(score, dim=1) if V else (neg_inf.expand(l.shape[0]), None)
        soft = l if softmax_ids is None else l.index_fill(1, softmax_ids, -torch.inf)
        if V:
            hit = best > -torch.inf
            part_idx[out, 0] = torch.where(hit, best_idx + vocab_start, NO_INDEX)
            part[4, out, 0] = torch.where(hit, soft.gather(1, best_idx[:, None])[:, 0], neg_inf)
            top = torch.topk(soft, min(2, V), dim=1).values
            m = top[:, 0]
            finite = m > -torch.inf
            shifted = soft - torch.where(finite, m, 0.0)[:, None]
            e = torch.exp(shifted)
            part[0, out, 0] = m
            part[1, out, 0] = e.sum(dim=1)
            part[2, out, 0] = torch.where(e > 0, e * shifted, 0.0).sum(dim=1)   # Σ e·(l − m)
            part[5, out, 0] = top[:, 1] if V > 1 else neg_inf
        else:   # an empty shard (more ranks than vocabulary chunks)
            part_idx[out, 0] = NO_INDEX
            part[:, out, 0] = torch.tensor([-torch.inf, 0.0, 0.0, -torch.inf, -torch.inf, -torch.inf],
                                           dtype=torch.float64, device=device)[:, None]
        part[3, out, 0] = best
    return part, part_idx


def combine_partials_torch(part: torch.Tensor, part_idx: torch.Tensor, mode: str = "prob",
                           out_dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial states `[6, R, S]` / `[R, S]` (S shards or splits in ascending column order)
    into x0 `[R]` int64 and its confidence `[R]`, as the unsharded call defines them."""
    part = part.to(torch.float64)
    m_j, s_j, t_j, best_j, logit_j, second_j = part
    best = best_j.max(dim=1, keepdim=True).values
    x0 = torch.where(best_j == best, part_idx.to(torch.long), NO_INDEX).min(dim=1).values
    x0_logit = torch.where(part_idx == x0[:, None], logit_j, -torch.inf).max(dim=1).values
    m = m_j.max(dim=1, keepdim=True).values
    live = s_j > 0
    dm = torch.where(live, m_j - m, 0.0)
    scale = torch.where(live, torch.exp(dm), 0.0)
    s = (s_j * scale).sum(dim=1)
    t = (scale * (t_j + dm * s_j)).sum(dim=1)
    m = m[:, 0]
    if mode == "prob":
        conf = torch.exp(x0_logit - m) / s
    elif mode == "margin":
        # The runner-up: the best of each shard's runner-up and of the shard maxima but one copy of m.
        first = torch.where(m_j == m[:, None], torch.arange(m_j.shape[1], device=m_j.device), m_j.shape[1])
        first = first.min(dim=1, keepdim=True).values
        others = m_j.masked_fill(torch.arange(m_j.shape[1], device=m_j.device) == first, -torch.inf)
        second = torch.maximum(second_j.max(dim=1).values, others.max(dim=1).values)
        conf = (1.0 - torch.exp(second - m)) / s
    else:
        conf = t / s - torch.log(s)
    return x0, conf.to(out_dtype)

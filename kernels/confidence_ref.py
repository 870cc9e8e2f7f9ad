"""Torch reference for the confidence kernel: the CPU runtime and the oracle of tests and benchmarks.

Same contract as `remask.kernels.confidence.confidence_triton`, computed by the definition in
float64 (softmax, gather / top-2 / Σ p log p) a few rows at a time, so the extra memory is a few
float64 chunks of about `CHUNK_ELEMENTS` logits, never `[N, V]`.

Seeded sampling (a `seed`, no injected `noise`) draws the kernel's own random numbers: Philox
(`remask.kernels.philox`, bit-identical to `tl.rand`) at the kernel's offsets ``row·vocab_size +
global column`` (row: the logits row), and forms the selection score as the kernel does, in
float32: ``l + T·g`` with the logits upcast to float32 and g the float32 Gumbel noise. A seed
therefore picks the same tokens on CPU and GPU, through torch or Triton (up to the last bit of the
kernels' float32 logs: see `philox.gumbel_from_uniform`). Injected `noise` keeps the float64 score.

Also holds the reference *formulation* (`confidence_reference_formulation`): how the LLaDA and
Fast-dLLM code compute the same quantity (float64 Gumbel score and softmax over the whole `[N, V]`
tensor, then a gather). Benchmarks use it as the baseline; tests check both agree.
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch

from .philox import grid_offsets, gumbel_from_uniform, philox_uniform

CONFIDENCE_MODES = ("prob", "margin", "neg_entropy")
CHUNK_ELEMENTS = 1 << 19  # float64 logits per chunk: 4 MB (a few rows, cache-sized)


def gumbel(uniform: torch.Tensor) -> torch.Tensor:
    """Gumbel noise ``-log(-log u)`` (u in (0, 1))."""
    return -torch.log(-torch.log(uniform))


def seeded_score(l32: torch.Tensor, temperature: float, seed: int, rows: torch.Tensor, row_width: int,
                 col_start: int = 0) -> torch.Tensor:
    """The kernels' seeded selection score ``l + T·g`` in float32 for the float32 logits `l32`
    `[R, C]` (already −inf where a token may not be chosen) of the logits rows `rows` `[R]`, whose
    columns are the global ids ``col_start + [0, C)`` of rows `row_width` wide: g from Philox at
    ``row·row_width + column``, T rounded to float32 as the kernel's argument is."""
    cols = torch.arange(col_start, col_start + l32.shape[1], dtype=torch.int64, device=l32.device)
    g = gumbel_from_uniform(philox_uniform(seed, grid_offsets(rows, row_width, cols)))
    t32 = torch.tensor(float(temperature), dtype=torch.float32, device=l32.device)
    return l32 + t32 * g   # two float32 roundings, the product first, as the kernel's l − T·c


def chunk_rows(index: slice | torch.Tensor, device) -> torch.Tensor:
    """The logits row ids of a chunk (a slice of rows or an index tensor) as int64 on `device`."""
    if isinstance(index, slice):
        return torch.arange(index.start, index.stop, dtype=torch.int64, device=device)
    return index.to(device=device, dtype=torch.int64)


def id_tensor(ids: Sequence[int] | torch.Tensor | None, device) -> torch.Tensor | None:
    """Token ids as an int64 tensor on `device`, or None when there are none."""
    if ids is None:
        return None
    if not isinstance(ids, torch.Tensor):   # a list of ids: the same few every decoding step
        return _ids_on(tuple(int(i) for i in ids), torch.device(device))
    ids = torch.as_tensor(ids, dtype=torch.long, device=device).reshape(-1)
    return ids if ids.numel() else None


@functools.lru_cache(maxsize=256)
def _ids_on(ids: tuple[int, ...], device: torch.device) -> torch.Tensor | None:
    """`ids` as an int64 tensor on `device`, made once (callers only read it)."""
    return torch.tensor(ids, dtype=torch.long, device=device) if ids else None


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
    uniforms `noise` `[N, V]`, in float64; or, with `seed`, the kernel's Philox draws at offset
    ``row·V + col`` and its float32 score, see the module docstring; plain argmax at T=0), the
    lowest index winning ties as `torch.argmax` does. The confidence of x0 is taken under the
    untempered softmax of `l` with the `softmax_ids` removed: ``prob`` p(x0), ``margin`` p1 − p2
    (the two largest probabilities), ``neg_entropy`` Σ p log p.

    Returns x0 (int64 `[R]`) and confidence (`out_dtype`, `[R]`), R = len(rows) or N.
    """
    n_rows, V = logits.shape
    device = logits.device
    if rows is not None:
        n_rows = rows.numel()
    argmax_ids = id_tensor(argmax_ids, device)
    softmax_ids = id_tensor(softmax_ids, device)
    chunk = max(1, CHUNK_ELEMENTS // max(V, 1))
    if n_rows <= chunk:   # one chunk (a decoding step's block): its results are the outputs
        x0, conf = _score_chunk(logits, slice(0, n_rows) if rows is None else rows, temperature, mode,
                                argmax_ids, softmax_ids, noise, seed)
        return x0, conf.to(out_dtype)
    x0 = torch.empty(n_rows, dtype=torch.long, device=device)
    conf = torch.empty(n_rows, dtype=torch.float64, device=device)
    for r0 in range(0, n_rows, chunk):
        index = slice(r0, min(r0 + chunk, n_rows)) if rows is None else rows[r0:r0 + chunk]
        x0_chunk, c = _score_chunk(logits, index, temperature, mode, argmax_ids, softmax_ids, noise, seed)
        x0[r0:r0 + len(x0_chunk)] = x0_chunk
        conf[r0:r0 + len(c)] = c
    return x0, conf.to(out_dtype)


def _score_chunk(logits: torch.Tensor, index: slice | torch.Tensor, temperature: float, mode: str,
                 argmax_ids: torch.Tensor | None, softmax_ids: torch.Tensor | None, noise: torch.Tensor | None,
                 seed: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`confidence_torch` on the logits rows `index` (a few, cache-sized): x0 and float64 confidence."""
    V = logits.shape[1]
    sampling = temperature > 0
    l = logits[index].to(torch.float64)
    if sampling and noise is None:   # the kernel's draws and float32 score (bf16/fp16 → fp32 is exact)
        l32 = logits[index].to(torch.float32)
        l32 = l32 if argmax_ids is None else l32.index_fill(1, argmax_ids, -torch.inf)
        x0 = torch.argmax(seeded_score(l32, temperature, int(seed), chunk_rows(index, logits.device), V), dim=1)
    elif sampling or argmax_ids is not None:
        score = l if argmax_ids is None else l.index_fill(1, argmax_ids, -torch.inf)
        if sampling:
            score = score + temperature * gumbel(noise[index].to(torch.float64))
        x0 = torch.argmax(score, dim=1)
        del score
    else:
        x0 = torch.max(l, dim=1).indices  # the first maximal index, like argmax (and faster)
    if softmax_ids is not None:
        l = l.index_fill(1, softmax_ids, -torch.inf)
    p = torch.softmax(l, dim=1)  # one fused pass per row; rows are cache-sized
    if mode == "prob":
        c = p.gather(1, x0[:, None])[:, 0]
    elif mode == "margin":
        top2 = torch.topk(p, min(2, V), dim=1).values
        c = top2[:, 0] - (top2[:, 1] if V > 1 else 0.0)
    else:
        c = torch.special.xlogy(p, p).sum(dim=1)
    return x0, c


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
    `noise` is the shard's columns of the uniforms (a float64 score); with `seed` the draws are
    Philox at the global offsets ``row·vocab_size + vocab_start + col``, the unsharded call's, and
    the best score is the kernel's float32 one (stored as float64, exactly).
    """
    n_rows, V = logits.shape
    device = logits.device
    if rows is not None:
        n_rows = rows.numel()
    part = torch.empty((6, n_rows, 1), dtype=torch.float64, device=device)
    part_idx = torch.empty((n_rows, 1), dtype=torch.long, device=device)

    def local(ids):
        ids = id_tensor(ids, device)
        if ids is None:
            return None
        ids = ids[(ids >= vocab_start) & (ids < vocab_start + V)] - vocab_start
        return ids if ids.numel() else None

    argmax_ids, softmax_ids = local(argmax_ids), local(softmax_ids)
    sampling = temperature > 0
    chunk = max(1, CHUNK_ELEMENTS // max(V, 1))
    neg_inf = torch.tensor(-torch.inf, dtype=torch.float64, device=device)
    for r0 in range(0, n_rows, chunk):
        index = slice(r0, min(r0 + chunk, n_rows)) if rows is None else rows[r0:r0 + chunk]
        l = logits[index].to(torch.float64)
        out = slice(r0, r0 + l.shape[0])
        if sampling and noise is None:   # the kernel's draws at global offsets, its float32 score
            l32 = logits[index].to(torch.float32)
            l32 = l32 if argmax_ids is None else l32.index_fill(1, argmax_ids, -torch.inf)
            score = seeded_score(l32, temperature, int(seed), chunk_rows(index, device), vocab_size,
                                 vocab_start).to(torch.float64)   # float32 → float64 is exact
        else:
            score = l if argmax_ids is None else l.index_fill(1, argmax_ids, -torch.inf)
            if sampling:
                score = score + temperature * gumbel(noise[index].to(torch.float64))
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

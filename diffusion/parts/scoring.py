"""Vocabulary-wide scoring, logits → (chosen token x0, its confidence), and the one implementation of filtering
and tempered categorical sampling (`filter_logits`, `sample_categorical`, tabled below).

* `score_rows` — the fused path (`remask.kernels.confidence`: Triton on CUDA, its float64 torch reference on CPU,
  no `[N, V]` intermediate) whenever the confidence is the untempered softmax's: greedy, and Gumbel-max with the
  kernel's own random stream.
* `score_tokens` — the references' formulations, reproduced exactly: ``sampler="gumbel"`` (LLaDA `generate.py`,
  Fast-dLLM: x0 = argmax of the float64 Gumbel-max score of the reference's torch noise, ``reference_rng=True``;
  the confidence from the **untempered** softmax) and ``sampler="categorical"`` (Dream `sample_tokens`: x0 drawn
  from, and the confidence from, the **tempered, filtered** probabilities, in their own dtype).
"""
from __future__ import annotations

import contextlib
from typing import Sequence

import torch
import torch.nn.functional as F

from remask.kernels import confidence
from remask.kernels.confidence import confidence_vocab_parallel
from remask.kernels.confidence_ref import CONFIDENCE_MODES
from remask.models.parallel import full_logits, vocab_shard

from .checks import check_choice


def draw_seed(generator: torch.Generator | None) -> int:
    """A seed for a kernel's own random stream, drawn from `generator` (torch's global one if None)."""
    device = generator.device if generator is not None else "cpu"
    return int(torch.randint(0, 2**31 - 1, (), device=device, generator=generator))


def score_rows(logits: torch.Tensor, rows: torch.Tensor | None = None, *, temperature: float = 0.0, mode: str = "prob",
               suppress_ids: Sequence[int] | None = None, zero_prob_ids: Sequence[int] | None = None,
               exclude_id: int | None = None, generator: torch.Generator | None = None,
               rows_in_bounds: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused scoring of `logits` `[..., V]` (flattened to `[N, V]`) at the flat positions `rows` (`rows_in_bounds`:
    built in range by the caller, not read back): x0 = argmax of the logits (T=0) or of ``l + T·g`` (Gumbel noise
    seeded from `generator`), confidence under the untempered softmax in float64 (Triton's values are
    float32-accurate). `exclude_id` (the mask token) is never chosen but keeps its mass; the other ids as in
    `score_tokens`. Vocabulary-sharded logits (a tensor-parallel LM head) are scored where they lie: the same tokens,
    never gathered."""
    seed = draw_seed(generator) if temperature > 0 else None
    kwargs = dict(temperature=temperature, mode=mode, rows=rows, suppress_ids=suppress_ids, seed=seed,
                  exclude_ids=None if exclude_id is None else [exclude_id], zero_prob_ids=zero_prob_ids,
                  out_dtype=torch.float64)
    shard = vocab_shard(logits)
    if shard is not None:
        local, vocab_start, vocab_size, group = shard
        return confidence_vocab_parallel(local.reshape(-1, local.shape[-1]), vocab_start=vocab_start,
                                         vocab_size=vocab_size, group=group, **kwargs)
    return confidence(logits.reshape(-1, logits.shape[-1]), rows_in_bounds=rows_in_bounds, **kwargs)


def gumbel_max_scores(logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None,
                      noise: torch.Tensor | None = None, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """LLaDA's float64 Gumbel-max score ``exp(l) / (-log u)^T`` (argmax: a sample of softmax(l/T)), `logits` at T=0;
    `noise`: injected uniforms, else drawn as the reference's ``torch.rand_like(..., dtype=float64)``. `dtype`: the
    score's and the draw's (DAEDAL's reference: float32)."""
    logits = full_logits(logits)
    if temperature == 0:
        return logits
    logits = logits.to(dtype)
    if noise is None:
        noise = torch.rand(logits.shape, dtype=dtype, device=logits.device, generator=generator)
    return logits.exp() / (-torch.log(noise)) ** temperature


# Filtering and tempered categorical sampling, the one implementation: every family's sampler is this code with its
# reference's flags (tests/test_sampling_once.py checks each against a direct torch formulation; the families'
# reference fixtures pin their tokens):
#
# ======================  ===========  ==========  ============  =======  ============  ============
# caller (reference)      filter order removed to  top-p on      greedy   draw          others
# ======================  ===========  ==========  ============  =======  ============  ============
# SDAR, LLaDA2            top_k→top_p  −inf        logits        filtered multinomial   flat
# Dream, APD (draft)      top_p→top_k  dtype min   logits        filtered multinomial*  renormalized
# Fast-dLLM v2            top_p only   —           probabilities raw      multinomial   per batch row
# ======================  ===========  ==========  ============  =======  ============  ============
#
# (* APD's draft: `gumbel_max_scores` over the filtered logits.) Shared, so no flag: temperature first (T = 1
# divides too, exactly); top-k keeps ties with the k-th; top-p keeps the token crossing `top_p` (the most probable
# always); top_k None or ≤ 0 and, on logits, top_p None or ≥ 1 are off (Dream/APD refuse top_k 0 at validation,
# SDAR means "off" by it); a top_k above V keeps all. Why each flag:
# * `order`: SDAR's/LLaDA2's `generate.py` filter top-k, then top-p over the renormalized survivors; Dream's
#   `sample_tokens` (and APD, its copy) the reverse: they differ when both are set.
# * `removed`: SDAR/LLaDA2 write −inf, Dream/APD transformers' `torch.finfo(dtype).min`: the same probabilities,
#   other filtered logits (APD's draft and the kernels' tests read them).
# * `top_p_on="probs"`: Fast-dLLM v2's `sample_with_top_p` zeroes what is outside the nucleus of softmax(logits / T)
#   and divides by the kept mass (other float sums than a softmax of masked logits), even at top_p = 1 (the
#   cumulative sum can pass 1 by an ulp; the division changes bits).
# * `filter_greedy`: at T = 0 SDAR/LLaDA2 still filter; Fast-dLLM v2 takes the raw softmax.
# * `per_row`: Fast-dLLM v2 draws once per batch row, SDAR/LLaDA2 once over all rows: torch's CPU draw takes one
#   seed per call, so they spend the generator differently.
# * `renormalize`: Dream samples `Categorical(probs)`, which divides by the row sum first.

FILTER_ORDERS = ("top_k_first", "top_p_first")
REMOVED = ("-inf", "dtype_min")
TOP_P_ON = ("logits", "probs")


def _removed_value(logits: torch.Tensor, removed: str) -> float:
    check_choice("removed", removed, REMOVED)
    return float("-inf") if removed == "-inf" else torch.finfo(logits.dtype).min


def top_k_filter(logits: torch.Tensor, top_k: int | None, *, removed: str = "-inf") -> torch.Tensor:
    """Keep each row's `top_k` largest logits (and ties), the rest set to `removed`; None, ≤ 0 or ≥ V: off."""
    if top_k is None or top_k <= 0:
        return logits
    top_k = min(top_k, logits.size(-1))
    kth = torch.topk(logits, top_k).values[..., -1, None]
    return logits.masked_fill(logits < kth, _removed_value(logits, removed))


def top_p_filter(logits: torch.Tensor, top_p: float | None, *, removed: str = "-inf") -> torch.Tensor:
    """Keep the fewest most probable tokens whose mass exceeds `top_p`, the rest set to `removed`; None or ≥ 1: off."""
    if top_p is None or top_p >= 1:
        return logits
    sorted_logits, sorted_idx = torch.sort(logits, descending=True)
    outside = _outside_nucleus(F.softmax(sorted_logits, dim=-1), sorted_idx, top_p)
    return logits.masked_fill(outside, _removed_value(logits, removed))


def top_p_probs(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Fast-dLLM v2's nucleus: zero the probabilities outside the `top_p` mass, divide by the kept mass (any top_p)."""
    sorted_probs, sorted_idx = torch.sort(probs, descending=True)
    probs = probs.masked_fill(_outside_nucleus(sorted_probs, sorted_idx, top_p), 0)
    return probs / torch.sum(probs, dim=-1, keepdim=True)


def _outside_nucleus(sorted_probs: torch.Tensor, sorted_idx: torch.Tensor, top_p: float) -> torch.Tensor:
    """Bool mask (in the unsorted order `sorted_idx` came from) of the tokens after the one whose cumulative
    probability crosses `top_p` (the most probable is always kept)."""
    remove = torch.cumsum(sorted_probs, dim=-1) > top_p
    remove[..., 1:] = remove[..., :-1].clone()
    remove[..., 0] = False
    return torch.zeros_like(remove).scatter_(-1, sorted_idx, remove)


def filter_logits(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                  top_p: float | None = None, *, order: str = "top_k_first", removed: str = "-inf") -> torch.Tensor:
    """``logits / T`` (T > 0), then top-k and top-p in `order`, removed tokens set to `removed` (table above)."""
    check_choice("order", order, FILTER_ORDERS)
    _removed_value(logits, removed)
    logits = full_logits(logits)   # top-p sorts whole rows
    if temperature > 0:
        logits = logits / temperature
    if order == "top_k_first":
        return top_p_filter(top_k_filter(logits, top_k, removed=removed), top_p, removed=removed)
    return top_k_filter(top_p_filter(logits, top_p, removed=removed), top_k, removed=removed)


def draw_categorical(probs: torch.Tensor, generator: torch.Generator | None = None, *, per_row: bool = False,
                     renormalize: bool = False) -> torch.Tensor:
    """One `torch.multinomial` draw per row of `probs` `[..., V]` → `[...]`. `per_row`: one call per index of the
    leading axis, else one over all rows; `renormalize`: divide by the row sums first."""
    if per_row:
        return torch.stack([draw_categorical(row, generator, renormalize=renormalize) for row in probs])
    flat = probs.reshape(-1, probs.shape[-1])
    if renormalize:
        flat = flat / flat.sum(-1, keepdim=True)
    return torch.multinomial(flat, 1, True, generator=generator).reshape(probs.shape[:-1])


def sample_categorical(logits: torch.Tensor, temperature: float, top_k: int | None = None,
                       top_p: float | None = None, *, generator: torch.Generator | None = None,
                       exclude_id: int | None = None, order: str = "top_k_first", removed: str = "-inf",
                       top_p_on: str = "logits", filter_greedy: bool = True, per_row: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, their probabilities, the distributions `[..., V]`): the tempered, filtered softmax, then a draw (T >
    0) or the argmax; where `exclude_id` (the mask token) is drawn, the most probable other token instead. Defaults
    are SDAR's / LLaDA2's; the flags are tabled above."""
    check_choice("top_p_on", top_p_on, TOP_P_ON)
    greedy = temperature <= 0
    if greedy and not filter_greedy:
        probs = F.softmax(full_logits(logits), dim=-1)
    elif top_p_on == "probs":
        probs = F.softmax(filter_logits(logits, temperature, top_k, None, order=order, removed=removed), dim=-1)
        if top_p is not None:
            probs = top_p_probs(probs, top_p)
    else:
        probs = F.softmax(filter_logits(logits, temperature, top_k, top_p, order=order, removed=removed), dim=-1)
    tokens = probs.argmax(dim=-1) if greedy else draw_categorical(probs, generator, per_row=per_row)
    tokens = avoid_id(tokens, probs, exclude_id)
    return tokens, torch.gather(probs, -1, tokens.unsqueeze(-1)).squeeze(-1), probs


def _confidence_from_probs(probs: torch.Tensor, x0: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "prob":
        return torch.gather(probs, -1, x0.unsqueeze(-1)).squeeze(-1)
    if mode == "margin":
        top2 = torch.topk(probs, 2, dim=-1).values if probs.shape[-1] > 1 else torch.cat(
            [probs, torch.zeros_like(probs)], -1)
        return top2[..., 0] - top2[..., 1]
    return torch.sum(probs * torch.log(probs + 1e-10), dim=-1)  # neg_entropy, Dream's epsilon


def score_tokens(logits: torch.Tensor, *, temperature: float = 0.0, mode: str = "prob", sampler: str = "gumbel",
                 top_p: float | None = None, top_k: int | None = None, suppress_ids: Sequence[int] | None = None,
                 zero_prob_ids: Sequence[int] | None = None, softmax_dtype: torch.dtype | None = None,
                 exclude_id: int | None = None, generator: torch.Generator | None = None,
                 noise: torch.Tensor | None = None, noise_dtype: torch.dtype = torch.float64
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x0 (int64) and its confidence per row of `logits` `[..., V]` (module docstring). `mode`: ``"prob"`` (p(x0)),
    ``"margin"`` (p1 − p2), ``"neg_entropy"`` (Σ p log p); `top_p`/`top_k`: the categorical sampler's. `suppress_ids`:
    −inf logits first (``logits_eos_inf``); `zero_prob_ids`: −inf *after* the argmax, before the confidence softmax
    (LLaDA's ``confidence_eos_eot_inf`` as implemented). `softmax_dtype`: the gumbel confidence's (None: the logits',
    as LLaDA; Fast-dLLM: float64). `exclude_id` (the mask token) is replaced only where the reference would choose it,
    by the best other token (the noisy runner-up / the most probable other) with its confidence: all else is the
    reference's, bit for bit. `noise` injects the Gumbel uniforms; `noise_dtype`: the Gumbel score's dtype."""
    check_choice("mode", mode, CONFIDENCE_MODES)
    # The reference formulations need whole rows (their noise is drawn over [.., V]): gathered here.
    logits = full_logits(logits)
    if suppress_ids:
        logits = logits.clone()
        logits[..., list(suppress_ids)] = -torch.inf
    if sampler == "gumbel":
        if top_p is not None or top_k is not None:
            raise ValueError("top_p/top_k apply to sampler='categorical' only")
        scores = gumbel_max_scores(logits, temperature, generator, noise, noise_dtype)
        x0 = avoid_id(torch.argmax(scores, dim=-1), scores, exclude_id)
        if zero_prob_ids:
            logits = logits.clone()
            logits[..., list(zero_prob_ids)] = -torch.inf
        probs = F.softmax(logits if softmax_dtype is None else logits.to(softmax_dtype), dim=-1)
        return x0, _confidence_from_probs(probs, x0, mode)
    if sampler != "categorical":
        raise ValueError(f"sampler must be 'gumbel' or 'categorical', got {sampler!r}")
    logits = filter_logits(logits, temperature, top_k, top_p, order="top_p_first", removed="dtype_min")
    probs = torch.softmax(logits, dim=-1)
    x0 = None
    if temperature > 0:   # the reference falls back to the argmax when sampling fails (a RuntimeError)
        with contextlib.suppress(RuntimeError):   # Categorical(probs).sample(), spelled out to take a generator
            x0 = draw_categorical(probs, generator, renormalize=True)
    if x0 is None:
        conf, x0 = probs.max(dim=-1)
        if mode == "prob" and (exclude_id is None or not bool((x0 == exclude_id).any())):
            return x0, conf
    x0 = avoid_id(x0, probs, exclude_id)
    return x0, _confidence_from_probs(probs, x0, mode)


def avoid_id(x0: torch.Tensor, scores: torch.Tensor, exclude_id: int | None) -> torch.Tensor:
    """Replace `exclude_id` in x0 by the highest-scoring other token (untouched rows stay as they are)."""
    if exclude_id is None:
        return x0
    hit = x0 == exclude_id
    if not bool(hit.any()):
        return x0
    masked = scores[hit].clone()
    masked[..., exclude_id] = -torch.inf
    x0 = x0.clone()
    x0[hit] = torch.argmax(masked, dim=-1)
    return x0

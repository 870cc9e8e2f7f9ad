"""Vocabulary-wide scoring: logits → (chosen token x0, its confidence).

Two entry points, and nothing else in `remask.diffusion` touches the vocabulary axis:

* `score_rows` — the fused path: `remask.kernels.confidence` (Triton on CUDA, its float64 torch
  reference on CPU) over selected rows, no `[N, V]` intermediate. Samplers use it whenever the
  confidence is the untempered softmax's: greedy decoding, and Gumbel-max sampling with the
  kernel's own random stream.
* `score_tokens` — the reference formulations, kept for what the kernel does not cover: sampling
  with the reference's float64 torch noise (``reference_rng=True``, bit-exact reproduction of a
  seeded reference run) and Dream's categorical sampling (tempered, top-p/top-k filtered
  confidences).

Two sampling conventions exist in the references and both are reproduced exactly:

* ``sampler="gumbel"`` (LLaDA `generate.py`, Fast-dLLM): x0 = argmax of the float64 Gumbel-max
  score ``exp(l) / (-log u)^T`` (plain argmax at T=0); the confidence is taken from the
  **untempered** softmax of the logits, in ``softmax_dtype`` (LLaDA: the logits' dtype,
  Fast-dLLM: float64).
* ``sampler="categorical"`` (Dream `sample_tokens`): logits are divided by T, filtered by top-p
  and top-k, turned into probabilities in their own dtype, and x0 is drawn from them
  (max at T=0); the confidence is computed from those **tempered, filtered** probabilities.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from remask.kernels import confidence
from remask.kernels.confidence import confidence_vocab_parallel
from remask.kernels.confidence_ref import CONFIDENCE_MODES
from remask.models.parallel import full_logits, vocab_shard


def draw_seed(generator: torch.Generator | None) -> int:
    """A seed for a kernel's own random stream, drawn from `generator` (torch's global one if None)."""
    device = generator.device if generator is not None else "cpu"
    return int(torch.randint(0, 2**31 - 1, (), device=device, generator=generator))


def score_rows(
    logits: torch.Tensor,
    rows: torch.Tensor | None = None,
    *,
    temperature: float = 0.0,
    mode: str = "prob",
    suppress_ids: Sequence[int] | None = None,
    zero_prob_ids: Sequence[int] | None = None,
    exclude_id: int | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused scoring of `logits` `[..., V]` (flattened to `[N, V]`) at the flat positions `rows`.

    x0 = argmax of the logits (T=0) or of ``l + T·g`` with Gumbel noise seeded from `generator`;
    confidence under the untempered softmax, float64 (the torch path's precision; the Triton
    kernel's values are float32-accurate). `exclude_id` (the mask token) is never chosen but
    keeps its probability mass; `suppress_ids` are −inf logits; `zero_prob_ids` leave only the
    softmax (see `score_tokens`).

    Logits sharded on the vocabulary (a tensor-parallel LM head, `models/parallel.py`) are scored
    where they lie: each rank its columns, the ranks combining a few numbers per row — the same
    tokens as one process, and full logits are never gathered.
    """
    seed = draw_seed(generator) if temperature > 0 else None
    kwargs = dict(temperature=temperature, mode=mode, rows=rows, suppress_ids=suppress_ids, seed=seed,
                  exclude_ids=None if exclude_id is None else [exclude_id], zero_prob_ids=zero_prob_ids,
                  out_dtype=torch.float64)
    shard = vocab_shard(logits)
    if shard is not None:
        local, vocab_start, vocab_size, group = shard
        return confidence_vocab_parallel(local.reshape(-1, local.shape[-1]), vocab_start=vocab_start,
                                         vocab_size=vocab_size, group=group, **kwargs)
    return confidence(logits.reshape(-1, logits.shape[-1]), **kwargs)


def gumbel_max_scores(logits: torch.Tensor, temperature: float, generator: torch.Generator | None = None,
                      noise: torch.Tensor | None = None) -> torch.Tensor:
    """LLaDA's float64 Gumbel-max score ``exp(l) / (-log u)^T`` (argmax = a sample of softmax(l/T)).

    Returns `logits` itself at T=0. `noise` (uniforms in (0, 1), float64, logits' shape) may be
    injected; otherwise it is drawn like the reference's ``torch.rand_like(..., dtype=float64)``.
    """
    logits = full_logits(logits)
    if temperature == 0:
        return logits
    logits = logits.to(torch.float64)
    if noise is None:
        noise = torch.rand(logits.shape, dtype=torch.float64, device=logits.device, generator=generator)
    return logits.exp() / (-torch.log(noise)) ** temperature


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability mass exceeds `top_p` (Dream's rule: the
    token that crosses the threshold is kept; removed tokens get the dtype's minimum)."""
    sorted_logits, sorted_idx = torch.sort(logits, descending=True)
    cumulative = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)
    remove = cumulative > top_p
    remove[..., 1:] = remove[..., :-1].clone()
    remove[..., 0] = False
    mask = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, sorted_idx, remove)
    return logits.masked_fill(mask, torch.finfo(logits.dtype).min)


def top_k_filter(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    top_k = min(top_k, logits.size(-1))
    kth = torch.topk(logits, top_k)[0][..., -1, None]
    return logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min)


def tempered_filtered(logits: torch.Tensor, temperature: float, top_p: float | None,
                      top_k: int | None) -> torch.Tensor:
    """Dream's (and APD's) preprocessing: logits / T (T > 0), then top-p, then top-k."""
    logits = full_logits(logits)   # top-p sorts whole rows
    if temperature > 0:
        logits = logits / temperature
    if top_p is not None and top_p < 1:
        logits = top_p_filter(logits, top_p)
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    return logits


def _confidence_from_probs(probs: torch.Tensor, x0: torch.Tensor, mode: str) -> torch.Tensor:
    if mode == "prob":
        return torch.gather(probs, -1, x0.unsqueeze(-1)).squeeze(-1)
    if mode == "margin":
        top2 = torch.topk(probs, 2, dim=-1).values if probs.shape[-1] > 1 else torch.cat(
            [probs, torch.zeros_like(probs)], -1)
        return top2[..., 0] - top2[..., 1]
    return torch.sum(probs * torch.log(probs + 1e-10), dim=-1)  # neg_entropy, Dream's epsilon


def score_tokens(
    logits: torch.Tensor,
    *,
    temperature: float = 0.0,
    mode: str = "prob",
    sampler: str = "gumbel",
    top_p: float | None = None,
    top_k: int | None = None,
    suppress_ids: Sequence[int] | None = None,
    zero_prob_ids: Sequence[int] | None = None,
    softmax_dtype: torch.dtype | None = None,
    exclude_id: int | None = None,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose a token per row of `logits` `[..., V]` and score it.

    Args:
        temperature: 0 for greedy; >0 samples (Gumbel-max or categorical, see module docstring).
        mode: confidence of x0 — ``"prob"`` (p(x0)), ``"margin"`` (p1 − p2), ``"neg_entropy"`` (Σ p log p).
        sampler: ``"gumbel"`` (LLaDA/Fast-dLLM) or ``"categorical"`` (Dream).
        top_p, top_k: Dream's filters (categorical sampler only).
        suppress_ids: token ids whose logits are set to −inf before anything else (``logits_eos_inf``).
        zero_prob_ids: token ids whose logits are set to −inf *after* the argmax and before the
            confidence softmax (LLaDA's ``confidence_eos_eot_inf`` as implemented).
        softmax_dtype: dtype of the confidence softmax for the gumbel sampler (None: logits' dtype).
        exclude_id: a token that must never be chosen (the mask token). Only where the reference
            would choose it is x0 replaced, by the best other token (Gumbel: the noisy scores'
            runner-up, i.e. a sample without it; categorical: the most probable other token), with
            that token's confidence. Everywhere else the result is the reference's, bit for bit.
        generator / noise: randomness source; `noise` injects the Gumbel uniforms.

    Returns:
        x0 (int64, `[...]`) and confidence (`[...]`, float).
    """
    if mode not in CONFIDENCE_MODES:
        raise ValueError(f"mode must be one of {list(CONFIDENCE_MODES)}, got {mode!r}")
    # The reference formulations need whole rows (their noise is drawn over [.., V]): gathered here.
    logits = full_logits(logits)
    if suppress_ids:
        logits = logits.clone()
        logits[..., list(suppress_ids)] = -torch.inf
    if sampler == "gumbel":
        if top_p is not None or top_k is not None:
            raise ValueError("top_p/top_k apply to sampler='categorical' only")
        scores = gumbel_max_scores(logits, temperature, generator, noise)
        x0 = _avoid(torch.argmax(scores, dim=-1), scores, exclude_id)
        if zero_prob_ids:
            logits = logits.clone()
            logits[..., list(zero_prob_ids)] = -torch.inf
        probs = F.softmax(logits if softmax_dtype is None else logits.to(softmax_dtype), dim=-1)
        return x0, _confidence_from_probs(probs, x0, mode)
    if sampler != "categorical":
        raise ValueError(f"sampler must be 'gumbel' or 'categorical', got {sampler!r}")
    logits = tempered_filtered(logits, temperature, top_p, top_k)
    probs = torch.softmax(logits, dim=-1)
    x0 = None
    if temperature > 0:
        # torch.distributions.Categorical(probs).sample(), spelled out so a generator can be passed.
        flat = probs.reshape(-1, probs.shape[-1])
        flat = flat / flat.sum(-1, keepdim=True)
        try:
            x0 = torch.multinomial(flat, 1, True, generator=generator).reshape(probs.shape[:-1])
        except RuntimeError:  # the reference falls back to the argmax when sampling fails
            x0 = None
    if x0 is None:
        conf, x0 = probs.max(dim=-1)
        if mode == "prob" and (exclude_id is None or not bool((x0 == exclude_id).any())):
            return x0, conf
    x0 = _avoid(x0, probs, exclude_id)
    return x0, _confidence_from_probs(probs, x0, mode)


def _avoid(x0: torch.Tensor, scores: torch.Tensor, exclude_id: int | None) -> torch.Tensor:
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

"""LLaDA's schedule and the reference scoring formulations (the selection rules are tested with the
unmask kernel, tests/test_kernel_unmask.py)."""
from __future__ import annotations

import math

import pytest
import torch

from remask.diffusion.parts.scoring import score_tokens
from remask.diffusion.parts.selection import schedule_counts


def test_schedule_is_llada_integer_schedule():
    mask = torch.zeros(3, 10, dtype=torch.bool)
    mask[0, :10] = True
    mask[1, :7] = True
    counts = schedule_counts(mask, 4)
    assert counts.tolist() == [[3, 3, 2, 2], [2, 2, 2, 1], [0, 0, 0, 0]]
    assert counts.dtype == torch.int64


def test_gumbel_scoring_greedy_and_confidence():
    logits = torch.randn(4, 7, 50, generator=torch.Generator().manual_seed(3))
    x0, conf = score_tokens(logits)
    assert torch.equal(x0, logits.argmax(-1))
    torch.testing.assert_close(conf, logits.softmax(-1).max(-1).values)
    x0, conf = score_tokens(logits, suppress_ids=[int(x0[0, 0])])
    assert int(x0[0, 0]) != int(logits[0, 0].argmax())


def test_gumbel_sampling_matches_softmax_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0]]).expand(20000, 3)
    g = torch.Generator().manual_seed(4)
    x0, _ = score_tokens(logits, temperature=1.0, generator=g)
    freq = torch.bincount(x0, minlength=3).double() / x0.numel()
    torch.testing.assert_close(freq, torch.softmax(logits[0].double(), -1), atol=0.015, rtol=0)


def test_categorical_modes():
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(5))
    probs = logits.softmax(-1)
    x0, conf = score_tokens(logits, sampler="categorical")
    assert torch.equal(x0, probs.argmax(-1))
    _, margin = score_tokens(logits, sampler="categorical", mode="margin")
    top = probs.topk(2).values
    torch.testing.assert_close(margin, top[:, 0] - top[:, 1])
    _, ent = score_tokens(logits, sampler="categorical", mode="neg_entropy")
    torch.testing.assert_close(ent, (probs * torch.log(probs + 1e-10)).sum(-1))
    assert bool((ent <= 0).all()) and math.isfinite(float(ent.sum()))


def test_score_rejects_unknown_mode():
    with pytest.raises(ValueError, match="mode"):
        score_tokens(torch.zeros(1, 3), mode="max")

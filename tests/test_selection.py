"""Scoring and selection rules against plain per-row implementations of the documented rules."""
from __future__ import annotations

import math

import pytest
import torch

from remask.diffusion.scoring import score_tokens
from remask.diffusion.selection import schedule_counts, select_factor, select_threshold, select_topk


def test_schedule_is_llada_integer_schedule():
    mask = torch.zeros(3, 10, dtype=torch.bool)
    mask[0, :10] = True
    mask[1, :7] = True
    counts = schedule_counts(mask, 4)
    assert counts.tolist() == [[3, 3, 2, 2], [2, 2, 2, 1], [0, 0, 0, 0]]
    assert counts.dtype == torch.int64


def test_topk_per_row_budgets():
    g = torch.Generator().manual_seed(0)
    conf = torch.rand(5, 13, generator=g, dtype=torch.float64)
    k = torch.tensor([0, 1, 4, 13, 20])
    chosen = select_topk(conf, k)
    for row in range(5):
        expect = set(torch.topk(conf[row], min(int(k[row]), 13)).indices.tolist())
        assert set(chosen[row].nonzero().flatten().tolist()) == expect


def _threshold_oracle(conf_row, cand_row, tau):
    picked = {i for i in range(len(conf_row)) if cand_row[i] and conf_row[i] >= tau}
    if cand_row.any():
        best = max((i for i in range(len(conf_row)) if cand_row[i]), key=lambda i: (conf_row[i], -i))
        picked.add(best)
    return picked


@pytest.mark.parametrize("tau", [1e-9, 0.3, 0.7, 1.0])
def test_threshold_rule(tau):
    g = torch.Generator().manual_seed(1)
    conf = torch.rand(6, 11, generator=g, dtype=torch.float64)
    cand = torch.rand(6, 11, generator=g) < 0.6
    cand[5] = False  # a row with nothing left
    conf = torch.where(cand, conf, -torch.inf)
    out = select_threshold(conf, cand, tau)
    for row in range(6):
        assert set(out[row].nonzero().flatten().tolist()) == _threshold_oracle(conf[row], cand[row], tau)


def _factor_oracle(conf_row, cand_row, factor):
    vals = sorted((float(conf_row[i]) for i in range(len(conf_row)) if cand_row[i]), reverse=True)
    n = len(vals)
    if n == 0:
        return 0
    thresholds = [-1.0] + [1 - factor / (i + 2) for i in range(1, n)]  # the first is always accepted
    top_i = 0
    for top_i in range(n):
        if vals[top_i] < thresholds[top_i]:
            break
    return top_i + 1 if top_i in (0, n - 1) else top_i


@pytest.mark.parametrize("factor", [0.5, 1.0, 2.0, 4.0])
def test_factor_rule_counts_including_last_index_quirk(factor):
    g = torch.Generator().manual_seed(2)
    conf = torch.rand(40, 9, generator=g, dtype=torch.float64) ** 0.3
    cand = torch.rand(40, 9, generator=g) < 0.7
    conf = torch.where(cand, conf, -torch.inf)
    out = select_factor(conf, cand, factor)
    for row in range(40):
        count = _factor_oracle(conf[row], cand[row], factor)
        assert int(out[row].sum()) == count
        if count:
            assert set(out[row].nonzero().flatten().tolist()) == set(torch.topk(conf[row], count).indices.tolist())


def test_factor_quirk_first_failure_at_last_candidate_accepts_all():
    # three candidates: thresholds [-1, 1 - f/3, 1 - f/4]; f = 1 → [-1, 0.667, 0.75]
    conf = torch.tensor([[0.9, 0.8, 0.1]], dtype=torch.float64)
    cand = torch.ones_like(conf, dtype=torch.bool)
    assert select_factor(conf, cand, 1.0).tolist() == [[True, True, True]]
    conf = torch.tensor([[0.9, 0.1, 0.1, 0.1]], dtype=torch.float64)
    assert select_factor(conf, torch.ones_like(conf, dtype=torch.bool), 1.0).tolist() == [[True, False, False, False]]


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

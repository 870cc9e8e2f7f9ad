"""`remask.margins.DecisionMargins` and the margins the reference fixtures record (docs/reference-fixtures.md)."""
from __future__ import annotations

import glob
import json
import math
import os

import pytest
import torch

from fixture_margins import BOUND, FACTOR, FIXTURES, SPREAD_FILE, file_bound, split_cases
from remask.margins import CASE, DecisionMargins, ranking_margin, threshold_margin


def test_a_ranking_margin_is_the_best_minus_the_next_best_relative_to_the_slice():
    x = torch.tensor([[0.1, 0.7, 0.4], [0.5, 0.45, -math.inf]])
    assert ranking_margin(x, 1, 1) == pytest.approx(0.05 / 0.5)
    # topk(k): only the boundary of the chosen set decides; argmin ranks from below
    assert ranking_margin(torch.tensor([[5.0, 4.0, 1.0, 0.9]]), 1, 2) == pytest.approx(3.0 / 5.0)
    assert ranking_margin(torch.tensor([[0.3, 0.1, 0.2]]), 1, 1, largest=False) == pytest.approx(0.1 / 0.3)
    # relative: a flat distribution's probabilities (1e-5) rank as finely as a peaked one's
    assert ranking_margin(torch.tensor([[2e-5, 1e-5]], dtype=torch.float64), 1, 1) == pytest.approx(0.5)
    assert ranking_margin(torch.tensor([[20.0, 19.0]]), 1, 1) == pytest.approx(1 / 20)


def test_saturated_probabilities_are_measured_in_log_odds():
    """Probabilities near 1 count by their distance from 1 (a lower bound on the log-odds gap), as a
    last-bit change of the logits moves them; float32's own rounding near 1 is never read as margin."""
    near_one = torch.tensor([[1 - 5e-9, 1 - 1e-8, 0.2]], dtype=torch.float64)
    m = ranking_margin(near_one, 1, 1)
    logit = torch.logit(near_one[0, :2])
    assert m == pytest.approx(5e-9 / 1e-8) and m <= float(logit[0] - logit[1])
    assert threshold_margin(torch.tensor([1 - 5e-9], dtype=torch.float64), 1 - 1e-8) == pytest.approx(0.5)
    # from below (the least confident first) the same pair, turned back to its sign
    assert ranking_margin(near_one, 1, 1, largest=False) == pytest.approx((1 - 1e-8 - 0.2) / 0.8)
    assert ranking_margin(-near_one, 1, 1, largest=False) == pytest.approx(5e-9 / (1 - 5e-9))  # not probabilities
    # below saturation: the relative margin, unchanged
    assert ranking_margin(torch.tensor([[0.3, 0.2]], dtype=torch.float64), 1, 1) == pytest.approx(0.1 / 0.3)
    # float32: one ulp below 1.0 against 1.0 stays a near-tie (the distance is floored at 10 ulps per 1e-5)
    one_ulp = torch.tensor([[1.0, 1 - 2 ** -24]], dtype=torch.float32)
    assert ranking_margin(one_ulp, 1, 1) < 1e-5
    assert ranking_margin(torch.tensor([[1.0, 1 - 40 * 2 ** -24]]), 1, 1) > 1e-5
    # a slice holding anything outside [0, 1] (logits) is relative to its largest magnitude, as before
    assert ranking_margin(torch.tensor([[0.99, 0.98, 5.0]]), 1, 2) == pytest.approx(0.01 / 5.0, rel=1e-5)


def test_exact_ties_and_sentinels_are_passed_over():
    # copies of one number stay tied on every CPU: the next distinct value decides
    assert ranking_margin(torch.tensor([[9.0, 9.0, 2.0]]), 1, 1) == pytest.approx(7 / 9)
    floor = torch.finfo(torch.float32).min
    assert ranking_margin(torch.tensor([[0.9, floor, floor]]), 1, 1) == math.inf
    assert threshold_margin(torch.tensor([0.5, -math.inf, 0.9]), 0.9) == pytest.approx(0.4 / 0.5, rel=1e-6)


def test_the_recorder_sees_rankings_and_thresholds_not_numerics():
    x = torch.tensor([[0.2, 0.9, 0.85]], dtype=torch.float64)
    with DecisionMargins() as margins:
        x.argmax(-1)
        torch.topk(x, 2, dim=1)
        _ = x > 0.8
        x.max()                       # a value reduction
        torch.maximum(x, x)           # elementwise
        x.amax(dim=1)                 # values only
        _ = torch.tensor([1, 2]) > 1  # integers
    ops = [site.rsplit(":", 1)[1] for site, _ in margins.decisions]
    assert ops == ["argmax", "topk", "gt"]
    # probabilities: each gap against min(magnitude, distance of the lower from 1)
    assert [m for _, m in margins.decisions] == pytest.approx([0.05 / 0.15, 0.65 / 0.8, 0.05 / 0.2])
    assert margins.minimum() == pytest.approx(0.05 / 0.2)
    assert all(site.startswith("tests/test_margins.py:") for site in margins.by_site())


def test_marks_split_a_run_per_case():
    x = torch.tensor([[0.2, 0.9, 0.3]])
    DecisionMargins.mark("nobody listens")   # no recorder: nothing happens
    with DecisionMargins() as margins:
        DecisionMargins.mark("a.json:1")
        x.argmax(-1)
        DecisionMargins.mark("a.json:2")
        DecisionMargins.mark("a.json:1")
        _ = x > 0.25
    assert margins.decisions[0] == (CASE, "a.json:1")
    cases = split_cases(margins.decisions)
    assert sorted(cases) == ["a.json:1", "a.json:2"] and cases["a.json:2"] == []
    assert [m for _, m in cases["a.json:1"]] == pytest.approx([0.6 / 0.7, 0.05 / 0.3])


def _cases_with_margins(node) -> list[dict]:
    if isinstance(node, dict):
        return ([node] if "min_margin" in node else []) + [c for v in node.values() for c in _cases_with_margins(v)]
    if isinstance(node, list):
        return [c for v in node for c in _cases_with_margins(v)]
    return []


def test_each_bound_sits_above_the_measured_spread():
    """A file's bound is FACTOR × the spread measured for its cases between CPUs, at least BOUND
    (tests/fixture_margins.py spread)."""
    with open(SPREAD_FILE) as f:
        data = json.load(f)
    assert data["runs"][0] == "avx512.jsonl" and {"avx2.jsonl", "default.jsonl"} <= set(data["runs"])
    assert data["decisions_compared"] > 100_000 and data["factor"] == FACTOR >= 10
    for name, spread in data["files"].items():
        assert spread["bound"] == max(BOUND, FACTOR * spread["p99"]) and spread["median"] <= spread["p99"], name


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(FIXTURES, "*.json"))), ids=os.path.basename)
def test_every_fixture_case_clears_its_bound(path):
    """Each fixture file records its cases' smallest decision margins (tests/fixture_margins.py), no
    kept case sits under the file's bound, and none of them went another way on another CPU."""
    from helpers import case_key

    name = os.path.basename(path)
    with open(path) as f:
        data = json.load(f)
    with open(SPREAD_FILE) as f:
        flipped = {label.split(":", 1)[1] for label in json.load(f)["flipped"] if label.split(":", 1)[0] == name}
    summary = data["margins"]
    assert summary["rule"] == "docs/reference-fixtures.md"
    cases = _cases_with_margins(data)
    assert len({case_key(c) for c in cases}) == summary["cases"] - summary["dropped"]   # equal outputs: one case
    if not summary["cases"]:
        return   # no decision in it (log-likelihoods, compared with a tolerance)
    assert summary["bound"] == file_bound(name)
    low = [c["min_margin"] for c in cases if c["min_margin"] is not None and c["min_margin"] < summary["bound"]]
    assert not low, f"{len(low)} cases under {summary['bound']}"
    assert not flipped & {case_key(c) for c in cases}

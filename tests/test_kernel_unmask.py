"""The unmask kernel against its torch reference, and the reference against plain per-row oracles
of the rules (LLaDA's top-k, Fast-dLLM's threshold and factor, Dream's confidence_threshold)."""
from __future__ import annotations

import pytest
import torch

from conftest import DEVICE
from remask.kernels import unmask
from remask.kernels.unmask import unmask_triton
from remask.kernels.unmask_ref import unmask_reference_loop, unmask_torch

RULES = [
    pytest.param(dict(k="random"), id="budget"),
    pytest.param(dict(threshold=0.5), id="threshold0.5"),
    pytest.param(dict(threshold=1.0), id="threshold1"),
    pytest.param(dict(k="random", threshold=0.7), id="budget+threshold"),
    pytest.param(dict(factor=1.0), id="factor1"),
    pytest.param(dict(factor=0.2), id="factor0.2"),
    pytest.param(dict(factor=4.0), id="factor4"),
]


def _case(seed, dtype, *, ties):
    g = torch.Generator().manual_seed(seed)
    B = int(torch.randint(1, 7, (), generator=g))
    L = int(torch.randint(1, 70, (), generator=g))
    if ties:  # few distinct values, so ties are everywhere
        conf = torch.randint(0, 5, (B, L), generator=g).double() / 4
    else:
        conf = torch.rand(B, L, generator=g, dtype=torch.float64) ** 0.3
    mask = torch.rand(B, L, generator=g) < 0.6
    mask[0] = False if B > 1 else mask[0]  # a row with nothing to commit
    x = torch.randint(0, 100, (B, L), generator=g)
    x0 = torch.randint(100, 200, (B, L), generator=g)
    k = torch.randint(0, L + 4, (B,), generator=g)  # 0 .. more than the masked count
    return [t.to(DEVICE) for t in (x, mask, x0, conf.to(dtype), k)]


def _run(fn, x, mask, x0, conf, **rule):
    x, mask = x.clone(), mask.clone()
    count = fn(x, mask, x0, conf, **rule)
    return x, mask, count


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_kernel_equals_reference(poisoned_outputs, rule, dtype):
    for seed in range(6):
        x, mask, x0, conf, k = _case(seed, dtype, ties=seed % 2 == 0)
        kwargs = {name: (k if value == "random" else value) for name, value in rule.items()}
        got = _run(unmask_triton, x, mask, x0, conf, **kwargs)
        want = _run(unmask_torch, x, mask, x0, conf, **kwargs)
        for a, b in zip(got, want):
            assert torch.equal(a, b), (seed, a, b)
        assert torch.equal(got[2], (mask & ~got[1]).sum(1))  # count = positions cleared
        assert torch.equal(got[0] != x, (mask & ~got[1]) & (x0 != x))  # only cleared positions written


def test_kernel_writes_through_strided_views(poisoned_outputs):
    """The samplers pass the current block as a view into the whole sequence."""
    x_full = torch.arange(60, device=DEVICE).reshape(3, 20)
    block = x_full[:, 5:12]
    mask = torch.ones(3, 7, dtype=torch.bool, device=DEVICE)
    x0 = torch.full((3, 7), -1, device=DEVICE)
    conf = torch.linspace(0, 1, 21, device=DEVICE).reshape(3, 7)
    count = unmask_triton(block, mask, x0, conf, k=torch.tensor([1, 2, 0], device=DEVICE))
    assert count.tolist() == [1, 2, 0]
    assert (x_full == -1).nonzero().tolist() == [[0, 11], [1, 10], [1, 11]]


def _oracle_threshold(conf, cand, tau):
    idx = [i for i in range(len(conf)) if cand[i]]
    if not idx:
        return set()
    best = max(idx, key=lambda i: (conf[i], -i))
    return {best} | {i for i in idx if conf[i] >= tau}


def _oracle_factor_count(conf, cand, factor):
    vals = sorted((float(conf[i]) for i in range(len(conf)) if cand[i]), reverse=True)
    n = len(vals)
    if n == 0:
        return 0
    thresholds = [-1.0] + [1 - factor / (i + 2) for i in range(1, n)]  # Fast-dLLM: the first always passes
    top_i = 0
    for top_i in range(n):
        if vals[top_i] < thresholds[top_i]:
            break
    return top_i + 1 if top_i in (0, n - 1) else top_i


def _ranked(conf, cand):
    """Masked positions, most confident first, lower index first among equals."""
    return sorted((i for i in range(len(conf)) if cand[i]), key=lambda i: (-float(conf[i]), i))


@pytest.mark.parametrize("seed", range(4))
def test_reference_rules_against_per_row_oracles(seed):
    g = torch.Generator().manual_seed(seed)
    conf = torch.rand(30, 9, generator=g, dtype=torch.float64) ** 0.3
    if seed % 2:
        conf = (conf * 4).round() / 4  # ties
    cand = torch.rand(30, 9, generator=g) < 0.7
    k = torch.randint(0, 12, (30,), generator=g)
    x0 = torch.arange(30 * 9).reshape(30, 9) + 1000
    for tau in (1e-9, 0.5, 0.9, 1.0):
        x, m = torch.zeros(30, 9, dtype=torch.long), cand.clone()
        unmask_torch(x, m, x0, conf, threshold=tau)
        for r in range(30):
            assert set((x[r] != 0).nonzero().flatten().tolist()) == _oracle_threshold(conf[r], cand[r], tau)
    for factor in (0.5, 1.0, 2.0, 4.0):
        x, m = torch.zeros(30, 9, dtype=torch.long), cand.clone()
        count = unmask_torch(x, m, x0, conf, factor=factor)
        for r in range(30):
            c = _oracle_factor_count(conf[r], cand[r], factor)
            assert int(count[r]) == c
            assert set((x[r] != 0).nonzero().flatten().tolist()) == set(_ranked(conf[r], cand[r])[:c])
    x, m = torch.zeros(30, 9, dtype=torch.long), cand.clone()
    count = unmask_torch(x, m, x0, conf, k=k, threshold=0.8)  # Dream's confidence_threshold
    for r in range(30):
        top = _ranked(conf[r], cand[r])[:int(k[r])]
        assert set((x[r] != 0).nonzero().flatten().tolist()) == {i for j, i in enumerate(top) if j == 0 or conf[r, i] >= 0.8}


def test_factor_quirk_first_failure_at_last_candidate_accepts_all():
    # thresholds [-1, 1 - f/3, 1 - f/4]; f = 1 → [-1, 0.667, 0.75]
    conf = torch.tensor([[0.9, 0.8, 0.1]], dtype=torch.float64)
    x = torch.zeros(1, 3, dtype=torch.long)
    assert unmask_torch(x, torch.ones(1, 3, dtype=torch.bool), x + 1, conf, factor=1.0).tolist() == [3]
    conf = torch.tensor([[0.9, 0.1, 0.1, 0.1]], dtype=torch.float64)
    x = torch.zeros(1, 4, dtype=torch.long)
    assert unmask_torch(x, torch.ones(1, 4, dtype=torch.bool), x + 1, conf, factor=1.0).tolist() == [1]


def test_thresholds_are_compared_in_the_confidence_dtype():
    """As torch compares a float32 tensor with a Python float: τ is rounded to float32 first."""
    tau = 0.9
    c32 = torch.tensor([[1.0, float(torch.tensor(tau, dtype=torch.float32))]], dtype=torch.float32)
    x = torch.zeros(1, 2, dtype=torch.long)
    assert unmask_torch(x.clone(), torch.ones(1, 2, dtype=torch.bool), x + 1, c32, threshold=tau).tolist() == [2]
    assert unmask_torch(x.clone(), torch.ones(1, 2, dtype=torch.bool), x + 1, c32.double(), threshold=tau).tolist() == [1]
    for fn in (unmask_triton, unmask_torch):
        assert fn(x.clone(), torch.ones(1, 2, dtype=torch.bool), x + 1, c32, threshold=tau).tolist() == [2]


def test_budget_rule_matches_llada_per_row_topk_loop():
    g = torch.Generator().manual_seed(9)
    conf = torch.rand(8, 50, generator=g)
    mask = torch.rand(8, 50, generator=g) < 0.5
    k = torch.randint(0, 30, (8,), generator=g)
    x0 = torch.randint(1, 9, (8, 50), generator=g)
    a = _run(unmask_reference_loop, torch.zeros(8, 50, dtype=torch.long), mask, x0, conf, k=k)
    b = _run(unmask_torch, torch.zeros(8, 50, dtype=torch.long), mask, x0, conf, k=k)
    for u, v in zip(a, b):
        assert torch.equal(u, v)


@pytest.mark.parametrize("bad, match", [
    (dict(), "one of k"),
    (dict(k=1, factor=1.0), "factor"),
    (dict(threshold=0.5, factor=1.0), "either threshold or factor"),
    (dict(threshold=1.5), "threshold"),
    (dict(factor=0.0), "factor"),
    (dict(k=torch.tensor([1, 2, 3])), "k must be"),
    (dict(k=1, x=torch.zeros(2, 4, dtype=torch.int32)), "int64"),
    (dict(k=1, mask=torch.ones(2, 4)), "bool"),
    (dict(k=1, conf=torch.zeros(2, 5)), "shape"),
])
def test_bad_input_names_the_parameter(bad, match):
    args = dict(x=torch.zeros(2, 4, dtype=torch.long), mask=torch.ones(2, 4, dtype=torch.bool),
                x0=torch.ones(2, 4, dtype=torch.long), conf=torch.rand(2, 4))
    for name in list(args):
        if name in bad:
            args[name] = bad.pop(name)
    with pytest.raises((ValueError, TypeError), match=match):
        unmask(args["x"], args["mask"], args["x0"], args["conf"], **bad)

"""The unmask kernel against its torch reference, and the reference against plain per-row oracles
of the rules (LLaDA's top-k, Fast-dLLM's threshold and factor, Dream's confidence_threshold)."""
from __future__ import annotations

import functools
import importlib

import pytest
import torch

from conftest import DEVICE
from remask.kernels import unmask
from remask.kernels.unmask import COUNT_TILE, SORT_MAX_L_F64, SORT_MIN_L, sort_path, unmask_triton
from remask.kernels.unmask_ref import unmask_reference_loop, unmask_torch

unmask_module = importlib.import_module("remask.kernels.unmask")  # `remask.kernels.unmask` is also the function

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


# --- the sort path (rows of L ≥ SORT_MIN_L). Under the interpreter `tl.sort` costs about a second
# per 512-lane row (its xor reductions run element by element), so these cases are few and small.

TIES = [-0.0, 0.0, 0.25, 0.5, 0.7, 1.0]  # −0.0 and +0.0 are equal; 0.7 is not exact in any dtype


def _long_case(seed, dtype, B, L, pad=0):
    """Rows of tied confidences (a handful of values) as views `[:, pad : pad + L]` into longer
    rows; row 0 has no masks and row 1 is all masked when B ≥ 3. float64 rows add offsets of 2⁻¹⁸
    (the key's high word) and 2⁻⁴⁵ (its low word only) to 0.25, 0.5 and 0.7 (same exponent), so
    equal high words with different low words are common and both passes matter."""
    g = torch.Generator().manual_seed(seed)
    W = L + 2 * pad
    conf = torch.tensor(TIES, dtype=torch.float64)[torch.randint(0, len(TIES), (B, W), generator=g)]
    if dtype == torch.float64:
        offsets = torch.tensor([0.0, 2.0 ** -45, 2.0 ** -18, 2.0 ** -18 + 2.0 ** -45], dtype=torch.float64)
        conf = torch.where((conf > 0) & (conf < 1), conf + offsets[torch.randint(0, 4, (B, W), generator=g)], conf)
    mask = torch.rand(B, W, generator=g) < 0.6
    if B >= 3:
        mask[0], mask[1] = False, True
    x = torch.randint(0, 100, (B, W), generator=g)
    x0 = torch.randint(100, 200, (B, W), generator=g)
    k = torch.randint(0, L + 4, (B,), generator=g)
    return [t.to(DEVICE) for t in (x, mask, x0, conf.to(dtype))] + [k.to(DEVICE), pad, L]


def _run_views(fn, case, rule, **kw):
    """`fn` on the `[:, pad : pad + L]` views of fresh copies; returns the whole rows and the count."""
    x, mask, x0, conf, k, pad, L = case
    x, mask = x.clone(), mask.clone()
    view = slice(pad, pad + L)
    kwargs = {name: (k if value == "random" else value) for name, value in rule.items()}
    count = fn(x[:, view], mask[:, view], x0[:, view], conf[:, view], **kwargs, **kw)
    return x, mask, count


@pytest.fixture
def launches(monkeypatch):
    """Which kernel each `unmask_triton` call launched: "count" or "sort", in order."""
    seen = []

    class Spy:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            seen.append(self.name)
            return self.kernel[grid]

    monkeypatch.setattr(unmask_module, "unmask_kernel", Spy("count", unmask_module.unmask_kernel))
    monkeypatch.setattr(unmask_module, "unmask_sort_kernel", Spy("sort", unmask_module.unmask_sort_kernel))
    return seen


def _assert_paths_agree(case, rule, sort_fn, launches):
    """`sort_fn` launches the sort path; it, the counting path and the reference agree."""
    got = _run_views(sort_fn, case, rule)
    assert launches[-1] == "sort"
    counted = _run_views(unmask_triton, case, rule, path="count")
    assert launches[-1] == "count"
    want = _run_views(unmask_torch, case, rule)
    for a, b, c in zip(got, counted, want):
        assert torch.equal(a, c) and torch.equal(b, c), (a, b, c)
    x, mask = case[0], case[1]
    assert torch.equal(got[2], (mask & ~got[1]).sum(1))  # count = positions cleared
    assert torch.equal(got[0] != x, (mask & ~got[1]) & (case[2] != x))  # only cleared positions written
    return got


# each dtype and each rule at least once (test_sort_path_forced_on_short_rows: every rule in every dtype)
LONG_RULES = [
    (torch.float32, dict(k="random", threshold=0.7)), (torch.float32, dict(factor=1.0)),
    (torch.float16, dict(factor=0.2)), (torch.float16, dict(threshold=0.5)),
    (torch.bfloat16, dict(k="random", threshold=0.7)), (torch.float64, dict(k="random")),
]


@pytest.mark.parametrize("seed, dtype, rule", [(seed, *case) for seed, case in enumerate(LONG_RULES)],
                         ids=[f"{str(d)[6:]}-{'+'.join(r)}" for d, r in LONG_RULES])
def test_sort_path_equals_reference_and_counting(poisoned_outputs, launches, monkeypatch, seed, dtype, rule):
    """L = 512 through the dispatcher (`unmask`), which picks the sort path."""
    monkeypatch.setenv("REMASK_TRITON", "1")
    _assert_paths_agree(_long_case(seed, dtype, 1, SORT_MIN_L), rule, unmask, launches)


@pytest.mark.parametrize("dtype, B, L, rule", [
    (torch.bfloat16, 3, 601, dict(k="random", threshold=0.7)),   # strided rows: none / all / some masked
    (torch.float64, 1, 1031, dict(k="random")),
    (torch.float16, 1, 523, dict(factor=1.0)),
], ids=["bf16-B3-L601", "f64-L1031", "f16-L523"])
def test_sort_path_long_odd_rows(poisoned_outputs, launches, dtype, B, L, rule):
    case = _long_case(L, dtype, B, L, pad=9)
    x_full, got_x = case[0], _assert_paths_agree(case, rule, unmask_triton, launches)[0]
    assert torch.equal(got_x[:, :9], x_full[:, :9]) and torch.equal(got_x[:, 9 + L:], x_full[:, 9 + L:])
    if B >= 3:  # row 0 had nothing to commit; row 1 everything the rule takes
        assert torch.equal(got_x[0], x_full[0]) and (got_x[1] != x_full[1]).any()


@pytest.mark.parametrize("rule", RULES)
def test_sort_path_forced_on_short_rows(poisoned_outputs, launches, rule):
    """The same kernel on short rows (cheap under the interpreter), every rule, each dtype once."""
    for seed, dtype in enumerate((torch.float64, torch.float32, torch.float16, torch.bfloat16)):
        x, mask, x0, conf, k = _case(seed, dtype, ties=seed != 1)
        case = [x, mask, x0, conf, k, 0, conf.shape[1]]
        _assert_paths_agree(case, rule, functools.partial(unmask_triton, path="sort"), launches)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_sort_path_order_is_exact(poisoned_outputs, launches, dtype):
    """Every prefix of one row's order: rows share one confidence row (stride 0) and take k = 0 … n,
    so any slip in the order (ties, −0.0, float64's low word) changes some row's selection."""
    g = torch.Generator().manual_seed(4)
    L = 27
    conf = torch.tensor(TIES, dtype=torch.float64)[torch.randint(0, len(TIES), (L,), generator=g)]
    if dtype == torch.float64:  # equal high words, different low words, and the reverse
        offsets = torch.tensor([0.0, 2.0 ** -45, 2.0 ** -18, 2.0 ** -18 + 2.0 ** -45], dtype=torch.float64)
        conf = torch.where((conf > 0) & (conf < 1), conf + offsets[torch.randint(0, 4, (L,), generator=g)], conf)
    row_mask = torch.rand(L, generator=g) < 0.8
    if dtype == torch.float64:  # the data holds what pass 1 is for: equal high words, the lower index smaller
        words = conf.view(torch.int64) >> 32
        assert any(words[i] == words[j] and conf[i] < conf[j] and row_mask[i] and row_mask[j]
                   for i in range(L) for j in range(i + 1, L))
    n = int(row_mask.sum())
    B = n + 2
    case = [torch.zeros(B, L, dtype=torch.long, device=DEVICE), row_mask.expand(B, L).clone().to(DEVICE),
            torch.arange(1, L + 1, device=DEVICE).expand(B, L), conf.to(dtype).to(DEVICE).expand(B, L),
            torch.arange(B, device=DEVICE), 0, L]
    got = _assert_paths_agree(case, dict(k="random"), functools.partial(unmask_triton, path="sort"), launches)
    assert got[2].tolist() == list(range(n + 1)) + [n]
    order = [int(torch.nonzero(got[0][r] != got[0][r - 1])[0]) for r in range(1, n + 1)]
    keys = conf.to(dtype).double()
    assert order == sorted((i for i in range(L) if row_mask[i]), key=lambda i: (-float(keys[i]), i))


def test_sort_path_choice():
    assert SORT_MIN_L == 512
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        assert not sort_path(dtype, SORT_MIN_L - 1) and sort_path(dtype, SORT_MIN_L) and sort_path(dtype, 4096)
    assert sort_path(torch.float64, SORT_MAX_L_F64) and not sort_path(torch.float64, SORT_MAX_L_F64 + 1)
    assert sort_path(torch.float32, SORT_MAX_L_F64 + 1)
    x = torch.zeros(1, SORT_MAX_L_F64 + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="at most"):
        unmask_triton(x, x.bool(), x, x.double(), k=torch.ones(1, dtype=torch.long), path="sort")
    with pytest.raises(ValueError, match="path"):
        unmask_triton(x, x.bool(), x, x.float(), k=torch.ones(1, dtype=torch.long), path="radix")



# --- the counting path in chunks: rank(i) counted over BLOCK_J-wide chunks of j, a BLOCK_L × BLOCK_J
# tile of at most COUNT_TILE comparisons per step (rows of 256 take 32 chunks of 8).

def _assert_count_equals_reference(case, rule, launches):
    got = _run_views(unmask_triton, case, rule, path="count")
    assert launches[-1] == "count"
    want = _run_views(unmask_torch, case, rule)
    for a, b in zip(got, want):
        assert torch.equal(a, b), (a, b)
    x, mask = case[0], case[1]
    assert torch.equal(got[2], (mask & ~got[1]).sum(1))  # count = positions cleared
    assert torch.equal(got[0] != x, (mask & ~got[1]) & (case[2] != x))  # only cleared positions written
    return got


@pytest.mark.parametrize("L", [4, 8, 32, 64, 256, 1024, 5, 255, 257, 4097])
def test_count_launch_keeps_the_tile_small(monkeypatch, L):
    """Every block length (the shipped 4 … 1024 and odd ones): one step compares at most COUNT_TILE
    lanes (256 × 64 spilled on every arch), one column when the row alone is longer; the float64
    keys only for float64 rows."""
    seen = []

    class Record:
        def __getitem__(self, grid):
            return lambda *args, **meta: seen.append(meta)

    monkeypatch.setattr(unmask_module, "unmask_kernel", Record())
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        x = torch.zeros(2, L, dtype=torch.long)
        unmask_triton(x, x.bool(), x, x.to(dtype), k=torch.ones(2, dtype=torch.long), path="count")
        meta = seen[-1]
        assert meta["BLOCK_L"] >= L and 1 <= meta["BLOCK_J"] <= meta["BLOCK_L"]
        assert meta["BLOCK_L"] * meta["BLOCK_J"] <= max(COUNT_TILE, meta["BLOCK_L"])
        assert meta["KEY64"] == (dtype == torch.float64)


@pytest.mark.parametrize("dtype, B, L, rule", [
    (torch.float64, 3, 257, dict(k="random", threshold=0.7)),   # strided rows: none / all / some masked
    (torch.float64, 1, 255, dict(factor=0.2)),
    (torch.float32, 3, 257, dict(k="random")),
    (torch.float32, 1, 129, dict(factor=1.0)),
    (torch.float16, 1, 131, dict(threshold=0.5)),
    (torch.bfloat16, 3, 200, dict(k="random", threshold=0.7)),
], ids=["f64-B3-L257", "f64-L255", "f32-B3-L257", "f32-L129", "f16-L131", "bf16-B3-L200"])
def test_count_path_long_odd_rows(poisoned_outputs, launches, dtype, B, L, rule):
    """Rows of many chunks (the last one partly past L), tied confidences (float64: equal high
    words, different low words) in strided views; the padding around the views is left alone."""
    case = _long_case(L + 1, dtype, B, L, pad=5)
    got_x = _assert_count_equals_reference(case, rule, launches)[0]
    x_full = case[0]
    assert torch.equal(got_x[:, :5], x_full[:, :5]) and torch.equal(got_x[:, 5 + L:], x_full[:, 5 + L:])
    if B >= 3:  # row 0 had nothing to commit; row 1 everything the rule takes
        assert torch.equal(got_x[0], x_full[0]) and (got_x[1] != x_full[1]).any()


@pytest.mark.parametrize("dtype, tile", [(torch.float64, 32), (torch.float32, 32), (torch.float16, 64),
                                         (torch.bfloat16, 64), (torch.float64, 64)],
                         ids=["f64-chunks-of-1", "f32-chunks-of-1", "f16-chunks-of-2", "bf16-chunks-of-2",
                              "f64-chunks-of-2"])
def test_count_path_order_is_exact_across_chunks(poisoned_outputs, launches, monkeypatch, dtype, tile):
    """Every prefix of one row's order (k = 0 … n over rows sharing one confidence row) with the
    tile shrunk so that the 27 positions span 27 or 14 chunks: ties (−0.0 = +0.0, float64's low
    word) split across chunks still go to the lower index."""
    monkeypatch.setattr(unmask_module, "COUNT_TILE", tile)
    g = torch.Generator().manual_seed(5)
    L = 27
    conf = torch.tensor(TIES, dtype=torch.float64)[torch.randint(0, len(TIES), (L,), generator=g)]
    if dtype == torch.float64:
        offsets = torch.tensor([0.0, 2.0 ** -45, 2.0 ** -18, 2.0 ** -18 + 2.0 ** -45], dtype=torch.float64)
        conf = torch.where((conf > 0) & (conf < 1), conf + offsets[torch.randint(0, 4, (L,), generator=g)], conf)
    row_mask = torch.rand(L, generator=g) < 0.8
    n = int(row_mask.sum())
    B = n + 2
    case = [torch.zeros(B, L, dtype=torch.long, device=DEVICE), row_mask.expand(B, L).clone().to(DEVICE),
            torch.arange(1, L + 1, device=DEVICE).expand(B, L), conf.to(dtype).to(DEVICE).expand(B, L),
            torch.arange(B, device=DEVICE), 0, L]
    got = _assert_count_equals_reference(case, dict(k="random"), launches)
    assert got[2].tolist() == list(range(n + 1)) + [n]
    order = [int(torch.nonzero(got[0][r] != got[0][r - 1])[0]) for r in range(1, n + 1)]
    keys = conf.to(dtype).double()
    assert order == sorted((i for i in range(L) if row_mask[i]), key=lambda i: (-float(keys[i]), i))

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
    x, c32 = x.to(DEVICE), c32.to(DEVICE)   # the kernel's inputs (and torch's again) on DEVICE
    for fn in (unmask_triton, unmask_torch):
        assert fn(x.clone(), torch.ones(1, 2, dtype=torch.bool, device=DEVICE), x + 1, c32,
                  threshold=tau).tolist() == [2]


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


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_threshold_alone_equals_threshold_under_a_budget_that_never_binds(dtype):
    """The threshold without a budget skips the sort; it must select as the ranked path does with a budget of
    more than the masked count, on rows with ties, NaN, ±inf, ±0 and nothing masked."""
    g = torch.Generator().manual_seed(5)
    B, L = 40, 23
    conf = (torch.rand(B, L, generator=g, dtype=torch.float64) * 4).round() / 4
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.0], dtype=torch.float64)
    spots = torch.rand(B, L, generator=g) < 0.15
    conf[spots] = specials[torch.randint(0, len(specials), (int(spots.sum()),), generator=g)]
    conf[3] = -float("inf")
    conf[4] = float("nan")
    mask = torch.rand(B, L, generator=g) < 0.6
    mask[0] = False
    mask[1] = True
    x0 = torch.arange(B * L).reshape(B, L) + 1000
    never_binds = torch.full((B,), L + 1)
    for tau in (0.0, 0.5, 0.9, 1.0):
        a = _run(unmask_torch, torch.zeros(B, L, dtype=torch.long), mask, x0, conf.to(dtype), threshold=tau)
        b = _run(unmask_torch, torch.zeros(B, L, dtype=torch.long), mask, x0, conf.to(dtype), threshold=tau,
                 k=never_binds)
        for u, v in zip(a, b):
            assert torch.equal(u, v)
        assert int(a[2][0]) == 0 and int(a[2][4]) == 0 and int(a[2].sum()) > 0   # nothing masked, all NaN; commits


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

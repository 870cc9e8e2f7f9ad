"""dInfer's decoding kernels (`kernels/dinfer.py`) under the interpreter against their torch
references (`kernels/dinfer_ref.py`), and the references against `diffusion/methods/dinfer.py`'s rules
(which reproduce dInfer's fixtures)."""
from __future__ import annotations

import pytest
import torch

from conftest import DEVICE
from remask.kernels.dinfer import credit_confidence, credit_confidence_triton, dinfer_select, dinfer_select_triton
from remask.kernels.dinfer_ref import credit_confidence_torch, dinfer_select_torch

MASK = 7


def _block(seed, B, L, V, ties=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (B, L), generator=g)
    x[torch.rand(B, L, generator=g) < 0.6] = MASK
    if B > 1:
        x[0] = 3                       # a row with nothing masked
    x0 = torch.randint(0, V, (B, L), generator=g)
    x0[torch.rand(B, L, generator=g) < 0.1] = MASK    # the mask token predicted
    if ties:
        conf = torch.randint(1, 5, (B, L), generator=g).float() / 4
    else:
        conf = torch.rand(B, L, generator=g) ** 0.3
    return [t.to(DEVICE) for t in (x, x0, conf)]


@pytest.mark.parametrize("rule, threshold, low", [("threshold", 0.9, None), ("threshold", 0.3, None),
                                                  ("hierarchy", 0.9, 0.4), ("hierarchy", None, 0.4),
                                                  ("hierarchy", 0.7, None), ("hierarchy", None, None)])
@pytest.mark.parametrize("L", [1, 7, 32, 37])
def test_select_kernel_equals_reference(poisoned_outputs, rule, threshold, low, L):
    for seed in range(4):
        x, x0, conf = _block(seed, 3, L, 50, ties=seed % 2 == 1)
        got = dinfer_select_triton(x.clone(), x0, conf, MASK, rule, threshold, low)
        want = dinfer_select_torch(x.clone(), x0, conf, MASK, rule, threshold, low)
        assert torch.equal(got, want), (seed, got, want)


def test_select_kernel_strided_rows_and_all_masked():
    wide_x, wide_x0, wide_conf = _block(5, 4, 80, 50)
    x, x0, conf = wide_x[:, 3:40], wide_x0[:, 3:40], wide_conf[:, 3:40]   # row stride 80, unit column stride
    x[1] = MASK                                                            # one run over the whole row
    for rule, thr, low in (("threshold", 0.8, None), ("hierarchy", 0.9, 0.4)):
        got, want = x.clone(), x.clone()
        dinfer_select_triton(got, x0, conf, MASK, rule, thr, low)
        dinfer_select_torch(want, x0, conf, MASK, rule, thr, low)
        assert torch.equal(got, want)


def test_select_kernel_catches_a_broken_rule():
    """The test can fail: the run rule applied to every position (no runs) differs."""
    x, x0, conf = _block(1, 2, 32, 50)
    got = dinfer_select_triton(x.clone(), x0, conf, MASK, "hierarchy", 0.99, 0.0)
    flat = dinfer_select_torch(x.clone(), x0, conf, MASK, "threshold", 0.99)
    assert not torch.equal(got, flat)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("V", [1000, 1031])
def test_credit_kernel_equals_reference_over_calls(poisoned_outputs, dtype, V):
    g = torch.Generator().manual_seed(V)
    B, L = 2, 5
    credit_k = torch.zeros(B, L, V, device=DEVICE)
    credit_r = credit_k.clone()
    for call in range(4):
        logits = (torch.randn(B, L, V, generator=g) * 3).to(dtype).to(DEVICE)
        logits[0, 1, 17] = logits[0, 1, 900] = logits[0, 1].max() + 1   # a tie across chunks
        masked = torch.rand(B, L, generator=g).to(DEVICE) < 0.7
        x0_k, conf_k = credit_confidence_triton(logits, credit_k, masked, call == 0, 0.7, 0.2, 0.8)
        x0_r, conf_r = credit_confidence_torch(logits.float(), credit_r, masked, call == 0, 0.7, 0.2, 0.8)
        assert torch.equal(x0_k, x0_r), call
        torch.testing.assert_close(conf_k, conf_r, rtol=2e-5, atol=1e-6)
        torch.testing.assert_close(credit_k, credit_r, rtol=2e-5, atol=1e-6)
    assert float(credit_r.max()) > 1.0   # boosts accumulated: the decay path ran


def test_dispatchers_validate_and_default_to_torch_on_cpu():
    x, x0, conf = _block(0, 2, 8, 50)
    with pytest.raises(ValueError, match="rule"):
        dinfer_select(x, x0, conf, MASK, "top_k", 0.9)
    with pytest.raises(ValueError, match="conf"):
        dinfer_select(x, x0, conf.double(), MASK, "threshold", 0.9)
    with pytest.raises(ValueError, match="credit"):
        credit_confidence(torch.zeros(1, 2, 5), torch.zeros(1, 2, 4), torch.zeros(1, 2, dtype=torch.bool), True,
                          0.7, 0.2, 0.8)


def test_references_are_the_dinfer_rules():
    """dInfer's rules (`diffusion/parts/rules.py`, run by the block loop) decide with these references
    (their fixtures pin them to dInfer); a rule's state lives across one block's calls (`commit_block`)."""
    from remask.diffusion.parts.rules import CreditDecoding, HierarchicalDecoding, ThresholdDecoding, commit_block

    g = torch.Generator().manual_seed(3)
    for rule in (ThresholdDecoding(0.6), HierarchicalDecoding(0.8, 0.3), CreditDecoding(0.6)):
        held = None
        x = torch.randint(0, 50, (2, 24), generator=g)
        x[:, 4:] = MASK
        credit = torch.zeros(2, 20, 50)
        for call in range(3):
            logits = torch.randn(2, 20, 50, generator=g) * 4
            masked = x[:, 4:] == MASK
            want = x[:, 4:].clone()
            if isinstance(rule, CreditDecoding):
                x0, conf = credit_confidence_torch(logits, credit, masked, call == 0, 0.7, 0.2, 0.8)
                dinfer_select_torch(want, x0, conf, MASK, "threshold", rule.threshold)
            else:
                x0 = logits.argmax(-1)
                p = torch.softmax(logits, -1) if isinstance(rule, ThresholdDecoding) else \
                    torch.log_softmax(logits, -1).exp()
                conf = p.gather(-1, x0[..., None])[..., 0]
                kind = "threshold" if isinstance(rule, ThresholdDecoding) else "hierarchy"
                dinfer_select_torch(want, x0, conf, MASK, kind, rule.threshold,
                                    getattr(rule, "low_threshold", None))
            before = x[:, 4:] == MASK
            _, held = commit_block(rule, x[:, 4:24], logits, MASK, held, 0)
            # a row where the rule committed nothing gets dInfer-remask's fallback (one position)
            stuck = before.any(dim=1) & ((want == MASK) == before).all(dim=1)
            assert torch.equal(x[~stuck, 4:], want[~stuck]), call


def _runs_block(seed, L, pattern):
    """Rows of length `L` with masked runs laid out by `pattern`, confidences with many ties."""
    g = torch.Generator().manual_seed(seed)
    B = 4
    x = torch.randint(0, 50, (B, L), generator=g)
    x[x == MASK] = 3
    pos = torch.arange(L)
    if pattern == "alternating":                         # L // 2 runs of one position each
        x[:, pos % 2 == 0] = MASK
        x[1, pos % 3 != 2] = MASK                        # runs of two
    elif pattern == "random":
        x[torch.rand(B, L, generator=g) < 0.7] = MASK
    else:                                                # long runs across any chunking, one per whole row
        x[0] = MASK
        x[1, 5:L - 3] = MASK
        x[2, : L // 2] = MASK
        x[3, L // 3:] = MASK
    x0 = torch.randint(0, 50, (B, L), generator=g)
    conf = torch.randint(0, 6, (B, L), generator=g).float() / 5     # ties everywhere, 0.0 included
    conf[conf == 0] = -0.0 if seed % 2 else 0.0
    conf[3, ::7] = float("-inf")
    return [t.to(DEVICE) for t in (x, x0, conf)]


# every run pattern on the short and middle blocks; the long ones (the interpreter's cost grows with L) once each
HIERARCHY_BLOCKS = [(pattern, L) for L in (2, 15, 129) for pattern in ("alternating", "random", "long")] + [
    ("random", 300), ("long", 1024), ("alternating", 1024)]


@pytest.mark.parametrize("pattern, L", HIERARCHY_BLOCKS, ids=[f"{p}-{L}" for p, L in HIERARCHY_BLOCKS])
def test_select_kernel_hierarchy_long_blocks_many_runs_ties(poisoned_outputs, pattern, L):
    for seed, (threshold, low) in enumerate(((0.9, 0.4), (None, None), (0.7, None), (None, 0.5))):
        x, x0, conf = _runs_block(seed, L, pattern)
        got = dinfer_select_triton(x.clone(), x0, conf, MASK, "hierarchy", threshold, low)
        want = dinfer_select_torch(x.clone(), x0, conf, MASK, "hierarchy", threshold, low)
        assert torch.equal(got, want), (seed, (got != want).nonzero())
    if L > 2:
        assert not torch.equal(got, x)    # something committed


def test_select_kernel_hierarchy_all_masked_minus_inf():
    """A run whose confidences are all -inf commits nothing by the run rule (the reference's max
    holds the float32 floor); the row's top is then an unmasked position, and nothing commits."""
    x = torch.full((2, 40), MASK, device=DEVICE)
    x[1, 10:] = 3
    x0 = torch.arange(80, device=DEVICE).view(2, 40) % 50
    conf = torch.full((2, 40), float("-inf"), device=DEVICE)
    conf[0, 17] = 0.25
    for threshold, low in ((None, None), (0.9, 0.4)):
        got = dinfer_select_triton(x.clone(), x0, conf, MASK, "hierarchy", threshold, low)
        want = dinfer_select_torch(x.clone(), x0, conf, MASK, "hierarchy", threshold, low)
        assert torch.equal(got, want)
        assert got[0, 17] == x0[0, 17] and torch.equal(got[1], x[1])


@pytest.mark.parametrize("L", [129, 1024])
def test_select_kernel_hierarchy_writes_only_its_block(poisoned_outputs, L):
    """A block that is a view into a longer row (the loops pass `x[:, start:end]`): the kernel
    writes inside it exactly what the reference writes, and nothing around it."""
    sentinel = 4321
    for seed, (threshold, low) in enumerate(((0.9, 0.4), (None, None))):
        x, x0, conf = _runs_block(seed, L, "random")
        row = torch.full((x.shape[0], L + 11), sentinel, dtype=x.dtype, device=x.device)
        row[:, 5:5 + L] = x
        block = row[:, 5:5 + L]
        got = dinfer_select_triton(block, x0, conf, MASK, "hierarchy", threshold, low)
        want = dinfer_select_torch(x.clone(), x0, conf, MASK, "hierarchy", threshold, low)
        assert torch.equal(got, want) and torch.equal(row[:, 5:5 + L], want)
        assert bool((row[:, :5] == sentinel).all()) and bool((row[:, 5 + L:] == sentinel).all())


@pytest.mark.portable
def test_credit_confidence_of_a_row_is_the_same_alone_and_stacked():
    """The credit update of a row (its boost's pow included) does not depend on the rows stacked with it: the
    engine's batched commits stack requests' credits (`CreditDecoding.commit_rows`)."""
    torch.manual_seed(0)
    logits, masked = torch.randn(5, 7, 33), torch.rand(5, 7) < 0.7
    credit = torch.rand(5, 7, 33)
    stacked_credit = credit.clone()
    stacked = credit_confidence_torch(logits, stacked_credit, masked, False, 0.7, 0.2, 0.8)
    for b in range(5):
        own = credit[b:b + 1].clone()
        x0, conf = credit_confidence_torch(logits[b:b + 1], own, masked[b:b + 1], False, 0.7, 0.2, 0.8)
        assert torch.equal(x0[0], stacked[0][b]) and torch.equal(conf[0], stacked[1][b])
        assert torch.equal(own[0], stacked_credit[b])

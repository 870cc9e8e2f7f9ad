"""APD's fused accept kernel against its torch reference, and the reference against the definition
(`torch.argmax` of the mixture over the whole `[N, V]` tensor, `cumprod` of the accept flags).

Under TRITON_INTERPRET=1 on machines without a GPU (set in conftest); outputs NaN/-7777-poisoned.
"""
from __future__ import annotations

import pytest
import torch

from conftest import DEVICE
from remask.kernels import apd_accept
from remask.kernels.accept import apd_accept_triton
from remask.kernels.accept_ref import apd_accept_torch


def _case(n, V_d, V_a, dtype, seed, *, agree=0.8, row_pad=7):
    """Logits for n draft positions (strided rows), and a draft that equals the mixture target at
    about `agree` of the positions, so accepted lengths vary."""
    g = torch.Generator().manual_seed(seed)
    dllm = (torch.randn(n, V_d + row_pad, generator=g) * 3).to(dtype)[:, :V_d]
    verifier = (torch.randn(n, V_a + row_pad, generator=g) * 3).to(dtype)[:, :V_a]
    return dllm.to(DEVICE), verifier.to(DEVICE), g


def _definition(draft, dllm, verifier, R, vocab, temperature=0.0, noise=None):
    mix = R * dllm[:, :vocab].float() + (1 - R) * verifier[:, :vocab].float()
    if temperature > 0:
        mix = mix - temperature * torch.log(-torch.log(noise[:, :vocab].float()))
    target = mix.argmax(-1)
    accept = draft == target
    accept[0] = True
    return target, int(torch.cumprod(accept.long(), 0).sum())


def _draft_near(target, g, agree):
    wrong = torch.rand(target.shape, generator=g) > agree
    return torch.where(wrong.to(target.device), (target + 1) % 50, target)


# every dtype and mixture weight on equal vocabularies; cut vocabularies and the larger block (V > 2048, the
# interpreter's cost grows with V) at fewer of them
CASES = ([(1000, 1000, R, dtype) for R in (0.0, 0.3, 0.7, 1.0) for dtype in (torch.float32, torch.float16, torch.bfloat16)]
         + [(1013, 997, R, torch.float32) for R in (0.0, 0.3, 0.7, 1.0)]
         + [(1013, 997, 0.3, torch.float16), (1013, 997, 0.7, torch.bfloat16)]
         + [(4099, 4111, R, torch.float32) for R in (0.0, 0.7)])


@pytest.mark.parametrize("V_d,V_a,R,dtype", CASES, ids=[f"{d}-{a}-{R}-{str(t)[6:]}" for d, a, R, t in CASES])
def test_kernel_matches_reference(poisoned_outputs, V_d, V_a, R, dtype):
    seed = V_d + int(10 * R)
    n = 1 + seed % 37
    dllm, verifier, g = _case(n, V_d, V_a, dtype, seed)
    vocab = min(V_d, V_a)
    target, _ = _definition(torch.zeros(n, dtype=torch.long, device=DEVICE), dllm, verifier, R, vocab)
    draft = _draft_near(target, g, agree=0.85)
    want_target, want_n = _definition(draft, dllm, verifier, R, vocab)
    ref_target, ref_n = apd_accept_torch(draft, dllm, verifier, R, vocab=vocab)
    assert torch.equal(ref_target.cpu(), want_target.cpu()) and int(ref_n) == want_n
    small = 256 if vocab < 2048 else 1024
    for block, splits in ((None, None), (small, 1), (small, 3)):
        got_target, got_n = apd_accept_triton(draft, dllm, verifier, R, vocab=vocab, block=block, num_splits=splits)
        assert torch.equal(got_target.cpu(), want_target.cpu()), (block, splits)
        assert int(got_n) == want_n, (block, splits)


@pytest.mark.parametrize("temperature", [0.5, 1.0])
def test_coupled_noise_gives_the_reference_target(poisoned_outputs, temperature):
    dllm, verifier, g = _case(19, 1021, 1021, torch.float32, 5, row_pad=0)
    noise = torch.rand(19, 1021, generator=g).to(DEVICE)
    target, _ = _definition(torch.zeros(19, dtype=torch.long, device=DEVICE), dllm, verifier, 0.6, 1021,
                            temperature, noise)
    draft = _draft_near(target, g, agree=0.9)
    want = _definition(draft, dllm, verifier, 0.6, 1021, temperature, noise)
    for fn, kw in ((apd_accept_torch, {}), (apd_accept_triton, dict(block=256, num_splits=1)),
                   (apd_accept_triton, dict(block=256, num_splits=4))):
        got_target, got_n = fn(draft, dllm, verifier, 0.6, vocab=1021, temperature=temperature, noise=noise, **kw)
        assert torch.equal(got_target.cpu(), want[0].cpu()) and int(got_n) == want[1]
    # the noise really moved the target
    assert not torch.equal(want[0], _definition(draft, dllm, verifier, 0.6, 1021)[0])


def test_accepted_length_extremes(poisoned_outputs):
    dllm, verifier, _ = _case(23, 1000, 1000, torch.float32, 3)
    target, _ = _definition(torch.zeros(23, dtype=torch.long, device=DEVICE), dllm, verifier, 0.5, 1000)
    cases = {"all": (target.clone(), 23), "first_wrong": ((target + 1) % 1000, 1)}
    cut = target.clone()
    cut[9] = (cut[9] + 1) % 1000
    cut[15] = (cut[15] + 1) % 1000
    cases["cut"] = (cut, 9)
    for name, (draft, want) in cases.items():
        for splits in (1, 3):
            _, n = apd_accept_triton(draft, dllm, verifier, 0.5, vocab=1000, block=256, num_splits=splits)
            assert int(n) == want, name
        assert int(apd_accept_torch(draft, dllm, verifier, 0.5, vocab=1000)[1]) == want, name
    one = apd_accept_triton(target[:1] + 1, dllm[:1], verifier[:1], 0.5, vocab=1000)
    assert int(one[1]) == 1   # the first token is accepted even when it disagrees
    empty = apd_accept(target[:0], dllm[:0], verifier[:0], 0.5)
    assert empty[0].numel() == 0 and int(empty[1]) == 0


def test_ties_go_to_the_lowest_index(poisoned_outputs):
    dllm = torch.zeros(3, 1000, device=DEVICE)
    verifier = torch.zeros(3, 1000, device=DEVICE)
    dllm[:, [700, 300, 999]] = 5.0
    draft = torch.tensor([300, 300, 700], device=DEVICE)
    for splits in (1, 4):
        target, n = apd_accept_triton(draft, dllm, verifier, 0.5, vocab=1000, block=256, num_splits=splits)
        assert target.tolist() == [300, 300, 300] and int(n) == 2
    target, n = apd_accept_torch(draft, dllm, verifier, 0.5, vocab=1000)
    assert target.tolist() == [300, 300, 300] and int(n) == 2


def test_vocab_cuts_both_sides(poisoned_outputs):
    dllm, verifier, _ = _case(6, 1100, 1000, torch.float32, 9)
    dllm = dllm.clone()
    dllm[:, 1050] = 1e4   # outside the shared vocabulary: never the target
    for fn in (apd_accept_torch, apd_accept_triton):
        target, _ = fn(torch.zeros(6, dtype=torch.long, device=DEVICE), dllm, verifier, 0.9, vocab=1000)
        assert int(target.max()) < 1000


def test_dispatcher_checks_its_arguments():
    dllm, verifier, _ = _case(4, 100, 90, torch.float32, 1)
    draft = torch.zeros(4, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="draft"):
        apd_accept(draft.int(), dllm, verifier, 0.5)
    with pytest.raises(ValueError, match="verifier_logits"):
        apd_accept(draft, dllm, verifier[:3], 0.5)
    with pytest.raises(ValueError, match="vocab"):
        apd_accept(draft, dllm, verifier, 0.5, vocab=95)
    with pytest.raises(ValueError, match="mixture_weight"):
        apd_accept(draft, dllm, verifier, 1.5)
    with pytest.raises(ValueError, match="noise"):
        apd_accept(draft, dllm, verifier, 0.5, temperature=0.7)
    with pytest.raises(TypeError, match="dllm_logits dtype"):
        apd_accept(draft, dllm.double(), verifier, 0.5)
    target, n = apd_accept(draft, dllm, verifier, 0.5)
    assert target.shape == (4,) and 1 <= int(n) <= 4

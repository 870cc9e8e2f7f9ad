"""The canvas kernels (uniform-noise diffusion) against their torch reference, and the reference
against the definitions (transformers' formulation: softmax, Categorical entropy, sort + cumsum).

Under TRITON_INTERPRET=1 on CPU (conftest); outputs NaN/-7777-poisoned (`poisoned_outputs`).
"""
from __future__ import annotations

import importlib

import pytest
import torch

from conftest import DEVICE

canvas_kernels = importlib.import_module("remask.kernels.canvas")
from remask.kernels.canvas import canvas_score, canvas_update  # noqa: E402
from remask.kernels.canvas_ref import canvas_score_torch, canvas_update_torch  # noqa: E402


@pytest.fixture
def triton_path(monkeypatch):
    monkeypatch.setenv("REMASK_TRITON", "1")


def _logits(n, V, dtype, seed, row_pad=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, V + row_pad, generator=g) * 4).to(dtype).to(DEVICE)[:, :V]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("V", [1000, 4099])
def test_score_kernel_matches_reference(poisoned_outputs, triton_path, dtype, V):
    logits = _logits(13, V, dtype, V, row_pad=7)
    logits[3, 5] = logits[3, V - 2] = 30.0   # a tie across chunks: the lower index wins
    noise = torch.rand(logits.shape, generator=torch.Generator().manual_seed(1)).clamp(1e-6, 1 - 1e-6).to(DEVICE)
    temperature = torch.tensor(0.7)
    got = canvas_score(logits, temperature, noise=noise)
    want = canvas_score_torch(logits, temperature, noise=noise)
    assert torch.equal(got[0].cpu(), want[0].cpu()) and torch.equal(got[1].cpu(), want[1].cpu())
    assert int(got[1][3]) == 5
    torch.testing.assert_close(got[2].cpu(), want[2].cpu(), atol=5e-5, rtol=1e-5)
    torch.testing.assert_close(got[3].cpu(), want[3].cpu(), atol=1e-6, rtol=1e-5)


def test_reference_matches_transformers_formulation():
    """Entropy and p(argmax) as transformers computes them (Categorical over l / T, float32
    softmax), the argmax as torch.argmax; the sample is the Gumbel-max of the injected uniforms."""
    logits = _logits(9, 1001, torch.float32, 3).cpu()
    T = torch.tensor(0.6)
    noise = torch.rand(logits.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    sample, argmax, entropy, top_prob = canvas_score_torch(logits, T, noise=noise)
    x = logits / T
    torch.testing.assert_close(entropy, torch.distributions.Categorical(logits=x).entropy(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(top_prob, torch.softmax(x, -1, dtype=torch.float32).max(-1).values)
    assert torch.equal(argmax, torch.argmax(x, -1))
    assert torch.equal(sample, torch.argmax(x.double() - torch.log(-torch.log(noise)), -1))


def test_philox_sample_follows_the_tempered_softmax(triton_path):
    """With its own stream the kernel's sample is distributed as softmax(l / T): the kernel draws what the torch
    path draws from the same seed (on the first rows: one program per row is slow under the interpreter), and the
    torch path's draws over many rows follow the tempered softmax."""
    V, n, kernel_rows = 6, 500, 40
    row = torch.tensor([1.0, 0.0, 2.0, -1.0, 0.5, 1.5])
    logits = row.expand(n, V).contiguous().to(DEVICE)
    sample = canvas_score_torch(logits, 0.8, seed=11)[0].cpu()
    freq = torch.bincount(sample, minlength=V).float() / n
    torch.testing.assert_close(freq, torch.softmax(row / 0.8, -1), atol=0.06, rtol=0)
    # seeded, Philox at row·V + col: the kernel's draws are the torch path's, whatever rows come after
    assert torch.equal(canvas_score(logits[:kernel_rows], 0.8, seed=11)[0].cpu(), sample[:kernel_rows])


@pytest.mark.parametrize("L", [1, 7, 32, 37])
def test_update_kernel_matches_reference(poisoned_outputs, triton_path, L):
    g = torch.Generator().manual_seed(L)
    B, V = 3, 1001
    entropy = (torch.rand(B, L, generator=g) * 0.4).to(DEVICE)
    if L > 3:
        entropy[0, 1] = entropy[0, 3]   # a tie: the earlier position counts first
        entropy[1, 2] = -0.0
    sample = torch.randint(0, V, (B, L), generator=g).to(DEVICE)
    noise = torch.randint(0, V, (B, L), generator=g).to(DEVICE)
    got = canvas_update(sample, entropy, 0.5, vocab_size=V, noise_tokens=noise)
    want = canvas_update_torch(sample, entropy, 0.5, vocab_size=V, noise_tokens=noise)
    assert torch.equal(got[1].cpu(), want[1].cpu()) and torch.equal(got[0].cpu(), want[0].cpu())
    assert bool(got[1].any(dim=1).all())   # the lowest entropy is always accepted


def test_update_reference_is_the_eb_rule():
    """transformers' EB-sampler (sort, cumsum − self ≤ bound, scatter) on values without ties."""
    from remask.diffusion.parts.selection import entropy_bound_accept

    entropy = torch.rand(4, 29, generator=torch.Generator().manual_seed(0))
    sample, noise = torch.arange(29).expand(4, 29), torch.full((4, 29), -1)
    out, accepted = canvas_update_torch(sample, entropy, 0.7, vocab_size=50, noise_tokens=noise)
    assert torch.equal(accepted, entropy_bound_accept(entropy, 0.7))
    assert torch.equal(out, torch.where(accepted, sample, noise))


def test_philox_renoise_is_uniform_and_seeded(triton_path):
    B, L, V = 4, 64, 7
    sample = torch.zeros(B, L, dtype=torch.long, device=DEVICE)
    entropy = torch.full((B, L), 5.0, device=DEVICE)   # only one position per row is accepted
    out, accepted = canvas_update(sample, entropy, 0.1, vocab_size=V, seed=5)
    assert accepted.sum(dim=1).tolist() == [1] * B
    drawn = out[~accepted].cpu()
    assert int(drawn.min()) >= 0 and int(drawn.max()) < V
    assert torch.bincount(drawn, minlength=V).min() > 0.5 * drawn.numel() / V
    assert torch.equal(out, canvas_update(sample, entropy, 0.1, vocab_size=V, seed=5)[0])


@pytest.mark.parametrize("path", ["triton", "torch"])
def test_a_seed_per_group_of_rows_draws_as_each_group_alone(poisoned_outputs, monkeypatch, path):
    """Requests scored in one call (`canvas_score` over their stacked rows, `canvas_update` over their canvases)
    with a seed each: every request's rows get the numbers its own call draws, whatever stands beside it."""
    if path == "triton":
        monkeypatch.setenv("REMASK_TRITON", "1")
    G, L, V = 3, 7, 1001
    logits = _logits(G * L, V, torch.float32, 5, row_pad=3)
    seeds = torch.tensor([11, 2**40 + 3, -5], dtype=torch.int64, device=DEVICE)
    together = canvas_score(logits, 0.8, seed=seeds)
    sample, entropy = together[0].view(G, L), together[2].view(G, L)
    canvas, accepted = canvas_update(sample, entropy, 0.4, vocab_size=V, seed=seeds)
    for g in range(G):
        rows = slice(g * L, (g + 1) * L)
        alone = canvas_score(logits[rows], 0.8, seed=int(seeds[g]))
        for got, want in zip(together, alone):
            assert torch.equal(got[rows].cpu(), want.cpu()), g
        alone = canvas_update(sample[g:g + 1], entropy[g:g + 1], 0.4, vocab_size=V, seed=int(seeds[g]))
        assert torch.equal(canvas[g:g + 1].cpu(), alone[0].cpu()) and torch.equal(accepted[g:g + 1], alone[1])
    assert not bool(accepted.all())   # some positions renoised: the draws are compared


@pytest.mark.parametrize("call, match", [
    (lambda: canvas_score(torch.zeros(4, 3), 1.0, seed=torch.tensor([1, 2, 3])), "seed"),
    (lambda: canvas_score(torch.zeros(4, 3), 1.0, seed=torch.tensor([1.0, 2.0])), "seed"),
    (lambda: canvas_score(torch.zeros(4, 3), 1.0, seed=2.5), "seed"),
    (lambda: canvas_update(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3), 0.1, vocab_size=5,
                           seed=torch.tensor([1])), "seed"),
    (lambda: canvas_score(torch.zeros(3), 1.0), "2-D"),
    (lambda: canvas_score(torch.zeros(2, 3, dtype=torch.long), 1.0), "dtype"),
    (lambda: canvas_score(torch.zeros(2, 3), 0.0), "temperature"),
    (lambda: canvas_score(torch.zeros(2, 3), 1.0, noise=torch.rand(2, 4)), "noise"),
    (lambda: canvas_update(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4), 0.1, vocab_size=5), "shape"),
    (lambda: canvas_update(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3), 0.0, vocab_size=5), "entropy_bound"),
    (lambda: canvas_update(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3), 0.1, vocab_size=0), "vocab_size"),
])
def test_bad_input_names_the_parameter(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()

"""The step's shared shape (`remask.diffusion.parts.step`): the fused kernels that decide and update in
one launch write exactly what `apply_decision` writes for the decision they made — commits for
mask models (`unmask`), accept + renoise for uniform-noise models (`canvas_update`)."""
from __future__ import annotations

import pytest
import torch

from remask.diffusion.parts.step import Decision, apply_decision
from remask.kernels import canvas_update, unmask


def test_unmask_is_a_commit_decision():
    g = torch.Generator().manual_seed(0)
    mask_id = 99
    x = torch.randint(0, 50, (3, 11), generator=g)
    x[:, 4:] = mask_id
    before = x.clone()
    x0 = torch.randint(0, 50, (3, 11), generator=g)
    conf = torch.rand(3, 11, generator=g)
    unmask(x, x == mask_id, x0, conf, k=torch.tensor([2, 0, 7]))
    committed = (before == mask_id) & (x != mask_id)
    assert committed.sum(1).tolist() == [2, 0, 7]
    assert torch.equal(apply_decision(before, x0, Decision(commit=committed)), x)


def test_canvas_update_is_an_accept_and_renoise_decision():
    g = torch.Generator().manual_seed(1)
    canvas = torch.randint(0, 50, (2, 9), generator=g)
    sample = torch.randint(0, 50, (2, 9), generator=g)
    noise = torch.randint(0, 50, (2, 9), generator=g)
    entropy = torch.rand(2, 9, generator=g)
    new, accepted = canvas_update(sample, entropy, 0.6, vocab_size=50, noise_tokens=noise)
    decision = Decision(commit=accepted, renoise=~accepted)
    assert torch.equal(apply_decision(canvas, sample, decision, noise), new)
    assert bool(decision.changed.all())


def test_edits_and_bad_decisions():
    tokens = torch.tensor([[5, 6, 7, 8]])
    proposal = torch.tensor([[1, 2, 3, 4]])
    decision = Decision(commit=torch.tensor([[True, False, False, False]]),
                        edit=torch.tensor([[False, False, True, False]]))
    assert apply_decision(tokens, proposal, decision).tolist() == [[1, 6, 3, 8]]
    with pytest.raises(ValueError, match="not two"):
        Decision(commit=torch.tensor([[True]]), renoise=torch.tensor([[True]]))
    with pytest.raises(ValueError, match="noise_tokens"):
        apply_decision(tokens, proposal, Decision(commit=torch.zeros(1, 4, dtype=torch.bool),
                                                  renoise=torch.ones(1, 4, dtype=torch.bool)))

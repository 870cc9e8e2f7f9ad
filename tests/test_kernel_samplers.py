"""Every sampler gives the same tokens whether it scores and commits through the Triton kernels
(REMASK_TRITON=1; interpreted on CPU) or through their torch references (REMASK_TRITON=0). The torch
path itself is held to the official code by tests/test_reference_fixtures.py."""
from __future__ import annotations

import pytest
import torch

import remask
from conftest import DEVICE
from helpers import left_pad, random_prompt
from remask.compat import fast_dllm

LLADA_CASES = [
    pytest.param(dict(steps=8, gen_length=16, block_length=8), id="semi-ar"),
    pytest.param(dict(steps=6, gen_length=12, block_length=12, cfg_scale=1.0), id="cfg"),
    pytest.param(dict(steps=4, gen_length=16, block_length=8, confidence_eos_eot_inf="corrected"), id="eos-corrected"),
    pytest.param(dict(steps=4, gen_length=16, block_length=8, confidence_eos_eot_inf=True, logits_eos_inf=True), id="eos-quirks"),
    pytest.param(dict(steps=8, gen_length=16, block_length=8, temperature=0.8, reference_rng=True), id="reference-rng"),
    pytest.param(dict(steps=8, gen_length=16, block_length=8, remasking="random"), id="random-remasking"),
]


def _on_device(*tensors):
    # on a GPU (make gpu-day) the kernels compile for real; on CPU they run under the interpreter
    return [t.to(DEVICE) for t in tensors]


def _both_paths(monkeypatch, run):
    outputs = []
    for flag in ("0", "1"):
        monkeypatch.setenv("REMASK_TRITON", flag)
        torch.manual_seed(0)
        outputs.append(run())
    return outputs


@pytest.mark.parametrize("kwargs", LLADA_CASES)
def test_llada_generate_same_tokens_through_the_kernels(monkeypatch, load_model, kwargs):
    model = load_model("llada_small").to(DEVICE)
    prompt, mask = _on_device(*left_pad([random_prompt(1, 5, 1)[0], random_prompt(1, 9, 2)[0]], pad_id=297))
    torch_out, triton_out = _both_paths(monkeypatch, lambda: remask.generate(model, prompt, mask, **kwargs))
    assert torch.equal(torch_out, triton_out)
    assert not (triton_out == 299).any()


@pytest.mark.parametrize("rule", [dict(threshold=0.3), dict(threshold=0.9), dict(factor=1.0)], ids=str)
def test_fast_dllm_same_tokens_and_nfe_through_the_kernels(monkeypatch, load_model, rule):
    model = load_model("llada_small").to(DEVICE)
    (prompt,) = _on_device(random_prompt(2, 6, 3))
    (a, nfe_a), (b, nfe_b) = _both_paths(monkeypatch, lambda: fast_dllm.generate(
        model, prompt, steps=16, gen_length=16, block_length=8, mask_id=299, **rule))
    assert torch.equal(a, b) and nfe_a == nfe_b


@pytest.mark.parametrize("alg", ["origin", "maskgit_plus", "topk_margin", "entropy", "confidence_threshold"])
def test_dream_same_tokens_through_the_kernels(monkeypatch, load_model, alg):
    model = load_model("dream_small").to(DEVICE)
    prompt, mask = _on_device(*left_pad([random_prompt(1, 4, 4)[0], random_prompt(1, 7, 5)[0]], pad_id=298))
    a, b = _both_paths(monkeypatch, lambda: remask.diffusion_generate(
        model, prompt, attention_mask=mask, max_new_tokens=12, steps=6 if alg == "confidence_threshold" else 8,
        alg=alg, threshold=0.2))
    assert torch.equal(a, b)

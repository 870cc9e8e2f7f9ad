"""EB-Sampler (`remask.EBSampler`, diffusion/methods/eb_sampler.py): one commit-rule file plus its
registry line. No official code exists (arXiv 2505.24857), so the reference is the paper's rule
written out position by position below; the rule then runs on every loop that takes `decoder=`,
the engine's tokens equal to the drop-in's."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

import remask
from remask.diffusion.methods import registry
from remask.models import get_spec, tiny
from remask.zoo import charset

from helpers import rule_on_sdar_drop_in_equals_engine


def paper_rule(block: torch.Tensor, logits: torch.Tensor, mask_id: int, gamma: float) -> torch.Tensor:
    """The block after one step, written out: per row, the masked positions by entropy (nats, the
    mask token excluded; lower index first among equals), taken while the entropies before each sum
    to at most gamma; each takes its argmax."""
    out = block.clone()
    for b in range(block.shape[0]):
        entropies = {}
        for i in range(block.shape[1]):
            if int(block[b, i]) == mask_id:
                row = logits[b, i].double().clone()
                row[mask_id] = -math.inf
                p = torch.softmax(row, dim=-1)
                entropies[i] = float(-(p[p > 0] * p[p > 0].log()).sum())
        before = 0.0
        for i in sorted(entropies, key=lambda i: (entropies[i], i)):
            if before > gamma:
                break
            row = logits[b, i].clone()
            row[mask_id] = -math.inf
            out[b, i] = int(row.argmax())
            before += entropies[i]
    return out


@pytest.mark.parametrize("seed", range(8))
def test_eb_sampler_commits_what_the_paper_rule_says(seed):
    g = torch.Generator().manual_seed(seed)
    mask = 13
    block = torch.tensor([[2, mask, mask, 5, mask, mask, mask, 1, mask], [mask] * 9, [1, 2, 3, 4, 5, 6, 7, 8, 9]])
    logits = torch.randn(3, 9, 17, generator=g) * (0.5 + seed)   # sharp to flat distributions
    logits[:, :, mask] += 4.0 * (seed % 2)                         # a likely mask token: never proposed
    kept = block.clone(), logits.clone()
    for gamma in (0.0, 0.15, 1.0, 5.0):
        commit, tokens = remask.EBSampler(gamma=gamma).commit(block, logits, mask)
        assert torch.equal(block, kept[0]) and torch.equal(logits, kept[1])       # nothing in place
        assert torch.equal(torch.where(commit, tokens, block), paper_rule(block, logits, mask, gamma))
        assert not bool((commit & (block != mask)).any()) and not bool((tokens[commit] == mask).any())
        assert bool(commit[:2].any(dim=-1).all()) and not bool(commit[2].any())  # ≥ 1 where a mask is


def test_eb_sampler_is_registered_with_its_json_name_and_checks_gamma():
    assert registry.METHODS["eb_sampler"].config is remask.EBSampler and registry.METHODS["eb_sampler"].is_rule
    params = remask.SamplingParams(max_tokens=16, block_length=8, decoder={"name": "eb_sampler", "gamma": 0.3})
    assert params.decoder == remask.EBSampler(gamma=0.3)
    with pytest.raises(ValueError, match="gamma"):
        remask.EBSampler(gamma=-0.1)


def test_eb_sampler_on_the_loops_that_take_a_rule_drop_in_equals_engine(tmp_path):
    rule = remask.EBSampler(gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = remask.load("tiny-llada")[0]          # LLaDA's block loop
        prompt = torch.tensor([charset.encode_chat("sort 52814")])
        x = remask.generate(model, prompt, gen_length=16, block_length=8, decoder=rule)
        mask = get_spec(model).mask_id
        assert torch.equal(x[:, :prompt.shape[1]], prompt) and not bool((x == mask).any())
        served = remask.LLM(model).generate([prompt[0].tolist()], remask.SamplingParams(
            max_tokens=16, block_length=8, decoder=rule), use_tqdm=False)[0]
        assert served.outputs[0].all_token_ids == x[0, prompt.shape[1]:].tolist()
        tiny.write_tiny_sdar(str(tmp_path), seed=0)    # SDAR's own loop, the rule choosing the commits
        rule_on_sdar_drop_in_equals_engine(AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval(), rule)

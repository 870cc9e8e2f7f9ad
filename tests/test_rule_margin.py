"""The margin rule (`remask.MarginDecoding`, diffusion/methods/margin.py), one `CommitRule` class in
its own file plus its registry line: every loop that takes `decoder=` runs it with no other change —
dInfer's block loop on LLaDA and Dream, SDAR's and LLaDA2's own loops, the engine and the JSON form
(docs/architecture.md, "Adding a method")."""
from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM

import remask
from remask.compat.llada2 import generate as llada2_generate
from remask.diffusion.methods import registry
from remask.diffusion.methods.margin import MarginDecoding
from remask.diffusion.parts.rules import rule_commit, rule_types
from remask.models import get_spec, tiny
from remask.zoo import charset

from helpers import random_prompt, rule_on_sdar_drop_in_equals_engine

RULE = MarginDecoding(margin=0.3)


def direct(block: torch.Tensor, logits: torch.Tensor, mask_id: int, margin: float) -> torch.Tensor:
    """The rule written out row by row: the expected tokens after one step."""
    out = block.clone()
    for b in range(block.shape[0]):
        probs = torch.softmax(logits[b].float(), dim=-1)
        probs[:, mask_id] = 0.0
        values, indices = probs.sort(dim=-1, descending=True)
        gaps = values[:, 0] - values[:, 1]
        masked = [i for i in range(block.shape[1]) if int(block[b, i]) == mask_id]
        chosen = [i for i in masked if float(gaps[i]) >= margin]
        if masked and not chosen:
            chosen = [max(masked, key=lambda i: (float(gaps[i]), -i))]
        for i in chosen:
            out[b, i] = indices[i, 0]
    return out


@pytest.mark.parametrize("seed", range(6))
def test_margin_commits_what_the_rule_says_and_nothing_in_place(seed):
    g = torch.Generator().manual_seed(seed)
    mask = 11
    block = torch.tensor([[1, mask, mask, 4, mask, mask, mask, 2], [mask] * 8])
    logits = torch.randn(2, 8, 12, generator=g) * (1 + seed)
    logits[:, :, mask] += 3.0 * (seed % 2)         # the mask token is likely: never proposed
    kept = block.clone(), logits.clone()
    commit, tokens = rule_commit(block, logits, mask, RULE)
    assert torch.equal(block, kept[0]) and torch.equal(logits, kept[1])
    assert torch.equal(torch.where(commit, tokens, block), direct(block, logits, mask, RULE.margin))
    assert bool(commit.any(dim=-1).all()) and not bool((tokens[commit] == mask).any())
    assert not bool((commit & (block != mask)).any())          # only masked positions


def test_margin_is_registered_with_its_json_name_and_checks_its_field():
    assert registry.METHODS["margin"].config is MarginDecoding and registry.METHODS["margin"].is_rule
    assert MarginDecoding in rule_types() and MarginDecoding in registry.rules()
    assert remask.SamplingParams(decoder={"name": "margin", "margin": 0.2}).decoder == MarginDecoding(margin=0.2)
    with pytest.raises(ValueError, match="margin"):
        MarginDecoding(margin=1.5)


def test_register_refuses_an_unknown_field_and_a_taken_name():
    before = dict(registry.METHODS)
    with pytest.raises(ValueError, match=r"field must be one of \('decoder', 'use_cache'\), got 'steps'"):
        registry.register("margin_twin", MarginDecoding, "steps")
    with pytest.raises(ValueError, match=r"a method named 'margin' is registered already \(MarginDecoding\)"):
        registry.register("margin", MarginDecoding)
    assert registry.METHODS == before


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for name, writer, auto in (("sdar", tiny.write_tiny_sdar, AutoModelForCausalLM),
                               ("llada2", tiny.write_tiny_llada2, AutoModelForCausalLM),
                               ("dream", tiny.write_tiny_dream, AutoModel)):
        path = tmp_path_factory.mktemp(name)
        kwargs = dict(seed=4, vocab_size=300, mask_token_id=299, eos_token_id=298, pad_token_id=298,
                      bos_token_id=298) if name == "dream" else dict(seed=0)
        writer(str(path), **kwargs)
        out[name] = auto.from_pretrained(str(path)).eval()
    out["llada"] = remask.load("tiny-llada")[0]
    return out


def no_mask_and_prompt_kept(x: torch.Tensor, prompt: torch.Tensor, mask_id: int) -> None:
    assert torch.equal(x[:, :prompt.shape[1]], prompt) and not bool((x == mask_id).any())


def test_margin_on_every_loop_that_takes_a_rule_drop_in_equals_engine(models):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # LLaDA: dInfer's block loop
        model = models["llada"]
        prompt = torch.tensor([charset.encode_chat("sort 52814")])
        x = remask.generate(model, prompt, gen_length=16, block_length=8, decoder=RULE)
        no_mask_and_prompt_kept(x, prompt, get_spec(model).mask_id)
        served = remask.LLM(model).generate([prompt[0].tolist()], remask.SamplingParams(
            max_tokens=16, block_length=8, decoder=RULE), use_tqdm=False)[0]
        assert served.outputs[0].all_token_ids == x[0, prompt.shape[1]:].tolist()
        # Dream: the same loop on shifted logits
        model, prompt = models["dream"], random_prompt(1, 7, seed=3)
        x = remask.diffusion_generate(model, prompt, max_new_tokens=16, block_length=8, decoder=RULE)
        no_mask_and_prompt_kept(x, prompt, 299)
        served = remask.LLM(model).generate([prompt[0].tolist()], remask.SamplingParams(
            max_tokens=16, block_length=8, decoder=RULE), use_tqdm=False)[0]
        assert served.outputs[0].all_token_ids == x[0, 7:].tolist()
        rule_on_sdar_drop_in_equals_engine(models["sdar"], RULE)   # SDAR: its own loop, the rule choosing the commits
        prompt = random_prompt(1, 6, seed=6, high=250)
        # LLaDA2: its own loop
        model = models["llada2"]
        out = llada2_generate(model, prompt, gen_length=12, block_length=4, decoder=RULE)
        served = remask.LLM(model).generate([prompt[0].tolist()], remask.SamplingParams(
            max_tokens=12, temperature=0.0, decoder=remask.LLaDA2Decoding(block_length=4, rule=RULE)), use_tqdm=False)[0]
        assert served.outputs[0].all_token_ids == out[0].tolist()
        assert get_spec(model).mask_id not in out[0].tolist()

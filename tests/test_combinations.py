"""Combinations no paper shipped (issue 30): dInfer's rules (and its vicinity cache) on Dream through
`diffusion_generate` and the engine; the methods that read unshifted logits refused on Dream, naming
both parts. (dInfer's rules on SDAR / LLaDA2: tests/test_rules_on_blocks.py.)"""
from __future__ import annotations

import warnings

import pytest
import torch

import remask
from remask.diffusion.decoders import decoder_steps
from remask.engine import LLMEngine, SamplingParams
from remask.models import tiny

from helpers import random_prompt

RULES = {"threshold": remask.ThresholdDecoding(threshold=0.7), "credit": remask.CreditDecoding(),
         "hierarchical": remask.HierarchicalDecoding()}


@pytest.fixture(scope="module")
def dream(tmp_path_factory):
    from transformers import AutoModel

    path = tmp_path_factory.mktemp("dream_small")
    tiny.write_tiny_dream(str(path), seed=4, vocab_size=300, mask_token_id=299, eos_token_id=298, pad_token_id=298,
                          bos_token_id=298)
    return AutoModel.from_pretrained(str(path)).eval()


def dream_tokens(model, prompt: torch.Tensor, **kwargs) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return remask.diffusion_generate(model, prompt, max_new_tokens=16, block_length=8, **kwargs)


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("vicinity", [False, True])
def test_dinfer_rules_on_dream_drop_in_equals_engine(dream, rule, vicinity):
    use_cache = remask.VicinityCache(prefix_look=2, after_look=2, warmup_steps=1) if vicinity else None
    prompt = random_prompt(1, 7, seed=3)
    stats = remask.GenerationStats()
    out = dream_tokens(dream, prompt, decoder=RULES[rule], use_cache=use_cache, stats=stats)
    assert out[0, :7].tolist() == prompt[0].tolist()                  # the prompt unchanged
    assert not (out[:, 7:] == 299).any()                              # no mask token left
    assert 1 <= stats.nfe <= 16 and all(n >= 1 for n in stats.tokens_per_step)
    served = remask.LLM(dream).generate([prompt[0].tolist()], SamplingParams(
        max_tokens=16, block_length=8, decoder=RULES[rule], use_cache=use_cache), use_tqdm=False)[0]
    assert served.outputs[0].all_token_ids == out[0, 7:].tolist()


@pytest.mark.parametrize("rule", sorted(RULES))
def test_dinfer_rules_on_dream_are_batch_invariant_and_stream_final_blocks(dream, rule):
    """Each row of a batch decodes as it does alone; what a step reports final never changes."""
    prompts = random_prompt(2, 7, seed=5)
    batch = dream_tokens(dream, prompts, decoder=RULES[rule])
    for i in range(2):
        assert batch[i].tolist() == dream_tokens(dream, prompts[i:i + 1], decoder=RULES[rule])[0].tolist()
    seen = []
    steps = decoder_steps(dream, prompts[:1], None, RULES[rule], gen_length=16, block_length=8, use_cache=None,
                          mask_id=None, stats=None)
    try:
        while True:
            progress = next(steps)
            seen.append((progress.x[0, 7:].clone(), progress.final))
    except StopIteration as stop:
        out = stop.value[0, 7:]
    assert [final for _, final in seen] == sorted(final for _, final in seen)
    for x, final in seen:    # what a step declares final (whole blocks) never changes afterwards
        assert x[:final].tolist() == out[:final].tolist()


def test_dinfer_rules_on_dream_refuse_what_they_do_not_read(dream):
    prompt = random_prompt(1, 7, seed=3)
    for kwargs, name in ((dict(temperature=0.5), "temperature"), (dict(alg="entropy"), "alg"),
                         (dict(top_p=0.9), "top_p"), (dict(steps=8), "steps")):
        with pytest.raises(ValueError, match=f"HierarchicalDecoding on Dream.*{name}"):
            dream_tokens(dream, prompt, decoder=remask.HierarchicalDecoding(), **kwargs)


@pytest.mark.parametrize("settings, part", [
    (dict(decoder=remask.WINO()), "decoder=WINO"),
    (dict(use_cache=remask.DKVCache(), steps=16), "use_cache=DKVCache"),
    (dict(use_cache=remask.D2Cache(), steps=16), "use_cache=D2Cache"),
    (dict(use_cache=remask.ElasticCache()), "use_cache=ElasticCache"),
])
def test_unshifted_methods_are_refused_on_dream_naming_both_parts(dream, settings, part):
    engine = LLMEngine(dream)
    block = {} if "use_cache" in settings and isinstance(settings["use_cache"], remask.ElasticCache) else \
        dict(block_length=8)
    with pytest.raises(ValueError, match=f"{part}.*unshifted logits.*logit_shift"):
        engine.add_request("a", random_prompt(1, 7, seed=3)[0].tolist(),
                           SamplingParams(max_tokens=16, **block, **settings))
    assert not engine.has_unfinished_requests()

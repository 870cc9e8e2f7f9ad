"""Combinations no paper shipped (issue 30): dInfer's rules (and its vicinity cache) on Dream through
`diffusion_generate` and the engine; the methods that read unshifted logits refused on Dream, naming
both parts. (dInfer's rules on SDAR / LLaDA2: tests/test_rules_on_blocks.py.)"""
from __future__ import annotations

import warnings

import pytest
import torch

import remask
import remask.diffusion.parts.rules
from remask.diffusion.methods.decoders import decoder_steps
from remask.engine import LLMEngine, SamplingParams
from remask.models import tiny
from remask.models.spec import get_spec

from helpers import as_progress, random_prompt

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
    steps = decoder_steps(get_spec(dream), prompts[:1], None, RULES[rule], gen_length=16, block_length=8,
                          use_cache=None, mask_id=None, stats=None)
    view = as_progress(steps, dream)
    try:
        while True:
            progress = next(view)
            seen.append((progress.x[0, 7:].clone(), progress.final))
    except StopIteration as stop:
        out = stop.value[0, 7:]
    assert [final for _, final in seen] == sorted(final for _, final in seen)
    for x, final in seen:    # what a step declares final (whole blocks) never changes afterwards
        assert x[:final].tolist() == out[:final].tolist()


def test_dinfer_rules_on_dream_refuse_what_they_do_not_read(dream):
    """Dream's drop-in refuses its own settings a rule does not read; `temperature` goes to the method (KLASS
    samples), and a greedy rule refuses it by name as under `remask.generate`."""
    prompt = random_prompt(1, 7, seed=3)
    for kwargs, name in ((dict(temperature=0.5), "greedy.*temperature"), (dict(alg="entropy"), "on Dream.*alg"),
                         (dict(top_p=0.9), "on Dream.*top_p"), (dict(steps=8), "on Dream.*steps")):
        with pytest.raises(ValueError, match=f"HierarchicalDecoding.*{name}"):
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


# --- Elastic-Cache's window × a commit rule (cache policy × rule) ---------------------------------

@pytest.fixture(scope="module")
def llada_small(tmp_path_factory):
    from transformers import AutoModel

    path = tmp_path_factory.mktemp("llada_small")
    tiny.write_tiny_llada(str(path), seed=3, vocab_size=300, embedding_size=300, mask_token_id=299, eos_token_id=298,
                          pad_token_id=297, eot_token_id=296)
    return AutoModel.from_pretrained(str(path)).eval()


@pytest.mark.parametrize("seed", range(4))
def test_elastic_with_the_one_best_rule_equals_elastics_own_top1_mode(llada_small, seed):
    """The rule decides the window's commits: HierarchicalDecoding with both thresholds off commits
    the single most confident masked position, which is Elastic-Cache's own top-1 mode."""
    from remask.diffusion.methods.elastic import elastic_generate

    prompt = random_prompt(1, 6, seed)
    own = elastic_generate(llada_small, prompt, config=remask.ElasticCache(window_length=8, threshold=None),
                           gen_length=24)
    ruled = elastic_generate(llada_small, prompt, config=remask.ElasticCache(window_length=8), gen_length=24,
                             rule=remask.HierarchicalDecoding(threshold=None, low_threshold=None))
    assert ruled.tolist() == own.tolist()


@pytest.mark.parametrize("rule", [remask.HierarchicalDecoding(), remask.CreditDecoding(threshold=0.3),
                                  remask.MarginDecoding(margin=0.2)], ids=lambda r: type(r).__name__)
def test_elastic_with_a_rule_drop_in_equals_engine(llada_small, rule):
    prompt = random_prompt(1, 6, seed=1)
    stats = remask.GenerationStats()
    cache = remask.ElasticCache(window_length=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = remask.generate(llada_small, prompt, gen_length=24, block_length=24, use_cache=cache, decoder=rule,
                              stats=stats)
        served = remask.LLM(llada_small).generate([prompt[0].tolist()], SamplingParams(
            max_tokens=24, use_cache=cache, decoder=rule), use_tqdm=False)[0]
    assert out[0, :6].tolist() == prompt[0].tolist() and not (out == 299).any()
    assert stats.nfe > 1 and all(n >= 1 for n in stats.tokens_per_step)
    assert served.outputs[0].all_token_ids == out[0, 6:].tolist()


def test_elastic_with_a_rule_refuses_what_it_does_not_read(llada_small):
    prompt = random_prompt(1, 6, seed=1)
    with pytest.raises(ValueError, match=r"HierarchicalDecoding replaces Elastic-Cache's commit rule.*threshold"):
        remask.generate(llada_small, prompt, gen_length=24, block_length=24,
                        use_cache=remask.ElasticCache(threshold=0.5), decoder=remask.HierarchicalDecoding())
    with pytest.raises(ValueError, match="decoder=FreeDave with use_cache=ElasticCache"):
        remask.generate(llada_small, prompt, gen_length=24, block_length=24, use_cache=remask.ElasticCache(),
                        decoder=remask.FreeDave())
    with pytest.raises(ValueError, match="decoder=ThresholdDecoding with use_cache=DKVCache"):
        remask.generate(llada_small, prompt, gen_length=24, block_length=24, use_cache=remask.DKVCache(),
                        decoder=remask.ThresholdDecoding())

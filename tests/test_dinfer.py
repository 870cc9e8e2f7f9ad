"""dInfer's decoders (threshold, credit, hierarchical) and caches (prefix, dual, vicinity) in
`remask.diffusion.methods.dinfer`, reproduced token for token (and forward for forward) against
inclusionAI/dInfer's own code and LLaDA model run on tiny checkpoints
(tests/fixtures/dinfer_reference.json; provenance in its "meta")."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
from transformers import AutoModel

from remask.diffusion.methods.dinfer import (CreditDecoding, HierarchicalDecoding, ThresholdDecoding, VicinityCache,
                                             dinfer_generate)
from remask.diffusion.parts.stats import GenerationStats
from remask.models import tiny
from helpers import margin_case

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "dinfer_reference.json")
with open(FIXTURE) as f:
    DATA = json.load(f)
CASES = {c["name"]: c for c in DATA["cases"]}
MASK, EOS = 299, 298
RULES = {"threshold": ThresholdDecoding, "credit": CreditDecoding, "hierarchy": HierarchicalDecoding}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("dinfer")
    out = {}
    for name, spec in DATA["meta"]["checkpoints"].items():
        path = str(root / name)
        assert tiny.write_tiny_llada(path, **spec["kwargs"]) == spec["digest"], f"{name}: weights differ"
        out[name] = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    return out


def _args(case):
    rule = RULES[case["decoder"]["kind"]](**{k: v for k, v in case["decoder"].items() if k != "kind"})
    cache = case["cache"]
    if isinstance(cache, dict):
        cache = VicinityCache(**cache["vicinity"])
    return dict(decoder=rule, use_cache=cache, gen_length=case["gen_length"], block_length=case["block_length"],
                early_stop=case["early_stop"])


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_dinfer(models, name):
    case = CASES[name]
    prompt = torch.tensor(case["prompt"])
    margin_case("dinfer_reference.json", case)
    stats = GenerationStats()
    out = dinfer_generate(models[case["checkpoint"]], prompt, stats=stats, **_args(case))
    assert out.shape == (prompt.shape[0], prompt.shape[1] + case["gen_length"])
    assert torch.equal(out[:, :prompt.shape[1]], prompt)
    assert not (out == MASK).any()
    if "reference_error" in case:
        # upstream loops forever (every masked position predicts the mask token); remask finishes
        assert "endless loop" in case["reference_error"]
        return
    assert out.tolist() == case["output_ids"]
    assert stats.nfe == case["num_forwards"]


def test_fixture_covers_every_rule_and_cache():
    seen = {(c["decoder"]["kind"], "vicinity" if isinstance(c["cache"], dict) else c["cache"])
            for c in DATA["cases"] if "output_ids" in c}
    assert seen == {(r, k) for r in RULES for k in (None, "prefix", "dual", "vicinity")}


@pytest.mark.parametrize("rule", [HierarchicalDecoding(), CreditDecoding(), ThresholdDecoding(0.7)])
@pytest.mark.parametrize("cache", [None, "dual", VicinityCache(8, 8, 2)])
def test_batch_equals_rows_alone(models, rule, cache):
    model = models["llada_peaked"]
    prompt = torch.randint(0, 290, (3, 9), generator=torch.Generator().manual_seed(1))
    kw = dict(decoder=rule, use_cache=cache, gen_length=32, block_length=16)
    batch = dinfer_generate(model, prompt, **kw)
    rows = torch.cat([dinfer_generate(model, prompt[i:i + 1], **kw) for i in range(3)])
    assert torch.equal(batch, rows)


@pytest.mark.parametrize("rule", [ThresholdDecoding(), HierarchicalDecoding()])
def test_early_stop_off_decodes_every_block(models, rule):
    """Upstream breaks after a block where every row has EOS even without early stop, leaving masks."""
    case = next(c for c in DATA["cases"] if c["name"] == "llada_peaked_hierarchy_prefix_p13_g48_b16")
    prompt = torch.tensor(case["prompt"])
    out = dinfer_generate(models["llada_peaked"], prompt, decoder=rule, use_cache="prefix", gen_length=48,
                          block_length=16, early_stop=False)
    assert not (out == MASK).any() and torch.equal(out[:, :13], prompt)


def test_padded_batch_keeps_prompts_and_fills_every_mask(models):
    model = models["llada_small"]
    prompt = torch.tensor([[297, 297, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    for cache in (None, "prefix", "dual", VicinityCache()):
        out = dinfer_generate(model, prompt, attention_mask=mask, decoder=CreditDecoding(), use_cache=cache,
                              gen_length=24, block_length=8)
        assert torch.equal(out[:, :5], prompt) and not (out == MASK).any()


def test_threshold_rule_is_dinfers_not_fast_dllms():
    """Within 1e-5 of the best, all are committed; mask-token predictions never are."""
    logits = torch.full((1, 4, 6), -10.0)
    logits[0, 0, [0, 1]] = 0.0                     # p = 1/2 ...
    logits[0, 1, [2, 3]] = 0.0                     # ... and exactly the same: both committed (Fast-dLLM: one)
    logits[0, 2, 5] = 5.0                          # predicts the mask token (id 5): never a candidate
    logits[0, 3, [1, 3, 4]] = 0.0                  # p = 1/3
    block = torch.full((1, 4), 5)
    _, tokens = ThresholdDecoding(threshold=0.9).commit(block, logits, 5)
    assert tokens.tolist() == [[0, 2, 5, 5]]


@pytest.mark.parametrize("make, field", [
    (lambda: ThresholdDecoding(threshold=0), "threshold"),
    (lambda: ThresholdDecoding(threshold=1.5), "threshold"),
    (lambda: CreditDecoding(credit_alpha=-1), "credit_alpha"),
    (lambda: CreditDecoding(boost_gamma=-0.1), "boost_gamma"),
    (lambda: CreditDecoding(decay_beta=1.2), "decay_beta"),
    (lambda: CreditDecoding(threshold=math.nan), "threshold"),
    (lambda: HierarchicalDecoding(low_threshold=-0.1), "low_threshold"),
    (lambda: HierarchicalDecoding(threshold="0.9"), "threshold"),
    (lambda: VicinityCache(prefix_look=-1), "prefix_look"),
    (lambda: VicinityCache(after_look=1.5), "after_look"),
    (lambda: VicinityCache(warmup_steps=-2), "warmup_steps"),
])
def test_configs_validate(make, field):
    with pytest.raises(ValueError, match=field):
        make()


@pytest.mark.parametrize("kwargs, field", [
    (dict(decoder="threshold"), "decoder"),
    (dict(use_cache="paged"), "use_cache"),
    (dict(gen_length=0), "gen_length"),
    (dict(block_length=-1), "block_length"),
    (dict(maximum_unroll=0), "maximum_unroll"),
    (dict(early_stop=1), "early_stop"),
])
def test_generate_validates(models, kwargs, field):
    with pytest.raises(ValueError, match=field):
        dinfer_generate(models["llada_small"], torch.tensor([[1, 2, 3]]), **kwargs)


def test_mask_in_prompt_refused(models):
    with pytest.raises(ValueError, match="mask token"):
        dinfer_generate(models["llada_small"], torch.tensor([[1, MASK, 3]]), gen_length=8, block_length=8)


@pytest.mark.parametrize("decoder, cache", [
    ("credit", "dual"), ("hierarchy", None), (None, "vicinity"), ("threshold", "prefix"),
])
def test_one_interface_generate_and_the_engine(decoder, cache):
    """`decoder=` / `use_cache=remask.VicinityCache(...)` in `remask.generate` and `remask.SamplingParams`
    equal `dinfer_generate`; settings dInfer's rules do not read are refused by name."""
    import warnings

    import remask
    from remask.zoo import charset

    configs = {"credit": remask.CreditDecoding(), "hierarchy": remask.HierarchicalDecoding(),
               "threshold": remask.ThresholdDecoding(threshold=0.7), None: None}
    config = configs[decoder]
    use_cache = remask.VicinityCache(prefix_look=4, after_look=4, warmup_steps=2) if cache == "vicinity" else cache
    model, _ = remask.load("tiny-llada")
    prompt = torch.tensor([charset.encode_chat("sort 52814")])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = dinfer_generate(model, prompt, decoder=config or remask.ThresholdDecoding(), gen_length=32,
                                   block_length=16, use_cache=use_cache)
        got = remask.generate(model, prompt, steps=32, gen_length=32, block_length=16, decoder=config,
                              use_cache=use_cache)
        served = remask.LLM(model).generate([prompt[0].tolist()], remask.SamplingParams(
            max_tokens=32, block_length=16, temperature=0.0, decoder=config, use_cache=use_cache), use_tqdm=False)[0]
    assert got.tolist() == expected.tolist()
    assert served.outputs[0].all_token_ids == expected[0, prompt.shape[1]:].tolist()
    with pytest.raises(ValueError, match="temperature"):
        remask.generate(model, prompt, steps=32, gen_length=32, block_length=16, temperature=0.5,
                        decoder=config or remask.ThresholdDecoding(), use_cache=use_cache)
    with pytest.raises(ValueError, match="cfg_scale"):
        remask.SamplingParams(decoder=remask.CreditDecoding(), cfg_scale=1.0)

"""Elastic-Cache: token-for-token reproduction of the official LLaDA loop
(yxu-dev/Elastic-Cache `generate_with_elastic_cache`, run with its own modified LLaDA modeling on
tiny checkpoints; see the fixture's meta), including the layer from which each step recomputed all
positions; the cache seam; rows of a batch alone; padding; the invariants and argument errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from remask.diffusion.methods.elastic import ElasticCache, ElasticKVCache, elastic_generate
from remask.diffusion.parts.stats import GenerationStats

from helpers import load_fixture_checkpoint, margin_case

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "elastic_reference.json").read_text())
MASK = 299
@pytest.fixture(scope="module")
def load(tmp_path_factory):
    return lambda name: load_fixture_checkpoint(tmp_path_factory, FIXTURE["meta"]["checkpoints"], name)


def run(model, prompt, kwargs, commit_mask_token=False, **extra):
    kw = dict(kwargs)
    gen_length, mask_id, eos_id = kw.pop("gen_length"), kw.pop("mask_id"), kw.pop("eos_id")
    return elastic_generate(model, prompt, config=ElasticCache(**kw, commit_mask_token=commit_mask_token),
                            gen_length=gen_length, mask_id=mask_id, eos_id=eos_id, **extra)


def expected(case) -> list[int]:
    """Upstream's row with its masks after the first EOS returned as EOS (remask's choice)."""
    row, P, eos = list(case["output_ids"][0]), len(case["prompt"][0]), case["kwargs"]["eos_id"]
    if eos in row[P:]:
        first = row.index(eos, P)
        row[first:] = [eos if t == MASK else t for t in row[first:]]
    return row


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=[c["name"] for c in FIXTURE["cases"]])
def test_reproduces_the_official_elastic_cache(load, case):
    margin_case("elastic_reference.json", case)
    model = load(case["checkpoint"])
    prompt = torch.tensor(case["prompt"])
    trace: list = []
    x = run(model, prompt, case["kwargs"], commit_mask_token=True, trace=trace)
    assert x.tolist() == [expected(case)]
    assert [layer for _, layer in trace] == case["first_recomputed_layer"] and len(trace) == case["nfe"]
    if case["default_differs"]:
        assert MASK in case["output_ids"][0][prompt.shape[1]:]     # upstream committed a mask token
    x = run(model, prompt, case["kwargs"])
    assert not bool((x == MASK).any()) and torch.equal(x[:, :prompt.shape[1]], prompt)
    if not case["default_differs"]:
        assert x.tolist() == [expected(case)]


def test_fixture_covers_the_rule():
    cases = FIXTURE["cases"]
    layers = [layer for c in cases for layer in c["first_recomputed_layer"][1:]]
    deep = [layer for c in cases if c["checkpoint"] == "llada_deep" for layer in c["first_recomputed_layer"][1:]]
    assert {1, 2, 3, 4} <= set(deep) and {1, 2} <= set(layers)   # recomputes from each layer, and none
    assert any(c["kwargs"]["eos_id"] in c["output_ids"][0][len(c["prompt"][0]):] for c in cases)
    assert {c["kwargs"]["block_caching"] for c in cases} == {True, False}
    assert any(c["kwargs"]["threshold"] is None for c in cases)


def test_seam_unchanged_tokens_keep_the_cache(load):
    """After a full pass, re-querying positions whose tokens did not change reproduces the full
    forward's logits and never triggers a recompute (old and new attention agree)."""
    model = load("llada_deep")
    x = torch.tensor([[5, 17, 42, 99, 7, 8, MASK, MASK, MASK, MASK, MASK, MASK]])
    blocks = model.model.transformer.blocks
    cfg = model.config
    from remask.models.layers import ForwardPositions, rope_cos_sin

    def forward(cache, query, full):
        h = model.model.transformer.wte(x[:, query])
        cos, sin = rope_cos_sin(query[None], cfg.head_dim, cfg.rope_theta)
        for layer, block in enumerate(blocks):
            cache.plan(full=full, query=query, track=query[:2], window=query[-3:], masked=torch.arange(6, 12),
                       gamma=0.999, track_num=1)
            h = block(h, ForwardPositions(cache, 0, cos, sin, 12), None)
        return model.model.transformer.ff_out(model.model.transformer.ln_f(h))

    with torch.no_grad():
        full = model(x).logits
        cache = ElasticKVCache()
        torch.testing.assert_close(forward(cache, torch.arange(12), True), full, rtol=1e-4, atol=1e-4)
        query = torch.tensor([0, 3, 6, 7, 8])
        part = forward(cache, query, False)
    assert not cache.triggered and cache.nbytes > 0 and set(cache.track) == {0, 1, 2, 3}
    torch.testing.assert_close(part, full[:, query], rtol=1e-4, atol=1e-4)
    with pytest.raises(RuntimeError, match="plan"):
        cache.attend(0, *(torch.zeros(1, 4, 1, 8),) * 3, 0, None)


def test_batch_rows_alone_and_stats(load):
    model = load("llada_deep")
    prompts = torch.tensor([[5, 17, 42, 99, 7, 8], [200, 3, 77, 150, 12, 9], [1, 2, 3, 4, 5, 6]])
    kwargs = dict(gen_length=40, window_length=8, threshold=0.9, gamma=0.99, track_num=2, block_caching=True,
                  mask_id=None, eos_id=None)
    stats, trace = GenerationStats(), []
    x = run(model, prompts, kwargs, stats=stats, trace=trace)
    steps = 0
    for b in range(3):
        row_trace: list = []
        assert torch.equal(x[b], run(model, prompts[b:b + 1], kwargs, trace=row_trace)[0])
        steps += len(row_trace)
    assert not bool((x == MASK).any()) and torch.equal(x[:, :6], prompts)
    assert stats.nfe == steps == len(trace) and sum(stats.tokens_per_step) == 3 * 40
    assert stats.forward_positions < steps * 46 and stats.kv_cache_bytes > 0
    assert any(0 < layer < 4 for _, layer in trace)


def test_eos_drops_the_tail(load):
    """The first EOS committed ends the generation: later masked positions are returned as EOS."""
    case = next(c for c in FIXTURE["cases"] if c["name"] == "llada_small-eos_w8_thr7")
    x = run(load(case["checkpoint"]), torch.tensor(case["prompt"]), case["kwargs"])
    eos, P = case["kwargs"]["eos_id"], len(case["prompt"][0])
    assert x[0, P].item() == eos and bool((x[0, P + 1:] != MASK).all()) and (x[0, P:] == eos).sum() > 1


def test_config_and_argument_errors(load):
    for field, value in (("window_length", 0), ("threshold", 1.5), ("threshold", 0.0), ("gamma", 2.0),
                         ("track_num", 0), ("block_caching", 1), ("tokens_per_iter", 0), ("commit_mask_token", "y")):
        with pytest.raises((ValueError, TypeError), match=field):
            ElasticCache(**{field: value})
    ElasticCache(threshold=None, gamma=1.0)
    model = load("llada_small")
    p = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="gen_length"):
        elastic_generate(model, p, gen_length=0)
    with pytest.raises(ValueError, match="config"):
        elastic_generate(model, p, gen_length=8, config={"window_length": 4})
    with pytest.raises(ValueError, match="mask token"):
        elastic_generate(model, torch.tensor([[1, MASK]]), gen_length=8)
    with pytest.raises(ValueError, match="eos_id"):
        elastic_generate(model, p, gen_length=8, eos_id=10_000)
    with pytest.raises(ValueError, match="Elastic-Cache takes a commit rule"):
        elastic_generate(model, p, gen_length=8, rule=ElasticCache())



def test_other_model_kinds_are_refused(load_model):
    """Elastic-Cache does its work between LLaDA's layers (`ElasticLayers`, through LLaDA's attend seam): a
    Dream model, whose spec says `kind="dream"`, is refused by name before any forward."""
    with pytest.raises(ValueError, match="elastic_generate drives LLaDA's layers; got a dream model"):
        elastic_generate(load_model("dream_small"), torch.tensor([[1, 2, 3]]), gen_length=8)

def test_left_padded_rows_decode(load):
    """Pad keys are hidden (upstream has no mask); an all-ones mask is the same as none."""
    model = load("llada_small_peaked")
    prompt = torch.tensor([[297, 297, 5, 17, 42, 99], [200, 3, 77, 150, 12, 9]])
    kwargs = dict(gen_length=24, window_length=8, threshold=0.9, gamma=0.99, track_num=1, block_caching=True,
                  mask_id=None, eos_id=None)
    x = run(model, prompt, kwargs, attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]))
    assert not bool((x == MASK).any()) and torch.equal(x[:, :6], prompt)
    assert torch.equal(run(model, prompt, kwargs, attention_mask=torch.ones_like(prompt)), run(model, prompt, kwargs))
    assert not torch.equal(x[0], run(model, prompt, kwargs)[0])   # the pads were hidden
    assert torch.equal(x[1], run(model, prompt, kwargs)[1])


def test_one_interface_generate_and_the_engine():
    """`use_cache=remask.ElasticCache(...)` in `remask.generate` and `remask.SamplingParams` equals
    `elastic_generate`; blocks (it decodes over a sliding window) and a decoder are refused by name."""
    import warnings

    import remask
    from remask.zoo import charset

    model, _ = remask.load("tiny-llada")
    prompt = torch.tensor([charset.encode_chat("rev abcdef")])
    cache = remask.ElasticCache(window_length=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = elastic_generate(model, prompt, config=cache, gen_length=32)
        got = remask.generate(model, prompt, steps=32, gen_length=32, block_length=32, use_cache=cache)
        served = remask.LLM(model).generate([prompt[0].tolist()], remask.SamplingParams(
            max_tokens=32, temperature=0.0, use_cache=cache), use_tqdm=False)[0]
    assert got.tolist() == expected.tolist()
    assert served.outputs[0].all_token_ids == expected[0, prompt.shape[1]:].tolist()
    with pytest.raises(ValueError, match="block_length"):
        remask.generate(model, prompt, steps=32, gen_length=32, block_length=16, use_cache=cache)
    with pytest.raises(ValueError, match="decoder"):
        remask.generate(model, prompt, steps=32, gen_length=32, block_length=32, use_cache=cache,
                        decoder=remask.FreeDave())

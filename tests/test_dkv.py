"""dKV-Cache-Decode: token-for-token reproduction of the official LLaDA decode with its delayed
cache (horseee/dKV-Cache, run with its own modified LLaDA modeling on tiny checkpoints; see the
fixture's meta), the cache seam, rows of a batch alone, and the invariants."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from remask.diffusion.methods.dkv import DelayedKVCache, DKVCache, dkv_generate
from remask.diffusion.parts.stats import GenerationStats

from helpers import load_fixture_checkpoint, margin_case

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "dkv_reference.json").read_text())
MASK = 299
@pytest.fixture(scope="module")
def load(tmp_path_factory):
    return lambda name: load_fixture_checkpoint(tmp_path_factory, FIXTURE["meta"]["checkpoints"], name)


def run(model, prompt, kwargs, seed=0, commit_mask_token=False, **extra):
    return dkv_generate(model, prompt, config=DKVCache(cache_reloading_step=kwargs["cache_reloading_step"],
                                                       commit_mask_token=commit_mask_token),
                        steps=kwargs["steps"], gen_length=kwargs["gen_length"], block_length=kwargs["block_length"],
                        remasking=kwargs["remasking"], generator=torch.Generator().manual_seed(seed), **extra)


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=[c["name"] for c in FIXTURE["cases"]])
def test_reproduces_the_official_dkv_cache_decode(load, case):
    margin_case("dkv_reference.json", case)
    model = load(case["checkpoint"])
    prompt = torch.tensor(case["prompt"])
    x = run(model, prompt, case["kwargs"], case["seed"], commit_mask_token=True)
    assert x.tolist() == case["output_ids"]
    if case["default_differs"]:
        assert any(MASK in row for row in case["output_ids"])     # upstream returns a mask token
        x = run(model, prompt, case["kwargs"], case["seed"])
        assert not bool((x == MASK).any()) and torch.equal(x[:, :prompt.shape[1]], prompt)


def test_cached_forward_equals_full_forward_on_fresh_cache(load):
    """fill() then reuse() on the same tokens: the forwarded positions' logits are the full forward's."""
    model = load("llada_small")
    x = torch.tensor([[5, 17, 42, 99, 7, 8, 30, 31, MASK, MASK, MASK, MASK]])
    store = x != MASK
    store[0, 7] = False      # a decoded position left uncached (the delay)
    with torch.no_grad():
        full = model(x).logits
        cache = DelayedKVCache()
        cache.fill(store)
        filled = model(x, past_key_values=cache, position_ids=torch.arange(12)[None]).logits
        cache.finish()
        torch.testing.assert_close(filled, full, rtol=0, atol=0)
        forwarded = ~store
        cache.reuse(forwarded, forwarded | store)
        part = model(x[forwarded][None], past_key_values=cache, position_ids=forwarded.nonzero()[:, 1][None]).logits
        cache.finish()
    torch.testing.assert_close(part, full[forwarded][None], rtol=1e-5, atol=1e-5)
    assert bool(cache.cached.all()) and cache.k[0].shape[2] == 12
    # every position not forwarded must be cached (dKV-Greedy's cache holds all; Decode's the rest)
    partial = DelayedKVCache()
    partial.cached = store
    with pytest.raises(RuntimeError, match="must be cached"):
        partial.reuse(forwarded & (torch.arange(12) != 7)[None], store)


def test_batch_rows_alone_and_savings(load):
    model = load("llada_small_peaked")
    prompts = torch.tensor([[5, 17, 42, 99, 7, 8], [200, 3, 77, 150, 12, 9]])
    kwargs = dict(steps=32, gen_length=32, block_length=16, cache_reloading_step=4, remasking="low_confidence")
    stats = GenerationStats()
    x = run(model, prompts, kwargs, stats=stats)
    for b in range(2):
        assert torch.equal(x[b], run(model, prompts[b:b + 1], kwargs)[0])
    assert not bool((x == MASK).any()) and torch.equal(x[:, :6], prompts)
    assert stats.nfe == 32 and stats.forward_positions < 32 * 2 * 38 and stats.kv_cache_bytes > 0


def test_config_and_argument_errors(load):
    with pytest.raises(ValueError, match="cache_reloading_step"):
        DKVCache(cache_reloading_step=0)
    with pytest.raises((ValueError, TypeError), match="commit_mask_token"):
        DKVCache(commit_mask_token="yes")
    model = load("llada_small")
    p = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="remasking"):
        dkv_generate(model, p, steps=16, gen_length=16, block_length=16, remasking="entropy")
    with pytest.raises(ValueError, match="steps"):
        dkv_generate(model, p, steps=15, gen_length=32, block_length=16)
    with pytest.raises(ValueError, match="block_length"):
        dkv_generate(model, p, steps=16, gen_length=24, block_length=16)
    with pytest.raises(ValueError, match="mask token"):
        dkv_generate(model, torch.tensor([[1, MASK]]), steps=16, gen_length=16, block_length=16)
    with pytest.raises(RuntimeError, match=r"call fill\(\) or reuse\(\)"):   # the cache told nothing
        DelayedKVCache().attend(0, *[torch.zeros(1, 2, 3, 4)] * 3, 0, None)


def test_left_padded_rows_decode(load):
    """Pad keys are hidden (upstream has no mask); an all-ones mask is the same as none."""
    model = load("llada_small_peaked")
    prompt = torch.tensor([[297, 297, 5, 17, 42, 99], [200, 3, 77, 150, 12, 9]])
    kwargs = dict(steps=16, gen_length=16, block_length=16, cache_reloading_step=4, remasking="low_confidence")
    x = run(model, prompt, kwargs, attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]))
    assert not bool((x == MASK).any()) and torch.equal(x[:, :6], prompt)
    assert torch.equal(run(model, prompt, kwargs, attention_mask=torch.ones_like(prompt)), run(model, prompt, kwargs))
    assert not torch.equal(x[0], run(model, prompt, kwargs)[0])   # the pads were hidden


def test_one_interface_generate_and_the_engine():
    """`use_cache=remask.DKVCache(...)` in `remask.generate` (LLaDA's own schedule: `steps`,
    `remasking`) and `remask.SamplingParams` equals `dkv_generate`; a decoder with it is refused."""
    import warnings

    import remask
    from remask.zoo import charset

    model, _ = remask.load("tiny-llada")
    prompt = torch.tensor([charset.encode_chat("sort 52814")])
    cache = remask.DKVCache(cache_reloading_step=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = dkv_generate(model, prompt, config=cache, steps=16, gen_length=32, block_length=16)
        got = remask.generate(model, prompt, steps=16, gen_length=32, block_length=16, use_cache=cache)
        served = remask.LLM(model).generate([prompt[0].tolist()], remask.SamplingParams(
            max_tokens=32, steps=16, block_length=16, temperature=0.0, use_cache=cache), use_tqdm=False)[0]
    assert got.tolist() == expected.tolist()
    assert served.outputs[0].all_token_ids == expected[0, prompt.shape[1]:].tolist()
    with pytest.raises(ValueError, match="decoder"):
        remask.generate(model, prompt, steps=16, gen_length=32, block_length=16, use_cache=cache,
                        decoder=remask.CreditDecoding())
    with pytest.raises(ValueError, match="threshold"):
        remask.generate(model, prompt, steps=16, gen_length=32, block_length=16, use_cache=cache, threshold=0.9)

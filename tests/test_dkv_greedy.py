"""dKV-Cache-Greedy: token-for-token reproduction of the official LLaDA greedy loop with its
immediate cache and window (horseee/dKV-Cache `llada_dkv_cache_greedy.py` with its own modeling,
run on tiny checkpoints; fixture meta), the same seed giving the same order, batches, and the
interface (`remask.DKVCache(variant="greedy", window_size=...)`)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import remask
from remask.diffusion.methods.dkv import DKVCache, _window, dkv_generate
from remask.diffusion.parts.stats import GenerationStats

from helpers import load_fixture_checkpoint, margin_case

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "dkv_greedy_reference.json").read_text())
MASK = 299


@pytest.fixture(scope="module")
def load(tmp_path_factory):
    return lambda name: load_fixture_checkpoint(tmp_path_factory, FIXTURE["meta"]["checkpoints"], name)


def run(model, prompt, kwargs, seed=0, commit_mask_token=False, reload=None, **extra):
    config = DKVCache(cache_reloading_step=kwargs["cache_reloading_step"] if reload is None else reload,
                      commit_mask_token=commit_mask_token, variant="greedy",
                      window_size=kwargs["window_size"] if reload is None else 0)
    return dkv_generate(model, prompt, config=config, steps=kwargs["steps"], gen_length=kwargs["gen_length"],
                        block_length=kwargs["block_length"], remasking="random",
                        generator=torch.Generator().manual_seed(seed), **extra)


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=[c["name"] for c in FIXTURE["cases"]])
def test_reproduces_the_official_dkv_cache_greedy(load, case):
    margin_case("dkv_greedy_reference.json", case)
    model = load(case["checkpoint"])
    prompt = torch.tensor(case["prompt"])
    x = run(model, prompt, case["kwargs"], case["seed"], commit_mask_token=True)
    assert x.tolist() == case["output_ids"]
    default = run(model, prompt, case["kwargs"], case["seed"])
    assert not bool((default == MASK).any()) and torch.equal(default[:, :prompt.shape[1]], prompt)
    assert (default.tolist() != case["output_ids"]) == case["default_differs"]


def test_the_cache_decides_tokens_and_saves_positions(load):
    """Every step full (cache_reloading_step=1) is plain LLaDA with the random order: most fixture
    cases differ from it, so the cached forwards decide the tokens; they compute fewer positions."""
    model = load("llada_small")
    differ = 0
    for case in FIXTURE["cases"]:
        if case["kwargs"]["cache_reloading_step"] > 1 and case["checkpoint"] == "llada_small":
            full = run(model, torch.tensor(case["prompt"]), case["kwargs"], case["seed"], commit_mask_token=True,
                       reload=1)
            differ += full.tolist() != case["output_ids"]
    assert differ >= 3
    prompt = torch.tensor([[5, 17, 42, 99, 7, 8]])
    kwargs = dict(steps=32, gen_length=32, block_length=16, cache_reloading_step=4, window_size=2)
    cached, plain = GenerationStats(), GenerationStats()
    run(model, prompt, kwargs, stats=cached)
    run(model, prompt, kwargs, reload=1, stats=plain)
    assert cached.nfe == plain.nfe == 32 and cached.forward_positions < 0.5 * plain.forward_positions


def test_batch_rows_alone_and_left_padding(load):
    model = load("llada_small_peaked")
    prompts = torch.tensor([[5, 17, 42, 99, 7, 8], [200, 3, 77, 150, 12, 9]])
    kwargs = dict(steps=32, gen_length=32, block_length=16, cache_reloading_step=3, window_size=2)
    # a row's order comes from its own row of the per-block uniforms: seeded alone by its draws
    g = torch.Generator().manual_seed(0)
    x = dkv_generate(model, prompts, config=DKVCache(cache_reloading_step=3, variant="greedy", window_size=2),
                     steps=32, gen_length=32, block_length=16, remasking="random", generator=g)
    assert not bool((x == MASK).any()) and torch.equal(x[:, :6], prompts)
    assert torch.equal(x, run(model, prompts, kwargs))      # same seed, same tokens
    padded = torch.tensor([[297, 297, 5, 17, 42, 99], [200, 3, 77, 150, 12, 9]])
    y = run(model, padded, kwargs, attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]))
    assert not bool((y == MASK).any()) and torch.equal(y[:, :6], padded)


def test_window_takes_the_nearest_masks_alternating():
    chosen = torch.zeros(10, dtype=torch.bool)
    masked = torch.ones(10, dtype=torch.bool)
    masked[3] = False
    chosen[5] = True
    _window(chosen, [5], masked, 3)
    assert chosen.nonzero().squeeze(1).tolist() == [4, 5, 6, 7]   # left 4, right 6, left 3 (decoded) skipped, right 7
    edge = torch.zeros(4, dtype=torch.bool)
    edge[0] = True
    _window(edge, [0], torch.ones(4, dtype=torch.bool), 10)       # runs out of positions: stops
    assert bool(edge.all())


def test_config_errors_and_the_interface(load):
    with pytest.raises(ValueError, match="variant"):
        DKVCache(variant="eager")
    with pytest.raises(ValueError, match="window_size"):
        DKVCache(window_size=2)                          # a window is Greedy's
    with pytest.raises(ValueError, match="window_size"):
        DKVCache(variant="greedy", window_size=-1)
    model = load("llada_small")
    p = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="remasking"):
        dkv_generate(model, p, config=DKVCache(variant="greedy"), steps=16, gen_length=16, block_length=16)
    cache = remask.DKVCache(cache_reloading_step=2, variant="greedy", window_size=2)
    expected = dkv_generate(model, p, config=cache, steps=16, gen_length=16, block_length=16, remasking="random",
                            generator=torch.Generator().manual_seed(5))
    got = remask.generate(model, p, steps=16, gen_length=16, block_length=16, use_cache=cache, remasking="random",
                          generator=torch.Generator().manual_seed(5))
    assert got.tolist() == expected.tolist()
    params = remask.SamplingParams(max_tokens=16, steps=16, block_length=16, temperature=0.0, remasking="random",
                                   use_cache={"name": "dkv", "variant": "greedy", "cache_reloading_step": 2,
                                              "window_size": 2})
    assert params.use_cache == cache

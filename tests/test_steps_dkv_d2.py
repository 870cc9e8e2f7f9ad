"""The step generators of dKV-Cache (LLaDA decode and greedy, Dream) and d2Cache (issue 30): one
forward at most per `next()`, a yield per forward, the drop-in function's tokens, `Progress.final`
monotone and true, and the arguments checked when the generator is made."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from remask.diffusion.methods.d2cache import D2Cache, d2cache_generate, d2cache_steps
from remask.diffusion.methods.dkv import DKVCache, dkv_generate, dkv_steps
from remask.diffusion.methods.dkv import dkv_dream_generate, dkv_dream_steps
from remask.diffusion.parts.stats import GenerationStats
from remask.diffusion.parts.stepper import Progress, StepwiseDecoder, step_alone
from remask.models import tiny
from remask.models.spec import get_spec

from helpers import as_progress, load_fixture_checkpoint

FIXTURES = Path(__file__).parent / "fixtures"
LLADA_CHECKPOINTS = json.loads((FIXTURES / "dkv_reference.json").read_text())["meta"]["checkpoints"]
DREAM_CHECKPOINTS = json.loads((FIXTURES / "dkv_dream_reference.json").read_text())["meta"]["checkpoints"]
LLADA_MASK, DREAM_MASK = 299, 8191

P1 = torch.tensor([[228, 136, 117, 52, 162, 15, 11, 13, 277, 4, 195, 110]])
P2 = torch.tensor([[228, 136, 117, 52, 162, 15, 11, 13, 277, 4, 195, 110],
                   [68, 32, 130, 60, 253, 230, 5, 17, 42, 99, 7, 8]])
DREAM_P1 = torch.tensor([[5, 17, 300, 42, 99, 1000, 7]])
DREAM_P2 = torch.tensor([[5, 17, 300, 42, 99, 1000, 7], [2000, 3, 77, 150, 12, 9, 4000]])


@pytest.fixture(scope="module")
def llada(tmp_path_factory):
    return lambda name: load_fixture_checkpoint(tmp_path_factory, LLADA_CHECKPOINTS, name)


@pytest.fixture(scope="module")
def dream(tmp_path_factory):
    from transformers import AutoModel

    ck = DREAM_CHECKPOINTS["dream"]
    path = str(tmp_path_factory.mktemp("steps_dream"))
    assert getattr(tiny, ck["writer"])(path, **ck["kwargs"]) == ck["digest"], "the tiny writer changed"
    return AutoModel.from_pretrained(path, dtype=torch.float32).eval()


def step_through(model, steps, prompt_len: int, gen_length: int):
    """Drive `steps` by hand: forwards per `next()`, the yields, the finals and the canvases."""
    calls = []
    hook = model.register_forward_hook(lambda *_: calls.append(1))
    seen: list[tuple[int, torch.Tensor]] = []
    view = as_progress(steps, model)
    try:
        while True:
            before = len(calls)
            try:
                progress = next(view)
            except StopIteration as stop:
                assert len(calls) == before, "a forward between the last yield and the return"
                out = stop.value
                break
            assert isinstance(progress, Progress)
            assert len(calls) - before <= 1, "more than one forward in one step"
            assert progress.x.shape[1] == prompt_len + gen_length
            seen.append((progress.final, progress.x.clone()))
    finally:
        hook.remove()
    return out, seen, len(calls)


def check(model, make, reference, prompt_len: int, gen_length: int, mask_id: int):
    """`make(stats)` a step generator; `reference()` the drop-in call's output."""
    stats = GenerationStats()
    out, seen, forwards = step_through(model, make(stats), prompt_len, gen_length)
    expected = reference()
    assert torch.equal(out, expected)
    assert len(seen) >= stats.nfe and len(seen) == forwards and stats.nfe > 0
    last = 0
    for final, x in seen:
        assert last <= final <= gen_length
        last = final
        assert torch.equal(x[:, prompt_len:prompt_len + final], out[:, prompt_len:prompt_len + final])
        assert not bool((x[:, prompt_len:prompt_len + final] == mask_id).any())
    return seen, forwards, stats


DKV_SETTINGS = [
    ("decode_low_confidence", dict(config=DKVCache(cache_reloading_step=4), steps=32, gen_length=32,
                                   block_length=16, remasking="low_confidence")),
    ("decode_random_commit_mask", dict(config=DKVCache(cache_reloading_step=4, commit_mask_token=True), steps=32,
                                       gen_length=32, block_length=16, remasking="random")),
    ("greedy_window", dict(config=DKVCache(cache_reloading_step=3, variant="greedy", window_size=2), steps=32,
                           gen_length=32, block_length=16, remasking="random")),
]


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("name,kw", DKV_SETTINGS, ids=[s[0] for s in DKV_SETTINGS])
def test_dkv_steps(llada, batch, name, kw):
    model = llada("llada_small")
    prompt = P1 if batch == 1 else P2
    seen, forwards, stats = check(
        model, lambda stats: dkv_steps(get_spec(model), prompt, generator=torch.Generator().manual_seed(3), stats=stats,
                                       **kw),
        lambda: dkv_generate(model, prompt, generator=torch.Generator().manual_seed(3), **kw),
        prompt.shape[1], kw["gen_length"], LLADA_MASK)
    assert forwards >= kw["steps"]
    if not kw["config"].commit_mask_token:
        # blocks are final when decoded: the first block's after its last step
        assert [f for f, _ in seen].count(0) >= kw["steps"] // 2 - 1 and seen[-1][0] == kw["gen_length"]
        assert any(f == kw["block_length"] for f, _ in seen)


def test_dkv_steps_row_by_row_forwards(llada):
    """commit_mask_token leaves one row a mask more: its rows are forwarded one by one, each its own
    yield (more forwards than steps), still the drop-in call's tokens."""
    model = llada("llada_small")
    kw = dict(config=DKVCache(cache_reloading_step=4, commit_mask_token=True), steps=32, gen_length=32,
              block_length=16, remasking="random")
    split = False
    for seed in range(6):
        _, forwards, _ = check(
            model, lambda stats: dkv_steps(get_spec(model), P2, generator=torch.Generator().manual_seed(seed),
                                           stats=stats, **kw),
            lambda: dkv_generate(model, P2, generator=torch.Generator().manual_seed(seed), **kw),
            P2.shape[1], 32, LLADA_MASK)
        split |= forwards > kw["steps"]
    greedy = dict(config=DKVCache(cache_reloading_step=4, variant="greedy", window_size=3), steps=32, gen_length=32,
                  block_length=32, remasking="random")
    _, forwards, _ = check(
        model, lambda stats: dkv_steps(get_spec(model), P2, generator=torch.Generator().manual_seed(0), stats=stats,
                                       **greedy),
        lambda: dkv_generate(model, P2, generator=torch.Generator().manual_seed(0), **greedy),
        P2.shape[1], 32, LLADA_MASK)
    split |= forwards > greedy["steps"]
    assert split, "no setting forwarded rows one by one"


def test_dkv_steps_padded(llada):
    model = llada("llada_small_peaked")
    prompt = torch.tensor([[0, 0, 68, 32, 130, 60], [1, 2, 3, 4, 5, 6]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
    kw = dict(config=DKVCache(cache_reloading_step=2), steps=16, gen_length=16, block_length=8,
              attention_mask=mask)
    check(model, lambda stats: dkv_steps(get_spec(model), prompt, stats=stats, **kw),
          lambda: dkv_generate(model, prompt, **kw), 6, 16, LLADA_MASK)


def test_dkv_stepwise_decoder_equals_generate(llada):
    model = llada("llada_small")
    kw = dict(config=DKVCache(cache_reloading_step=4), steps=16, gen_length=32, block_length=16,
              remasking="random")
    decoder = StepwiseDecoder(lambda p, g, s: dkv_steps(get_spec(model), p, generator=g, stats=s, **kw), gen_length=32)
    state, stats = decoder.start(P1), GenerationStats()
    finals = []
    while not state.done:
        step_alone(decoder, model, state, torch.Generator().manual_seed(1) if state.steps is None else None, stats)
        finals.append(decoder.num_final(state))
    assert torch.equal(state.x, dkv_generate(model, P1, generator=torch.Generator().manual_seed(1), **kw))
    assert finals == sorted(finals) and 16 in finals and stats.nfe == 16


DREAM_CONFIGS = [DKVCache(cache_reloading_step=4, cache_type="decoded", shift_type="un_right"),
                 DKVCache(cache_reloading_step=3, cache_type="decoded"), DKVCache(cache_type="prefill")]


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("config", DREAM_CONFIGS, ids=["un_right", "un", "prefill"])
def test_dkv_dream_steps(dream, batch, config):
    prompt = DREAM_P1 if batch == 1 else DREAM_P2
    kw = dict(config=config, steps=12, max_new_tokens=12, alg="maskgit_plus")
    seen, forwards, _ = check(dream, lambda stats: dkv_dream_steps(get_spec(dream), prompt, stats=stats, **kw),
                              lambda: dkv_dream_generate(dream, prompt, **kw), prompt.shape[1], 12, DREAM_MASK)
    assert forwards >= 12 and all(f == 0 for f, _ in seen)   # one block: final only at the end


def test_dkv_dream_steps_origin_generator(dream):
    """alg='origin' draws from the generator: the same draws stepwise as in the drop-in call."""
    kw = dict(config=DKVCache(cache_reloading_step=3, cache_type="decoded"), steps=12, max_new_tokens=12,
              alg="origin")
    check(dream, lambda stats: dkv_dream_steps(get_spec(dream), DREAM_P2, generator=torch.Generator().manual_seed(5),
                                               stats=stats, **kw),
          lambda: dkv_dream_generate(dream, DREAM_P2, generator=torch.Generator().manual_seed(5), **kw),
          DREAM_P2.shape[1], 12, DREAM_MASK)


D2_SETTINGS = [
    ("one_block", dict(config=D2Cache(current_k=8, inflate_w=4), steps=16, gen_length=16, block_length=16)),
    ("blocks_no_prior", dict(config=D2Cache(current_k=8), steps=16, gen_length=32, block_length=16,
                             prior_sigma=None)),
]


@pytest.mark.parametrize("independent_rows", [True, False])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("name,kw", D2_SETTINGS, ids=[s[0] for s in D2_SETTINGS])
def test_d2cache_steps(llada, batch, independent_rows, name, kw):
    if batch == 1 and not independent_rows:
        pytest.skip("the same path as independent_rows=True for one row")
    model = llada("llada_small_peaked")
    prompt = P1 if batch == 1 else P2
    kw = dict(kw, independent_rows=independent_rows)
    seen, forwards, _ = check(model, lambda stats: d2cache_steps(get_spec(model), prompt, stats=stats, **kw),
                              lambda: d2cache_generate(model, prompt, **kw), prompt.shape[1], kw["gen_length"],
                              LLADA_MASK)
    per_row = kw["gen_length"] // (kw["gen_length"] // kw["steps"])
    assert forwards >= per_row * (batch if independent_rows else 1)
    if kw["block_length"] < kw["gen_length"]:
        assert any(0 < f < kw["gen_length"] for f, _ in seen)


def test_d2cache_steps_padded(llada):
    model = llada("llada_small")
    prompt = torch.tensor([[0, 0, 68, 32, 130, 60], [1, 2, 3, 4, 5, 6]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
    for independent_rows in (True, False):
        kw = dict(steps=16, gen_length=16, block_length=8, attention_mask=mask, independent_rows=independent_rows)
        check(model, lambda stats: d2cache_steps(get_spec(model), prompt, stats=stats, **kw),
              lambda: d2cache_generate(model, prompt, **kw), 6, 16, LLADA_MASK)


def test_bad_arguments_raise_when_the_generator_is_made(llada, dream):
    model = llada("llada_small")
    calls = []
    hooks = [m.register_forward_hook(lambda *_: calls.append(1)) for m in (model, dream)]
    try:
        for kw, match in ((dict(steps=15, gen_length=32, block_length=16), "steps"),
                          (dict(steps=16, gen_length=24, block_length=16), "gen_length"),
                          (dict(remasking="entropy"), "remasking"),
                          (dict(config=DKVCache(variant="greedy")), "remasking"),
                          (dict(config=DKVCache(shift_type="un")), "shift_type"),
                          (dict(config="decode"), "config")):
            with pytest.raises(ValueError, match=match):
                dkv_steps(get_spec(model), P1, **{**dict(steps=16, gen_length=16, block_length=16), **kw})
        with pytest.raises(ValueError):
            dkv_steps(get_spec(model), torch.tensor([[1, LLADA_MASK]]), steps=16, gen_length=16, block_length=16)
        for kw, match in ((dict(temperature=0.5), "temperature"), (dict(alg="confidence_threshold"), "alg"),
                          (dict(max_new_tokens=0), "max_new_tokens"), (dict(config=DKVCache(variant="greedy")),
                                                                       "variant")):
            with pytest.raises(ValueError, match=match):
                dkv_dream_steps(get_spec(dream), DREAM_P1, **{**dict(steps=4, max_new_tokens=4), **kw})
        with pytest.raises(ValueError, match="logit_shift"):
            dkv_dream_steps(get_spec(model), P1, steps=4, max_new_tokens=4)
        for kw, match in ((dict(steps=5), "steps"), (dict(gen_length=24), "gen_length"),
                          (dict(prior_sigma=0.0), "prior_sigma"), (dict(config=object()), "config")):
            with pytest.raises(ValueError, match=match):
                d2cache_steps(get_spec(model), P2, **{**dict(steps=16, gen_length=16, block_length=16), **kw})
        with pytest.raises(ValueError, match="llada|LLaDA"):
            d2cache_steps(get_spec(dream), DREAM_P1, steps=16, gen_length=16, block_length=16)
    finally:
        for hook in hooks:
            hook.remove()
    assert not calls

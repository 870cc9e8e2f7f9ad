"""dKV-Cache for Dream: token-for-token reproduction of the official Dream `_sample` with its cache
(horseee/dKV-Cache `generation_utils/dream_generation_utils.py` with its `models/modeling_dream.py`,
run unmodified on tiny Dream checkpoints; see the fixture's meta), the cache's effect, rows of a
batch alone, the invariants and the configuration checks."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import remask
from remask.diffusion.methods.dkv import DKVCache, dkv_generate
from remask.diffusion.methods.dkv import dkv_dream_generate
from remask.diffusion.parts.stats import GenerationStats
from remask.models import tiny

from helpers import load_fixture_checkpoint, margin_case

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "dkv_dream_reference.json").read_text())
MASK = 8191


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import AutoModel

    root = tmp_path_factory.mktemp("dkv_dream_checkpoints")
    out = {}
    for name, ck in FIXTURE["meta"]["checkpoints"].items():
        path = str(root / name)
        assert getattr(tiny, ck["writer"])(path, **ck["kwargs"]) == ck["digest"], "the tiny writer changed"
        out[name] = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    return out


def config_of(kw) -> DKVCache:
    if kw["cache_type"] == "prefill":
        return DKVCache(cache_type="prefill")
    return DKVCache(cache_reloading_step=kw["cache_steps"], cache_type="decoded", shift_type=kw["shift_type"])


def run(model, case, config=None, **extra):
    kw = case["kwargs"]
    prompt = torch.tensor(case["prompt"])
    mask = None if case["attention_mask"] is None else torch.tensor(case["attention_mask"])
    torch.manual_seed(case["seed"])   # alg="origin" draws from the global generator, as upstream
    return dkv_dream_generate(model, prompt, mask, config=config_of(kw) if config is None else config,
                              steps=kw["steps"], max_new_tokens=kw["max_new_tokens"], alg=kw["alg"], alg_temp=0.0,
                              temperature=0.0, top_p=kw["top_p"], top_k=kw["top_k"], **extra)


CASES = {c["name"]: c for c in FIXTURE["cases"]}


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=list(CASES))
def test_reproduces_the_official_dkv_cache_dream(models, case):
    margin_case("dkv_dream_reference.json", case)
    assert run(models[case["checkpoint"]], case).tolist() == case["output_ids"]


def test_cache_changes_tokens_and_reload_every_step_is_no_cache(models):
    """The cached forwards change the tokens (so the fixture can fail), and with
    cache_reloading_step=1 every forward is a full one: remask's Dream sampler's tokens."""
    differ = 0
    for name, case in CASES.items():
        if case["attention_mask"] is not None or case["kwargs"]["alg"] == "origin":
            continue
        kw = case["kwargs"]
        torch.manual_seed(case["seed"])
        plain = remask.diffusion_generate(models[case["checkpoint"]], torch.tensor(case["prompt"]),
                                          max_new_tokens=kw["max_new_tokens"], steps=kw["steps"], alg=kw["alg"],
                                          temperature=0.0, top_p=kw["top_p"], top_k=kw["top_k"])
        if case["kwargs"]["cache_type"] == "decoded" and case["kwargs"]["cache_steps"] == 1:
            assert plain.tolist() == case["output_ids"], name
        else:
            differ += plain.tolist() != case["output_ids"]
    assert differ >= 10


def test_batch_rows_alone_invariants_and_savings(models):
    """Rows of a batch decode as alone (un_right: rows cache different counts, forwarded row by row)."""
    model = models["dream"]
    prompts = torch.tensor([[5, 17, 300, 42, 99, 1000, 7], [2000, 3, 77, 150, 12, 9, 4000]])
    for config in (DKVCache(cache_reloading_step=4, cache_type="decoded", shift_type="un_right"),
                   DKVCache(cache_reloading_step=3, cache_type="decoded"), DKVCache(cache_type="prefill")):
        stats = GenerationStats()
        x = dkv_dream_generate(model, prompts, config=config, steps=20, max_new_tokens=20, alg="maskgit_plus",
                               stats=stats)
        for b in range(2):
            alone = dkv_dream_generate(model, prompts[b:b + 1], config=config, steps=20, max_new_tokens=20,
                                       alg="maskgit_plus")
            assert torch.equal(x[b], alone[0]), config
        assert not bool((x == MASK).any()) and torch.equal(x[:, :7], prompts)
        assert stats.nfe >= 20 and stats.forward_positions < 20 * 2 * 27 and stats.kv_cache_bytes > 0


def test_padded_rows_equal_unpadded(models):
    model = models["dream"]
    row = torch.tensor([[5, 17, 300, 42, 99]])
    padded = torch.tensor([[8190, 8190, 5, 17, 300, 42, 99], [1, 2, 3, 4, 5, 6, 7]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7])
    config = DKVCache(cache_reloading_step=4, cache_type="decoded")
    kw = dict(config=config, steps=16, max_new_tokens=16, alg="entropy")
    x = dkv_dream_generate(model, padded, mask, **kw)
    assert torch.equal(x[0, 2:], dkv_dream_generate(model, row, **kw)[0])


def test_config_validation(models):
    for bad, field in ((dict(cache_type="full"), "cache_type"), (dict(shift_type="left"), "shift_type"),
                       (dict(cache_type="prefill", shift_type="un"), "shift_type"),
                       (dict(variant="greedy", cache_type="decoded"), "cache_type"),
                       (dict(commit_mask_token=True, shift_type="un"), "commit_mask_token"),
                       (dict(cache_reloading_step=0, cache_type="decoded"), "cache_reloading_step")):
        with pytest.raises(ValueError, match=field):
            DKVCache(**bad)
    model, prompt = models["dream"], torch.tensor([[5, 17, 300]])
    kw = dict(steps=4, max_new_tokens=4)
    for config, field in ((DKVCache(variant="greedy"), "variant"),
                          (DKVCache(commit_mask_token=True), "commit_mask_token")):
        with pytest.raises(ValueError, match=field):
            dkv_dream_generate(model, prompt, config=config, **kw)
    for extra, field in ((dict(temperature=0.5), "temperature"), (dict(alg="confidence_threshold"), "alg"),
                         (dict(max_new_tokens=0), "max_new_tokens"), (dict(steps=0), "steps")):
        with pytest.raises(ValueError, match=field):
            dkv_dream_generate(model, prompt, config=DKVCache(cache_type="decoded"), **{**kw, **extra})
    with pytest.raises(ValueError, match="config"):
        dkv_dream_generate(model, prompt, config="decoded", **kw)
    with pytest.raises(ValueError, match="input_ids|mask"):
        dkv_dream_generate(model, torch.tensor([[5, MASK, 3]]), **kw)


def test_dream_fields_refused_for_llada(tmp_path_factory):
    llada_fixture = json.loads((Path(__file__).parent / "fixtures" / "dkv_reference.json").read_text())
    checkpoints = llada_fixture["meta"]["checkpoints"]
    llada = load_fixture_checkpoint(tmp_path_factory, checkpoints, "llada_small")
    prompt = torch.tensor([[5, 17, 42]])
    with pytest.raises(ValueError, match="shift_type"):
        dkv_generate(llada, prompt, config=DKVCache(shift_type="un"), steps=4, gen_length=4, block_length=4)
    with pytest.raises(ValueError, match="logit_shift"):
        dkv_dream_generate(llada, prompt, config=DKVCache(cache_type="decoded"), steps=4, max_new_tokens=4)


def test_steps_outlasting_the_masks_finish_instead_of_crashing(models):
    """More steps than generated positions with the decoded cache: once every position is decoded
    (and cached a step later) a step has nothing to forward; such a step commits nothing (it used to
    index the empty forward and crash) and the request finishes with every position decoded."""
    model = next(iter(models.values()))
    prompt = torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(0))
    config = DKVCache(cache_type="decoded", cache_reloading_step=1000)
    for seed in range(5):
        out = dkv_dream_generate(model, prompt, config=config, steps=40, max_new_tokens=3, alg="origin",
                                 generator=torch.Generator().manual_seed(seed))
        assert out.shape == (2, 8) and torch.equal(out[:, :5], prompt) and not (out == MASK).any()

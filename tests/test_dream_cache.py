"""Fast-dLLM's Dream block decoder (`generation_utils_block.py`) with prefix / dual / paged KV cache.

`fixtures/dream_cache_reference.json` holds token ids and forward counts produced by the upstream
block decoder (Fast-dLLM `dream/model/generation_utils_block.py` + its `modeling_dream.py`, run with
`trust_remote_code` under transformers 4.49) on tiny random Dream checkpoints — see
docs/reference-fixtures.md.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

import remask
from helpers import left_pad, margin_case, random_prompt
from remask.compat.fast_dllm import dream_diffusion_generate
from remask.models import tiny
from remask.caches import PagedKVCache
from remask.zoo import charset, tasks

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "dream_cache_reference.json")
with open(FIXTURE) as f:
    DATA = json.load(f)


@pytest.fixture(scope="module")
def reference_models(tmp_path_factory):
    from transformers import AutoModel

    root = tmp_path_factory.mktemp("dream_cache_checkpoints")
    out = {}
    for name, spec in DATA["checkpoints"].items():
        path = str(root / name)
        assert tiny.write_tiny_dream(path, seed=spec["seed"], **spec["overrides"]) == spec["digest"], name
        out[name] = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    return out


def _case_id(case):
    kw = case["kw"]
    return (f"{case['ckpt']}-p{case['prompt']}-{kw['alg']}-" + ("dual" if kw.get("dual_cache") else "prefix")
            + "".join(f"-{k}{kw[k]}" for k in ("threshold", "steps", "block_length") if k in kw))


@pytest.mark.parametrize("case", DATA["cases"], ids=_case_id)
def test_reproduces_fast_dllm_dream_block_decoder(case, reference_models):
    margin_case("dream_cache_reference.json", case)
    model = reference_models[case["ckpt"]]
    prompt = torch.tensor([DATA["prompts"][case["ckpt"]][case["prompt"]]])
    kw = dict(case["kw"])
    stats = remask.GenerationStats()
    if case["has_mask"]:
        # Upstream leaves a one-step block's masks in the output; finish_blocks=False reproduces it.
        out = dream_diffusion_generate(model, prompt, finish_blocks=False, stats=stats, **kw)
        assert out[0, prompt.shape[1]:].tolist() == case["tokens"] and stats.nfe == case["nfe"]
        fixed = dream_diffusion_generate(model, prompt, **kw)
        assert not (fixed == model.config.mask_token_id).any()
        return
    out = dream_diffusion_generate(model, prompt, stats=stats, **kw)
    assert out[0, prompt.shape[1]:].tolist() == case["tokens"] and stats.nfe == case["nfe"]


def test_fixture_covers_parallel_commits_and_both_caches():
    multi = [c for c in DATA["cases"] if c["kw"]["alg"] == "confidence_threshold"
             and c["nfe"] < c["kw"]["max_new_tokens"]]
    assert multi, "no case commits several tokens in one step"
    assert {c["kw"].get("dual_cache", False) for c in DATA["cases"]} == {False, True}
    assert {c["kw"]["alg"] for c in DATA["cases"]} >= {"confidence_threshold", "entropy"}


@pytest.fixture(scope="module")
def tiny_llada():
    return remask.load("tiny-llada")[0]


@pytest.mark.parametrize("alg,extra", [("confidence_threshold", dict(threshold=0.9)), ("entropy", {})])
def test_cache_modes_agree_on_a_trained_model(alg, extra, tiny_llada):
    # The block decoder on a LLaDA-format model (no logit shift): a confident trained model gives
    # the same tokens with a full forward every step, the prefix cache, the dual cache and pages.
    for problem in tasks.problems(7, tasks.EVAL_SEED):
        prompt = torch.tensor([charset.encode_chat(problem.prompt)])
        outs = {mode: remask.diffusion_generate(tiny_llada, prompt, max_new_tokens=16, steps=16, alg=alg,
                                                block_length=8, use_cache=mode, **extra)
                for mode in (None, "prefix", "dual", "paged")}
        for mode, out in outs.items():
            assert torch.equal(out, outs[None]), (problem.prompt, mode)


@pytest.mark.parametrize("alg", ["confidence_threshold", "entropy"])
def test_dream_paged_equals_dual(alg, load_model):
    model = load_model("dream_small")
    for seed in range(3):
        prompt = random_prompt(1, 4 + seed, seed)
        kw = dict(max_new_tokens=12, steps=12, alg=alg, threshold=0.05, block_length=4)
        dual = remask.diffusion_generate(model, prompt, use_cache="dual", **kw)
        paged = remask.diffusion_generate(model, prompt, use_cache=PagedKVCache(page_size=3), **kw)
        assert torch.equal(paged, dual), seed


@pytest.mark.parametrize("use_cache", ["prefix", "dual", "paged"])
@pytest.mark.parametrize("alg", ["confidence_threshold", "entropy"])
def test_dream_left_padded_rows_equal_solo_rows(use_cache, alg, load_model):
    # Upstream breaks batches (row 0's selection for all rows, no padding mask with a cache,
    # absolute positions for padded rows); remask decodes each row as it would alone.
    model = load_model("dream_small")
    prompts = [random_prompt(1, n, seed)[0] for n, seed in ((5, 1), (8, 2), (3, 3))]
    ids, mask = left_pad(prompts, pad_id=298)
    kw = dict(max_new_tokens=8, steps=8, alg=alg, threshold=0.05, block_length=4, use_cache=use_cache)
    batch = remask.diffusion_generate(model, ids, attention_mask=mask, **kw)
    for i, p in enumerate(prompts):
        solo = remask.diffusion_generate(model, p[None], **kw)
        assert torch.equal(batch[i, ids.shape[1]:], solo[0, p.shape[0]:]), (i, use_cache, alg)


def test_block_decoder_counts_forwards_and_positions(load_model):
    model = load_model("dream_small")
    prompt = random_prompt(1, 6, 0)
    T = 6 + 8
    seen = {}
    for mode in (None, "prefix", "dual"):
        stats = remask.GenerationStats()
        remask.diffusion_generate(model, prompt, max_new_tokens=8, steps=8, alg="entropy", block_length=4,
                                  use_cache=mode, stats=stats)
        # Per block: the block-start forward commits the first token, then 3 steps on the schedule.
        assert stats.nfe == 8 and stats.tokens_per_step[0] == 1 and sum(stats.tokens_per_step) == 8
        seen[mode] = stats.forward_positions
    assert seen[None] == 8 * T
    assert seen["prefix"] == 2 * T + 3 * (8 + 4)     # block 0 feeds 8 positions, block 1 feeds 4
    assert seen["dual"] == 2 * T + 2 * 3 * 4


def test_one_step_blocks_are_finished(load_model):
    model = load_model("dream_small")
    prompt = random_prompt(1, 5, 0)
    kw = dict(max_new_tokens=8, steps=2, alg="entropy", block_length=4, use_cache="dual")
    stats = remask.GenerationStats()
    out = remask.diffusion_generate(model, prompt, stats=stats, **kw)
    assert not (out == 299).any() and stats.nfe == 4
    left = remask.diffusion_generate(model, prompt, finish_blocks=False, **kw)
    assert int((left == 299).sum()) == 2 * 3   # upstream: 3 masks left in each of the 2 blocks


@pytest.mark.parametrize("kwargs,match", [
    (dict(use_cache="pages"), "use_cache must be one of"),
    (dict(use_cache="dual", block_length=5), "divisible by block_length"),
    (dict(use_cache="dual", block_length=4, steps=3), "steps"),
    (dict(use_cache="dual", block_length=0), "block_length must be an int >= 1"),
    (dict(use_cache="dual", generation_tokens_hook_func=lambda s, x, l: x), "not supported by the block decoder"),
])
def test_block_decoder_argument_errors(kwargs, match, load_model):
    kw = {**dict(max_new_tokens=8, steps=8, alg="entropy"), **kwargs}
    with pytest.raises(ValueError, match=match):
        remask.diffusion_generate(load_model("dream_small"), random_prompt(1, 4, 0), **kw)

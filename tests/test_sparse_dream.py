"""`remask.diffusion_generate(..., sparse=SparseConfig(...))`: Sparse-dLLM's and SparseD's Dream samplers.

`fixtures/sparse_dream_reference.json` holds token ids from OpenMOSS/Sparse-dLLM's Dream sampler
(`opencompass/models/sparse_dllm/dream/`, retention) and INV-WZQ/SparseD's (`models/Dream/`, block
masks), run unmodified on tiny random Dream checkpoints (docs/reference-fixtures.md).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

import remask
from helpers import left_pad, margin_case, random_prompt
from remask.models import tiny

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "sparse_dream_reference.json")
with open(FIXTURE) as f:
    DATA = json.load(f)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import AutoModel

    root = tmp_path_factory.mktemp("sparse_dream_checkpoints")
    out = {}
    for name, ck in DATA["checkpoints"].items():
        path = str(root / name)
        assert tiny.write_tiny_dream(path, seed=ck["seed"], **ck["overrides"]) == ck["digest"], name
        out[name] = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    return out


def _config(case) -> remask.SparseConfig:
    if case["method"] == "retention":
        return remask.SparseConfig(retention_ratio=case["keep_ratio"], pool_kernel=case["kernel"], delay_step=1)
    return remask.SparseConfig(method="block_mask", retention_ratio=case["select"], skip_fraction=case["skip"],
                               kv_block_size=case["block_size"])


def _run(model, case, **kw):
    prompt = torch.tensor([DATA["prompts"][case["ckpt"]][case["prompt"]]])
    if case["method"] == "retention":
        kw.setdefault("block_length", case["block"])
    out = remask.diffusion_generate(model, prompt, max_new_tokens=case["gen"], steps=case["steps"], alg=case["alg"],
                                    temperature=0.0, **kw)
    return out[0, prompt.shape[1]:].tolist()


def _case_id(case):
    if case["method"] == "retention":
        detail = f"g{case['gen']}b{case['block']}s{case['steps']}-r{case['keep_ratio']}-k{case['kernel']}"
    else:
        detail = f"g{case['gen']}s{case['steps']}-bs{case['block_size']}-sel{case['select']}-skip{case['skip']}"
    return f"{case['method']}-{case['ckpt']}-p{case['prompt']}-{case['alg']}-{detail}"


@pytest.mark.parametrize("case", DATA["cases"], ids=_case_id)
def test_reproduces_the_official_dream_samplers(case, models):
    margin_case("sparse_dream_reference.json", case)
    model = models[case["ckpt"]]
    tokens = _run(model, case, sparse=_config(case))
    if case["has_mask"]:
        # upstream's argmax may commit the mask token of a random checkpoint; remask never does
        mask_id = model.config.mask_token_id
        assert mask_id not in tokens
        assert all(a == b for a, b in zip(tokens, case["tokens"]) if b != mask_id)
        return
    assert tokens == case["tokens"]


def test_fixture_cases_differ_from_dense(models):
    """The fixture can fail: on most cases sparse attention changes the tokens."""
    differs = {"retention": 0, "block_mask": 0}
    for case in DATA["cases"][::4]:
        dense = _run(models[case["ckpt"]], case)
        differs[case["method"]] += dense != case["tokens"]
    assert differs["retention"] >= 3 and differs["block_mask"] >= 3, differs


@pytest.mark.parametrize("sparse", [remask.SparseConfig(retention_ratio=0.3),
                                    remask.SparseConfig(retention_ratio=0.5, head_select=True, pool_kernel=None),
                                    remask.SparseConfig(method="block_mask", retention_ratio=0.3, kv_block_size=4)],
                         ids=["retention", "head_select", "block_mask"])
def test_invariants(load_model, sparse):
    model = load_model("dream_small")
    prompt = random_prompt(2, 20, 7)
    kw = dict(max_new_tokens=16, steps=16, alg="entropy", sparse=sparse)
    if sparse.method == "retention":
        kw["block_length"] = 8
    out = remask.diffusion_generate(model, prompt, **kw)
    mask_id = model.config.mask_token_id
    assert out.shape == (2, 36) and torch.equal(out[:, :20], prompt)
    assert not (out == mask_id).any()
    for row in range(2):   # rows of a batch decode as alone
        alone = remask.diffusion_generate(model, prompt[row:row + 1], **kw)
        assert torch.equal(alone[0], out[row])
    again = remask.diffusion_generate(model, prompt, **kw)
    assert torch.equal(again, out)
    sampled = [remask.diffusion_generate(model, prompt, temperature=0.7, generator=torch.Generator().manual_seed(3),
                                         **kw) for _ in range(2)]
    assert torch.equal(sampled[0], sampled[1])


def test_retention_left_padded_rows_equal_rows_alone(load_model):
    model = load_model("dream_small")
    rows = [random_prompt(1, 9, 3)[0], random_prompt(1, 14, 4)[0]]
    ids, mask = left_pad(rows, pad_id=298)
    kw = dict(max_new_tokens=16, steps=16, alg="maskgit_plus", block_length=8,
              sparse=remask.SparseConfig(retention_ratio=0.5), reference_ties=False)
    batch = remask.diffusion_generate(model, ids, attention_mask=mask, **kw)
    for i, row in enumerate(rows):
        alone = remask.diffusion_generate(model, row[None], **kw)
        assert torch.equal(batch[i, -16:], alone[0, -16:])


def test_keeping_everything_is_dense(models):
    """Retention 1.0 selected at the block start keeps every key: Fast-dLLM's dual cache (frozen
    K/V outside the block), token for token; block masks keeping every block are dense decoding."""
    model = models["dream"]
    prompt = torch.tensor([DATA["prompts"]["dream"][1]])
    kw = dict(max_new_tokens=16, steps=8, alg="entropy", temperature=0.0)
    retained = remask.diffusion_generate(model, prompt, block_length=8, sparse=remask.SparseConfig(
        retention_ratio=1.0, delay_step=0, pool_kernel=None), **kw)
    dual = remask.diffusion_generate(model, prompt, block_length=8, use_cache="dual", **kw)
    # the dual cache scores its counts by negative entropy, as does alg="entropy"
    assert torch.equal(retained, dual)
    full = remask.diffusion_generate(model, prompt, sparse=remask.SparseConfig(
        method="block_mask", retention_ratio=1.0, skip_fraction=0.0, kv_block_size=4), **kw)
    assert torch.equal(full, remask.diffusion_generate(model, prompt, **kw))


@pytest.mark.parametrize("kw, match", [
    (dict(sparse="yes"), "sparse"),
    (dict(sparse=remask.SparseConfig(), use_cache="dual"), "use_cache"),
    (dict(sparse=remask.SparseConfig(), alg="origin"), "origin"),
    (dict(sparse=remask.SparseConfig(block_len=4), block_length=8), "block_len"),
    (dict(sparse=remask.SparseConfig(), block_length=6), "block_length"),
    (dict(sparse=remask.SparseConfig(method="block_mask"), block_length=8), "block_length"),
    (dict(sparse=remask.SparseConfig(method="block_mask"), use_cache="prefix"), "use_cache"),
    (dict(sparse=remask.SparseConfig(), decoder=remask.FreeDave()), "decoder"),
])
def test_refused_combinations(load_model, kw, match):
    model = load_model("dream_small")
    with pytest.raises(ValueError, match=match):
        remask.diffusion_generate(model, random_prompt(1, 6, 0), max_new_tokens=16, steps=16,
                                  **{"alg": "entropy", **kw})


def test_block_mask_refuses_padding(load_model):
    model = load_model("dream_small")
    ids, mask = left_pad([random_prompt(1, 4, 3)[0], random_prompt(1, 7, 4)[0]], pad_id=298)
    with pytest.raises(ValueError, match="attention_mask"):
        remask.diffusion_generate(model, ids, attention_mask=mask, max_new_tokens=8, steps=8, alg="entropy",
                                  sparse=remask.SparseConfig(method="block_mask"))

"""Token-for-token reproduction of the official implementations.

The fixtures in `fixtures/reference_tokens.json` are token ids produced by running the official
code (ML-GSAI/LLaDA `generate.py` with the official LLaDA remote code, NVlabs/Fast-dLLM v1
`generate`, Dream's `diffusion_generate` and Fast-dLLM's `confidence_threshold`) on the tiny
checkpoints named in the file — see docs/reference-fixtures.md. Only ids are stored.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModel

import remask
from remask.compat import fast_dllm
from remask.models import tiny
from helpers import margin_case

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "reference_tokens.json")
WRITERS = {"llada": tiny.write_tiny_llada, "dream": tiny.write_tiny_dream}

with open(FIXTURES) as f:
    DATA = json.load(f)


@pytest.fixture(scope="module")
def reference_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("reference_checkpoints")
    cache = {}

    def get(name):
        if name not in cache:
            spec = DATA["checkpoints"][name]
            path = os.path.join(root, name)
            digest = WRITERS[spec["builder"]](path, seed=spec["seed"], shards=spec.get("shards", 1),
                                              **spec.get("overrides", {}))
            assert digest == spec["digest"], f"checkpoint {name}: weights differ from those the fixtures were made with"
            cache[name] = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
        return cache[name]

    return get


def _run(case, model):
    prompt = torch.tensor(case["prompt"], dtype=torch.long)
    mask = None if case.get("attention_mask") is None else torch.tensor(case["attention_mask"], dtype=torch.long)
    kwargs = dict(case["kwargs"])
    if case.get("seed") is not None:
        torch.manual_seed(case["seed"])
    if kwargs.get("temperature", 0) > 0 and case["api"] != "dream_diffusion_generate":
        kwargs["reference_rng"] = True  # the reference's torch noise stream (Dream samples with torch anyway)
    if case["api"] == "llada_generate":
        return remask.generate(model, prompt, mask, **kwargs), None, None
    if case["api"] == "fastdllm_generate":
        x, nfe = fast_dllm.generate(model, prompt, **kwargs)
        return x, nfe, None
    if case["api"] == "dream_diffusion_generate":
        out = remask.diffusion_generate(model, prompt, attention_mask=mask, **kwargs)
        if kwargs.get("return_dict_in_generate"):
            return out.sequences, None, out.history
        return out, None, None
    raise AssertionError(f"unknown api {case['api']}")


def _mask_id(case, model):
    return case["kwargs"].get("mask_id", case["kwargs"].get("mask_token_id", remask.get_spec(model).mask_id))


@pytest.mark.parametrize("case", DATA["cases"], ids=[c["id"] for c in DATA["cases"]])
def test_reproduces_reference(reference_model, case):
    margin_case("reference_tokens.json", case)
    model = reference_model(case["checkpoint"])
    output, nfe, history = _run(case, model)
    mask_id = _mask_id(case, model)
    broken_rows = [i for i, row in enumerate(case["output"]) if mask_id in row]
    if broken_rows:
        # The reference committed the mask token itself and left it in its output; remask's default
        # fix (docs/quirks.md) never chooses the mask token. The other rows must still be identical.
        assert not (output == mask_id).any()
        for i, row in enumerate(case["output"]):
            if i not in broken_rows:
                assert output[i].tolist() == row
            assert output[i, :len(case["prompt"][i])].tolist() == case["prompt"][i]
        return
    assert output.tolist() == case["output"]
    if case.get("nfe") is not None:
        assert nfe == case["nfe"]
    if case.get("history") is not None:
        assert [h.tolist() for h in history] == case["history"]

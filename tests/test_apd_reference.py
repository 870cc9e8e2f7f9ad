"""APD reproduces danielmisrael/apd `apd_sample` token for token.

`fixtures/apd_reference.json`: token ids, acceptance counts and forward counts from the reference
(danielmisrael/apd `dream/generation_utils.py` + its `modeling_dream.py`, commit a555561, run with
`trust_remote_code` under transformers 4.49, float32, CPU) on the tiny Dream + Qwen2 pair of
`apd_reference.py` (weights rebuilt here and checked by digest) — docs/reference-fixtures.md.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

import remask
from apd_reference import DREAMS, EOS, MASK, build_verifier, write_dream
from helpers import margin_case

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "apd_reference.json")
with open(FIXTURE) as f:
    DATA = json.load(f)
CASES = [c for c in DATA["cases"] if c["kw"].get("apd_mixture_weight") is not None]   # not the leftright mode


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import AutoModel

    root = tmp_path_factory.mktemp("apd_checkpoints")
    out = {}
    for name in DREAMS:
        assert write_dream(str(root / name), name) == DATA["checkpoints"][name]["digest_edited"], name
        out[name] = AutoModel.from_pretrained(str(root / name), dtype=torch.float32).eval()
    verifier, digest = build_verifier(str(root / "dream_apd"))
    assert digest == DATA["checkpoints"]["verifier"]["digest_edited"]
    out["verifier"] = verifier
    return out


def _case_id(case):
    kw = case["kw"]
    return (f"{case['case']}-{case['group']}-R{kw['apd_mixture_weight']}-W{kw['kv_window']}-M{kw['max_lookahead']}"
            f"-T{kw['temperature']}")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_reproduces_apd_sample(case, models):
    margin_case("apd_reference.json", case)
    kw = case["kw"]
    prompt = torch.tensor([DATA["prompts"][case["prompt"]]])
    apd = remask.APDConfig(models["verifier"], mixture_weight=kw["apd_mixture_weight"], kv_window=kw["kv_window"],
                           max_lookahead=kw["max_lookahead"])
    stats, verifier_stats = remask.GenerationStats(), remask.GenerationStats()
    if case["seed"] is not None:
        torch.manual_seed(case["seed"])   # the reference's float64 draft noise comes from torch's global stream
    out = remask.diffusion_generate(models[case["ckpt"]], prompt, max_new_tokens=kw["max_new_tokens"],
                                    temperature=kw["temperature"], top_p=kw["top_p"], top_k=kw["top_k"], apd=apd,
                                    stats=stats, verifier_stats=verifier_stats)
    generated = out[0, prompt.shape[1]:].tolist()
    ref = case["tokens"]
    assert stats.tokens_per_step == case["acceptance_counts"]
    assert stats.nfe == case["nfe_dllm"] and verifier_stats.nfe == case["nfe_verifier"]
    if case["has_mask"]:
        # Upstream stopped at an EOS and returned the unreached positions as masks; remask fills EOS.
        reached = sum(case["acceptance_counts"])
        assert generated[:reached] == ref[:reached] and all(t == MASK for t in ref[reached:])
        assert all(t == EOS for t in generated[reached:])
    else:
        assert generated == ref

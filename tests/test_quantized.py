"""Quantized weights (torchao int8 weight-only through transformers, on CPU): every sampler and the
engine run on them, keep the invariants, and the engine's tokens equal the samplers' alone."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchao")

import remask  # noqa: E402
from remask.engine import LLMEngine, SamplingParams  # noqa: E402
from remask.zoo import charset, tasks  # noqa: E402

PROBLEMS = [charset.encode_chat(p.prompt) for p in tasks.problems(12, tasks.EVAL_SEED)]


@pytest.fixture(scope="module")
def int8():
    llada, tokenizer = remask.load("tiny-llada", quantization="int8")
    ar, ar_tokenizer = remask.load("tiny-ar", quantization="int8")
    return llada, tokenizer, ar, ar_tokenizer


def test_weights_are_int8(int8):
    llada, _, ar, _ = int8
    for model in (llada, ar):
        kinds = {name: type(m.weight).__name__ for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        # every projection of the blocks; the output head stays in float (transformers' default)
        blocks = {name: kind for name, kind in kinds.items() if ".layers." in name or ".blocks." in name}
        assert blocks and all(kind == "Int8Tensor" for kind in blocks.values()), kinds
    with pytest.raises(ValueError, match="quantization"):
        remask.load("tiny-llada", quantization="int3")
    with pytest.raises(ValueError, match="quantization"):
        remask.LLM(llada, quantization="int8")


@pytest.mark.parametrize("kw", [dict(), dict(threshold=0.9), dict(factor=1.0), dict(use_cache="prefix"),
                                dict(use_cache="dual", threshold=0.9), dict(use_cache="paged"),
                                dict(temperature=0.7), dict(cfg_scale=1.0),
                                dict(sparse=remask.SparseConfig(retention_ratio=0.5))])
def test_every_block_sampler_runs_on_int8(int8, kw):
    model = int8[0]
    prompt = torch.tensor([PROBLEMS[0]])
    runs = [remask.generate(model, prompt, steps=16, gen_length=16, block_length=8,
                            generator=torch.Generator().manual_seed(1), **kw) for _ in range(2)]
    assert torch.equal(runs[0], runs[1])                       # same seed, same tokens
    assert torch.equal(runs[0][:, :prompt.shape[1]], prompt)   # the prompt unchanged
    assert not (runs[0] == charset.MASK_ID).any()


def test_dream_sampler_apd_and_ar_run_on_int8(int8):
    llada, _, ar, _ = int8
    prompt = torch.tensor([PROBLEMS[1]])
    out = remask.diffusion_generate(llada, prompt, max_new_tokens=16, steps=16, alg="entropy")
    assert not (out == charset.MASK_ID).any()
    apd = remask.generate(llada, prompt, gen_length=16, apd=remask.APDConfig(ar, 0.7, kv_window=4, max_lookahead=8))
    assert not (apd == charset.MASK_ID).any()
    greedy = remask.ar_generate(ar, prompt, max_new_tokens=8)
    assert torch.equal(greedy[:, :prompt.shape[1]], prompt)


def test_engine_on_int8_equals_the_samplers_alone(int8):
    llada, tokenizer, ar, ar_tokenizer = int8
    kinds = [dict(), dict(threshold=0.9), dict(use_cache="dual"), dict(temperature=0.7)]
    requests = [(f"r{i}", PROBLEMS[i], SamplingParams(max_tokens=16, steps=16, block_length=8, seed=i,
                                                      **kinds[i % 4])) for i in range(12)]
    engine = LLMEngine(llada, tokenizer)
    for request in requests:
        engine.add_request(*request)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    for rid, ids, p in requests:
        alone = remask.generate(llada, torch.tensor([ids]), generator=torch.Generator().manual_seed(p.seed),
                                **p.generate_kwargs())[0, len(ids):].tolist()
        assert done[rid].outputs[0].all_token_ids == alone, rid
    ar_engine = LLMEngine(ar, ar_tokenizer)
    for i in range(6):
        ar_engine.add_request(f"a{i}", PROBLEMS[i], SamplingParams(max_tokens=10, seed=i))
    while ar_engine.has_unfinished_requests():
        for out in ar_engine.step():
            if out.finished:
                ids = PROBLEMS[int(out.request_id[1:])]
                alone = remask.ar_generate(ar, torch.tensor([ids]), max_new_tokens=10,
                                           eos_token_id=[charset.EOS_ID])[0, len(ids):].tolist()
                got = out.outputs[0].all_token_ids
                assert got == alone[:len(got)], out.request_id

"""Segmented forwards (issue 31): diffusion sequences of different lengths share one flat forward,
each sequence's logits bit for bit its own forward's, and the engine's tokens stay each request's
drop-in tokens."""
from __future__ import annotations

import pytest
import torch

import remask
from remask.diffusion.varlen import SegmentedAttention, segmented_logits, token_groups
from remask.engine import LLMEngine, SamplingParams
from remask.engine.batch_invariant import batch_invariant_linear
from remask.models import tiny
from remask.models.spec import get_spec
from remask.zoo import charset, tasks

LENGTHS = (30, 23, 30, 41, 23, 1)


@pytest.fixture(scope="module")
def llada():
    return remask.load("tiny-llada")


@pytest.fixture(scope="module")
def dream(tmp_path_factory):
    path = tmp_path_factory.mktemp("dream")
    tiny.write_tiny_dream(str(path), seed=4, vocab_size=300, mask_token_id=299, eos_token_id=298)
    return remask.load(str(path))[0]


def _canvases(high: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, high, (1, n), generator=g) for n in LENGTHS]


@pytest.mark.parametrize("which", ["llada", "dream"])
def test_each_sequence_gets_its_own_forwards_logits(request, which):
    model = request.getfixturevalue(which)
    model = model[0] if isinstance(model, tuple) else model
    spec = get_spec(model)
    xs = _canvases(min(spec.vocab_size, 290) - 2)
    inputs = spec.forward_inputs(None, 1)      # Dream: {"attention_mask": "full"}, LLaDA: {}
    with torch.no_grad():
        alone = [spec.logits(model, x, **spec.forward_inputs(None, x.shape[1])) for x in xs]
        with batch_invariant_linear(True, single_thread=True,
                                    token_groups=token_groups([x.shape[1] for x in xs], "cpu")):
            flat, offsets = segmented_logits(spec, model, xs, **inputs)
        loose, _ = segmented_logits(spec, model, xs, **inputs)
    assert flat.shape[1] == sum(LENGTHS) and offsets == [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
    for x, a, o in zip(xs, alone, offsets):
        assert torch.equal(flat[:, o:o + x.shape[1]], a)        # bitwise with per-sequence linears
        torch.testing.assert_close(loose[:, o:o + x.shape[1]], a)


def test_attention_stays_inside_each_sequence(llada):
    model, _ = llada
    spec = get_spec(model)
    xs = _canvases(90)
    changed = [xs[0], xs[1].clone(), xs[2]]
    changed[1][0, 3] = (changed[1][0, 3] + 1) % 90      # another sequence's token: no effect on the first
    with torch.no_grad():
        a, offsets = segmented_logits(spec, model, xs[:3])
        b, _ = segmented_logits(spec, model, changed)
    n0 = xs[0].shape[1]
    assert torch.equal(a[:, :n0], b[:, :n0]) and torch.equal(a[:, offsets[2]:], b[:, offsets[2]:])
    assert not torch.equal(a[:, offsets[1]:offsets[2]], b[:, offsets[1]:offsets[2]])


def test_layout_and_refusals(llada):
    groups = token_groups([3, 2, 3], "cpu")
    assert [(n, r.tolist()) for n, r in groups] == [(3, [0, 1, 2, 5, 6, 7]), (2, [3, 4])]
    with pytest.raises(ValueError, match="attention mask"):
        SegmentedAttention([2]).attend(0, *(torch.zeros(1, 1, 2, 4),) * 3, 0, torch.zeros(1, 1, 2, 2))
    ar_model, _ = remask.load("tiny-ar")
    with pytest.raises(ValueError, match="segmented"):
        segmented_logits(get_spec(ar_model), ar_model, [torch.zeros(1, 3, dtype=torch.long)])
    model, _ = llada
    with pytest.raises(ValueError, match=r"\[1, T\]"):
        segmented_logits(get_spec(model), model, [torch.zeros(2, 3, dtype=torch.long)])


MIXES = {
    "llada rules": [dict(steps=16, block_length=8), dict(steps=16, block_length=8, threshold=0.9),
                    dict(steps=16, block_length=4, factor=1.0), dict(steps=16, block_length=8, temperature=0.7)],
    "dream sampler": [dict(alg="entropy"), dict(alg="maskgit_plus", temperature=0.6, top_p=0.9),
                      dict(alg="confidence_threshold", threshold=0.8)],
}


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_engine_shares_one_forward_across_lengths_with_each_requests_tokens(llada, mix):
    model, tokenizer = llada
    problems = tasks.problems(8, tasks.EVAL_SEED)
    requests = [(charset.encode_chat(p.prompt), SamplingParams(max_tokens=16, seed=i, **MIXES[mix][i % len(MIXES[mix])]))
                for i, p in enumerate(problems)]
    assert len({len(ids) for ids, _ in requests}) > 1            # several lengths
    engine = LLMEngine(model, tokenizer)      # batch invariant: bitwise per-sequence linears
    assert not engine.runner.segmented_forwards   # (off by default there: slower on CPU)
    engine.runner.segmented_forwards = True   # the path batch_invariant=False takes, here bitwise
    for i, (ids, params) in enumerate(requests):
        engine.add_request(str(i), ids, params)
    got, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
    assert engine.runner.forwards == steps      # one forward per engine step for all of them
    for i, (ids, params) in enumerate(requests):
        prompt = torch.tensor([ids])
        generator = torch.Generator().manual_seed(params.seed)
        if params.alg is not None:
            out = remask.diffusion_generate(model, prompt, generator=generator, **params.diffusion_generate_kwargs())
        else:
            out = remask.generate(model, prompt, generator=generator, **params.generate_kwargs())
        want = out[0, prompt.shape[1]:].tolist()
        assert got[str(i)] == want[:len(got[str(i)])] and len(got[str(i)]) > 0, i


def test_without_batch_invariance_lengths_share_one_forward(llada):
    model, tokenizer = llada
    engine = LLMEngine(model, tokenizer, batch_invariant=False)
    assert engine.runner.segmented_forwards
    for i, p in enumerate(tasks.problems(6, tasks.EVAL_SEED)):
        engine.add_request(str(i), charset.encode_chat(p.prompt), SamplingParams(max_tokens=16, steps=16, block_length=8))
    steps, outs = 0, {}
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
    assert engine.runner.forwards == steps and len(outs) == 6
    assert all(0 < len(ids) <= 16 and charset.MASK_ID not in ids for ids in outs.values())

"""Batched commits after a shared forward (issue 31): `BlockDecoder.commit_together` over several
decoders gives every row the tokens its own `commit` gives, and the engine uses it
(`receive_together`) for requests of one commit key."""
from __future__ import annotations

import copy

import pytest
import torch

import remask
from remask.diffusion.families.llada import BlockDecoder
from remask.diffusion.parts.stats import GenerationStats, SyncCounter
from remask.diffusion.parts.stepper import run_forwards, step_alone
from remask.engine import LLMEngine, SamplingParams
from remask.models.spec import get_spec
from remask.zoo import charset

PROMPTS = ["sort 52814", "sort 93710", "sort 11111", "sort 20485"]   # one length: one shared forward

RULES = {
    "schedule": dict(steps=16, gen_length=16, block_length=8),
    "threshold": dict(steps=16, gen_length=16, block_length=8, threshold=0.6),
    "factor": dict(steps=16, gen_length=16, block_length=4, factor=1.0),
    "suppressed eos": dict(steps=16, gen_length=16, block_length=8, logits_eos_inf=True),
}


@pytest.fixture(scope="module")
def tiny():
    return remask.load("tiny-llada")


@pytest.mark.parametrize("rule", sorted(RULES))
def test_each_row_commits_what_its_own_commit_would(tiny, rule):
    model, _ = tiny
    spec = get_spec(model)
    decoders = [BlockDecoder(spec, **RULES[rule]) for _ in PROMPTS]
    states = [d.start(torch.tensor([charset.encode_chat(p)])) for d, p in zip(decoders, PROMPTS)]
    # states at different points: the second and fourth a few steps ahead
    with torch.no_grad():
        for i in (1, 3, 3):
            step_alone(decoders[i], model, states[i])
        steps = 0
        while not all(s.done for s in states):
            live = [i for i, s in enumerate(states) if not s.done]
            answers = [run_forwards(model, [decoders[i].next_forward(states[i])])[0] for i in live]
            logits = [decoders[i].finish_forward(states[i], a)[0] for i, a in zip(live, answers)]
            alone = [copy.deepcopy(states[i]) for i in live]
            alone_stats = [GenerationStats() for _ in live]
            for j, i in enumerate(live):
                decoders[i].commit(alone[j], logits[j], 0, stats=alone_stats[j])
            stats = [GenerationStats() for _ in live]
            with SyncCounter() as counter:
                BlockDecoder.commit_together([decoders[i] for i in live], [states[i] for i in live], logits,
                                             [0] * len(live), stats)
            assert counter.total <= 1       # one host read for the whole group (a parallel rule's)
            for j, i in enumerate(live):
                assert torch.equal(states[i].x, alone[j].x), (rule, steps, i)
                assert (states[i].block, states[i].step, states[i].done) == (alone[j].block, alone[j].step, alone[j].done)
                assert stats[j].tokens_per_step == alone_stats[j].tokens_per_step and stats[j].nfe == 1
            steps += 1
    assert steps >= 2
    assert all(not (s.x == spec.mask_id).any() for s in states)


def test_commit_keys_keep_apart_what_cannot_batch(tiny):
    spec = get_spec(tiny[0])
    key = lambda **kw: BlockDecoder(spec, steps=16, gen_length=16, block_length=8, **kw).commit_key()  # noqa: E731
    assert key() == key() and key() is not None
    assert key(threshold=0.9) != key() and key(threshold=0.9) != key(threshold=0.8)
    assert BlockDecoder(spec, steps=16, gen_length=16, block_length=4).commit_key() != key()
    for alone in (dict(temperature=0.5), dict(remasking="random"), dict(reference_ties=True),
                  dict(confidence_eos_eot_inf="corrected"), dict(cfg_scale=1.0)):
        assert key(**alone) is None, alone


def test_the_engine_batches_commits_and_keeps_each_requests_tokens(tiny, monkeypatch):
    model, tokenizer = tiny
    calls = []
    shared = BlockDecoder.commit_together

    def spy(decoders, states, *args):
        calls.append(len(states))
        return shared(decoders, states, *args)

    monkeypatch.setattr(BlockDecoder, "commit_together", staticmethod(spy))
    params = [SamplingParams(max_tokens=16, steps=16, block_length=8),
              SamplingParams(max_tokens=16, steps=16, block_length=8, threshold=0.6),
              SamplingParams(max_tokens=16, steps=16, block_length=8, min_tokens=4)]   # min_tokens: alone
    engine = LLMEngine(model, tokenizer)
    requests = [(f"{i}-{j}", p, sp) for j, sp in enumerate(params) for i, p in enumerate(PROMPTS)]
    for rid, prompt, sp in requests:
        engine.add_request(rid, charset.encode_chat(prompt), sp)
    got = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].tokens_per_step)
    assert calls and max(calls) == len(PROMPTS)     # the two batchable settings, four rows each
    for rid, prompt, sp in requests:
        solo = LLMEngine(model, tokenizer)
        solo.add_request("solo", charset.encode_chat(prompt), sp)
        want = None
        while solo.has_unfinished_requests():
            for out in solo.step():
                if out.finished:
                    want = (out.outputs[0].token_ids, out.outputs[0].tokens_per_step)
        assert got[rid] == want, rid

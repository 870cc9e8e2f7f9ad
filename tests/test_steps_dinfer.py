"""`dinfer_steps`: `dinfer_generate` as a step generator (`remask.diffusion.parts.stepper`): at most one
model forward per `next()`, the tokens of `dinfer_generate`, a monotone `Progress.final` whose
positions are the output's, and arguments checked at the call."""
from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModel

from remask.diffusion.methods.dinfer import (CreditDecoding, HierarchicalDecoding, IterationSmoothing, ThresholdDecoding,
                                     VicinityCache, dinfer_generate, dinfer_steps)
from remask.diffusion.parts.stats import GenerationStats
from remask.models import tiny
from remask.models.spec import get_spec
from helpers import as_progress

with open(os.path.join(os.path.dirname(__file__), "fixtures", "dinfer_reference.json")) as f:
    FIXTURE = json.load(f)
META = FIXTURE["meta"]
MASK, EOS = 299, 298
RULES = {"threshold": ThresholdDecoding, "credit": CreditDecoding, "hierarchy": HierarchicalDecoding}
SMOOTH = IterationSmoothing()

CONFIGS = {
    "threshold-none": (ThresholdDecoding(0.7), None),
    "credit-dual": (CreditDecoding(), "dual"),
    "hierarchy-prefix": (HierarchicalDecoding(), "prefix"),
    "threshold-vicinity": (ThresholdDecoding(0.8), VicinityCache(4, 4, 2)),
    "hierarchy-vicinity": (HierarchicalDecoding(), VicinityCache(2, 6, 1)),
    "smooth-threshold-prefix": (ThresholdDecoding(0.7, smoothing=SMOOTH), "prefix"),
    "smooth-credit-dual": (CreditDecoding(smoothing=SMOOTH), "dual"),
    "smooth-hierarchy-none": (HierarchicalDecoding(smoothing=SMOOTH), None),
    "smooth-threshold-vicinity": (ThresholdDecoding(smoothing=SMOOTH), VicinityCache(4, 4, 2)),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("dinfer_steps")
    out = {}
    for name in ("llada_small", "llada_peaked"):
        spec = META["checkpoints"][name]
        path = str(root / name)
        assert tiny.write_tiny_llada(path, **spec["kwargs"]) == spec["digest"], f"{name}: weights differ"
        out[name] = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    return out


class _Counter:
    """Counts the model's top-level forwards with a forward hook."""

    def __init__(self, model):
        self.n = 0
        self.handle = model.register_forward_hook(self._hook)

    def _hook(self, *_):
        self.n += 1

    def close(self):
        self.handle.remove()


def _drive(model, prompt, **kw):
    """Run `dinfer_steps` by hand: (output, progresses as (x clone, final), forwards per next, stats)."""
    stats = GenerationStats()
    counter = _Counter(model)
    try:
        steps = dinfer_steps(get_spec(model), prompt, stats=stats, **kw)
        assert counter.n == 0
        view = as_progress(steps, model)
        progresses, per_next = [], []
        while True:
            before = counter.n
            try:
                p = next(view)
            except StopIteration as stop:
                per_next.append(counter.n - before)
                out = stop.value
                break
            per_next.append(counter.n - before)
            assert torch.is_grad_enabled()   # no_grad does not leak out of the generator
            progresses.append((p.x.clone(), p.final))
        assert counter.n == stats.nfe
    finally:
        counter.close()
    return out, progresses, per_next, stats


def _prompt(batch, padded=False):
    prompt = torch.randint(0, 290, (batch, 9), generator=torch.Generator().manual_seed(7 + batch))
    if not padded:
        return prompt, None
    mask = torch.ones_like(prompt)
    prompt[0, :3], mask[0, :3] = 297, 0
    return prompt, mask


def _check(model, prompt, **kw):
    """(a) and (b) on one run; returns the output and the progresses."""
    out, progresses, per_next, stats = _drive(model, prompt, **kw)
    ref_stats = GenerationStats()
    assert torch.equal(out, dinfer_generate(model, prompt, stats=ref_stats, **kw))
    assert stats.nfe == ref_stats.nfe and stats.tokens_per_step == ref_stats.tokens_per_step
    # (a) at most one forward per next(), none after the last yield, a yield per forward
    assert max(per_next) <= 1 and per_next[-1] == 0
    assert len(progresses) >= stats.nfe
    # (b) final: monotone, within gen_length, and its positions already the output's
    P, L = prompt.shape[1], kw["gen_length"]
    last = 0
    for x, final in progresses:
        assert x.shape == out.shape
        assert last <= final <= L
        assert torch.equal(x[:, P:P + final], out[:, P:P + final])
        last = final
    if prompt.shape[0] == 1:
        # the canvas is the live one (an early stop fills the EOS after the last forward)
        x = progresses[-1][0]
        assert torch.equal(x[x != MASK], out[x != MASK])
        assert torch.equal(x, out) or bool((out[x == MASK] == EOS).all())
        assert last > 0
        if not kw.get("early_stop", True):
            assert last == L
    return out, progresses


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("early_stop", [True, False])
def test_one_forward_per_step_and_same_tokens(models, config, batch, early_stop):
    decoder, cache = CONFIGS[config]
    prompt, mask = _prompt(batch, padded=batch == 2 and early_stop)
    _check(models["llada_peaked"], prompt, decoder=decoder, use_cache=cache, gen_length=29, block_length=8,
           early_stop=early_stop, attention_mask=mask)


@pytest.mark.parametrize("name", ["llada_peaked_hierarchy_prefix_p13_g48_b16",
                                  "llada_peaked_threshold_vicinity1_p21_g64_b32",
                                  "llada_peaked_hierarchy_vicinity0_p13_g48_b16"])
def test_early_stop_cases(models, name):
    """Fixture cases whose output holds EOS: the early stop's fill and break under the generator."""
    case = next(c for c in FIXTURE["cases"] if c["name"] == name)
    rule = RULES[case["decoder"]["kind"]](**{k: v for k, v in case["decoder"].items() if k != "kind"})
    cache = VicinityCache(**case["cache"]["vicinity"]) if isinstance(case["cache"], dict) else case["cache"]
    prompt = torch.tensor(case["prompt"])
    out, progresses = _check(models[case["checkpoint"]], prompt, decoder=rule, use_cache=cache,
                             gen_length=case["gen_length"], block_length=case["block_length"],
                             early_stop=case["early_stop"])
    assert out.tolist() == case["output_ids"] and bool((out[:, prompt.shape[1]:] == EOS).any())


def test_final_reports_whole_blocks(models):
    """B=1: `final` moves only to block ends (the first block overlaps the prompt)."""
    model = models["llada_small"]
    prompt, _ = _prompt(1)
    out, progresses, _, _ = _drive(model, prompt, decoder=ThresholdDecoding(), gen_length=29, block_length=8,
                                   early_stop=False)
    P, T = prompt.shape[1], out.shape[1]
    ends = {min(e, T) - P for e in range(8, T + 8, 8) if e > P}
    finals = {f for _, f in progresses}
    assert finals <= ends | {0} and 29 in finals
    for x, final in progresses:   # not final: a mask remains in the block after `final`
        if final < 29:
            nxt = min((e for e in ends if e > final))
            assert bool((x[0, P + final:P + nxt] == MASK).any())


@pytest.mark.parametrize("kwargs, field", [
    (dict(decoder="threshold"), "decoder"),
    (dict(use_cache="paged"), "use_cache"),
    (dict(gen_length=0), "gen_length"),
    (dict(block_length=-1), "block_length"),
    (dict(maximum_unroll=0), "maximum_unroll"),
    (dict(early_stop=1), "early_stop"),
    (dict(eos_id=-1), "eos_id"),
])
def test_bad_arguments_raise_at_the_call(models, kwargs, field):
    model = models["llada_small"]
    counter = _Counter(model)
    try:
        with pytest.raises(ValueError, match=field):
            dinfer_steps(get_spec(model), torch.tensor([[1, 2, 3]]), **kwargs)
        with pytest.raises(ValueError, match="mask token"):
            dinfer_steps(get_spec(model), torch.tensor([[1, MASK, 3]]), gen_length=8, block_length=8)
        assert counter.n == 0
    finally:
        counter.close()


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_requests_of_one_layout_share_a_forward(models, config):
    """The generator calls no model: every forward is a `ForwardRequest`, and two requests at one
    layout (the same prompt, in lockstep) pack — prefix / dual / the vicinity cache's plain
    `KVCache`, inputs_embeds under smoothing — into ONE model call (`run_forwards`, as the engine's
    runner) whose rows give each the drop-in tokens."""
    from remask.diffusion.parts.stepper import ForwardRequest, run_forwards
    from remask.kernels.batch_invariant import batch_invariant_linear

    decoder, cache = CONFIGS[config]
    model = models["llada_peaked"]
    prompt, _ = _prompt(1)
    kw = dict(decoder=decoder, use_cache=cache, gen_length=29, block_length=8)
    expected = dinfer_generate(model, prompt, **kw)
    counter = _Counter(model)
    try:
        pair = [dinfer_steps(get_spec(model), prompt, **kw) for _ in range(2)]
        answers, outs, requests = [None, None], [None, None], 0
        while outs[0] is None:
            items = []
            for i, steps in enumerate(pair):
                try:
                    items.append(steps.send(answers[i]))
                except StopIteration as stop:
                    outs[i] = stop.value
            assert (outs[0] is None) == (outs[1] is None)
            if outs[0] is not None:
                break
            assert type(items[0]) is type(items[1])
            answers = [None, None]
            if isinstance(items[0], ForwardRequest):
                key = items[0].pack_key()
                assert key is not None and key == items[1].pack_key()
                before = counter.n
                answers = run_forwards(model, items, lambda rows, groups=None: batch_invariant_linear(
                    True, single_thread=True, token_groups=groups))
                assert counter.n == before + 1
                requests += 1
    finally:
        counter.close()
    assert requests > 1 and counter.n == requests
    assert torch.equal(outs[0], expected) and torch.equal(outs[1], expected)

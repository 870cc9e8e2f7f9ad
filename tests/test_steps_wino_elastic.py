"""WINO and Elastic-Cache as step generators (`wino_steps`, `elastic_steps`; issue 30): one forward
at most per `next()`, the drop-in functions' tokens, `Progress.final` monotone and true, the live
canvas for one row, and bad arguments refused at the call."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from remask.diffusion.methods.elastic import ElasticCache, elastic_generate, elastic_steps
from remask.diffusion.parts.stats import GenerationStats
from remask.diffusion.parts.stepper import Progress, drive
from remask.diffusion.methods.wino import WINO, wino_generate, wino_steps
from remask.models.spec import get_spec

from helpers import as_progress, load_fixture_checkpoint

FIXTURES = Path(__file__).parent / "fixtures"
WINO_FIXTURE = json.loads((FIXTURES / "wino_reference.json").read_text())
ELASTIC_FIXTURE = json.loads((FIXTURES / "elastic_reference.json").read_text())
MASK = 299
PROMPTS = torch.tensor([[5, 17, 42, 99, 7, 8], [200, 3, 77, 150, 12, 9]])


@pytest.fixture(scope="module")
def load(tmp_path_factory):
    checkpoints = {**WINO_FIXTURE["meta"]["checkpoints"], **ELASTIC_FIXTURE["meta"]["checkpoints"]}
    return lambda name: load_fixture_checkpoint(tmp_path_factory, checkpoints, name)


class Forwards:
    """Counts model forwards: the token embedding runs once per forward (both methods' requests
    are the model's own forward; Elastic-Cache's does its per-layer work in hooks around it)."""

    def __init__(self, model):
        self.count = 0
        self.handle = model.model.transformer.wte.register_forward_hook(self._hook)

    def _hook(self, *_):
        self.count += 1

    def close(self):
        self.handle.remove()


def step_through(model, steps, P, gen_length):
    """Drive `steps` by hand: the output and every `Progress`, checking one forward per `next()`."""
    counter = Forwards(model)
    seen: list[tuple[torch.Tensor, int]] = []
    view = as_progress(steps, model)
    try:
        while True:
            before = counter.count
            try:
                progress = next(view)
            except StopIteration as stop:
                assert counter.count == before, "a forward ran after the last yield"
                out = stop.value
                break
            assert counter.count - before <= 1, "one next() ran more than one forward"
            assert isinstance(progress, Progress) and progress.x.shape[1] == P + gen_length
            seen.append((progress.x.clone(), progress.final))
    finally:
        counter.close()
    return out, seen


def check_final(seen, x, P, gen_length):
    last = 0
    for canvas, final in seen:
        assert last <= final <= gen_length
        last = final
        assert torch.equal(canvas[:, P:P + final], x[:, P:P + final])   # what it declared final is the output's
        assert torch.equal(canvas[:, :P], x[:, :P])


# ---------------------------------------------------------------------------- WINO

@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("name,commit_mask_token", [("llada_small", False), ("llada_small_peaked", True)])
def test_wino_steps_one_forward_per_step(load, rows, name, commit_mask_token):
    model = load(name)
    prompt = PROMPTS[:rows]
    config = WINO(threshold=0.5, threshold_back=0.9, commit_mask_token=commit_mask_token)
    kw = dict(config=config, gen_length=48, block_length=16)
    stats = GenerationStats()
    (x, forwards), seen = step_through(model, wino_steps(get_spec(model), prompt, stats=stats, **kw), 6, 48)
    want_x, want_forwards = wino_generate(model, prompt, **kw)
    assert torch.equal(x, want_x) and torch.equal(forwards, want_forwards)
    assert len(seen) == stats.nfe >= int(forwards.max()) > 0
    check_final(seen, x, 6, 48)
    finals = [final for _, final in seen]
    assert finals[-1] == 48 and 0 < min(f for f in finals if f) < 48   # blocks become final one by one
    if rows == 1:   # the live canvas: the row's committed tokens as they stand, the shadow left out
        assert torch.equal(seen[-1][0], x)
        assert any(bool((canvas[0, 6:] == MASK).any()) for canvas, _ in seen)


def test_wino_steps_reproduce_the_fixture(load):
    for case in WINO_FIXTURE["cases"]:
        model = load(case["checkpoint"])
        kwargs = case["kwargs"]
        config = WINO(threshold=kwargs["threshold"], threshold_back=kwargs["threshold_back"], commit_mask_token=True)
        x, forwards = drive(wino_steps(get_spec(model), torch.tensor([case["prompt"]]), config=config,
                                       gen_length=kwargs["gen_length"], block_length=kwargs["block_length"]), model)
        assert x[0].tolist() == case["output_ids"] and forwards.tolist() == [case["steps"]]


def test_wino_steps_refuse_bad_arguments_at_the_call(load):
    model = load("llada_small")
    counter = Forwards(model)
    try:
        with pytest.raises(ValueError, match="block_length"):
            wino_steps(get_spec(model), torch.tensor([[1, 2]]), gen_length=24, block_length=16)
        with pytest.raises(ValueError, match="mask token"):
            wino_steps(get_spec(model), torch.tensor([[1, MASK]]), gen_length=16, block_length=16)
        with pytest.raises(ValueError, match="config"):
            wino_steps(get_spec(model), torch.tensor([[1, 2]]), config={"threshold": 0.5}, gen_length=16,
                       block_length=16)
    finally:
        counter.close()
    assert counter.count == 0


# ---------------------------------------------------------------------------- Elastic-Cache

def elastic_kwargs(case, commit_mask_token):
    kw = dict(case["kwargs"])
    gen_length, mask_id, eos_id = kw.pop("gen_length"), kw.pop("mask_id"), kw.pop("eos_id")
    return dict(config=ElasticCache(**kw, commit_mask_token=commit_mask_token), gen_length=gen_length,
                mask_id=mask_id, eos_id=eos_id)


ELASTIC_CASES = ["llada_small-eos", "llada_small-eos_w8_thr7", "llada_small_peaked-eos_w8_thr7",
                 "llada_small-gamma999", "llada_small-noblockcache", "llada_small-topk2", "llada_deep-gen64_w8",
                 "llada_deep-w4"]


@pytest.mark.parametrize("commit_mask_token", [False, True])
@pytest.mark.parametrize("name", ELASTIC_CASES)
def test_elastic_steps_one_row(load, name, commit_mask_token):
    case = next(c for c in ELASTIC_FIXTURE["cases"] if c["name"] == name)
    model = load(case["checkpoint"])
    prompt = torch.tensor(case["prompt"])
    P = prompt.shape[1]
    kw = elastic_kwargs(case, commit_mask_token)
    gen_length = kw["gen_length"]
    stats, trace = GenerationStats(), []
    x, seen = step_through(model, elastic_steps(get_spec(model), prompt, stats=stats, trace=trace, **kw), P, gen_length)
    assert torch.equal(x, elastic_generate(model, prompt, **kw))
    if commit_mask_token:   # the official loop's tokens
        assert len(trace) == case["nfe"]
    assert len(seen) == stats.nfe == len(trace) > 0
    check_final(seen, x, P, gen_length)
    finals = [final for _, final in seen]
    assert finals[-1] > 0
    if len(seen) > 2:   # the decoded prefix grows while decoding (an EOS at the start ends it at once)
        assert any(0 < f < gen_length for f in finals[:-1])
    # the live canvas: after each step it holds exactly the tokens committed so far
    committed = 0
    for (canvas, _), n in zip(seen, stats.tokens_per_step):
        committed += n
        if not commit_mask_token:
            assert int((canvas[0, P:] != MASK).sum()) == committed
    if kw["eos_id"] is None or kw["eos_id"] not in x[0, P:].tolist():
        assert finals[-1] == gen_length


def test_elastic_steps_rows(load):
    model = load("llada_deep")
    config = ElasticCache(window_length=8, threshold=0.9, gamma=0.99, track_num=2)
    stats = GenerationStats()
    steps = elastic_steps(get_spec(model), PROMPTS, config=config, gen_length=40, stats=stats)
    x, seen = step_through(model, steps, 6, 40)
    assert torch.equal(x, elastic_generate(model, PROMPTS, config=config, gen_length=40))
    assert len(seen) == stats.nfe > 0
    check_final(seen, x, 6, 40)
    # rows are decoded one by one: the whole buffer is yielded with the row's state written back
    first_done = next(i for i, (canvas, _) in enumerate(seen) if not bool((canvas[0, 6:] == MASK).any()))
    assert bool((seen[first_done][0][1, 6:] == MASK).all())
    assert torch.equal(seen[-1][0], x)
    assert all(final == 0 for canvas, final in seen if bool((canvas[0, 6:] == MASK).any()))


def test_elastic_steps_refuse_bad_arguments_at_the_call(load):
    model = load("llada_small")
    p = torch.tensor([[1, 2, 3]])
    counter = Forwards(model)
    try:
        with pytest.raises(ValueError, match="gen_length"):
            elastic_steps(get_spec(model), p, gen_length=0)
        with pytest.raises(ValueError, match="config"):
            elastic_steps(get_spec(model), p, gen_length=8, config={"window_length": 4})
        with pytest.raises(ValueError, match="mask token"):
            elastic_steps(get_spec(model), torch.tensor([[1, MASK]]), gen_length=8)
        with pytest.raises(ValueError, match="eos_id"):
            elastic_steps(get_spec(model), p, gen_length=8, eos_id=10_000)
        with pytest.raises(ValueError, match="trace"):
            elastic_steps(get_spec(model), p, gen_length=8, trace=())
    finally:
        counter.close()
    assert counter.count == 0

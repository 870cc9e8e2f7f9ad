"""FreeDave as a step generator (`remask.diffusion.methods.freedave.freedave_steps`, issue 30): one model
forward at most per `next()`, at least one yield per counted forward, the tokens of
`freedave_generate`, a `Progress.final` that only grows and only covers decoded tokens, and
arguments checked at the call."""
from __future__ import annotations

import warnings

import pytest
import torch

import remask
from remask.diffusion.methods.freedave import FreeDave, freedave_generate, freedave_steps
from remask.diffusion.parts.stepper import Progress
from remask.zoo import charset
from remask.models.spec import get_spec
from helpers import as_progress, random_prompt

GEN, BLOCK = 32, 8


@pytest.fixture(scope="module")
def tiny_llada():
    return remask.load("tiny-llada")[0]


@pytest.fixture
def model_of(load_model, tiny_llada):
    return lambda name: tiny_llada if name == "tiny-llada" else load_model(name)


def prompts_for(name: str, batch: int) -> torch.Tensor:
    if name == "tiny-llada":
        texts = ["sort 52814", "rev abcdef"]
        return torch.tensor([charset.encode_chat(t) for t in texts[:batch]])
    return random_prompt(batch, 7, 1, high=290)


def drive_by_hand(model, prompt, **kw):
    """Run `freedave_steps` one `next()` at a time; returns (output, stats, forwards per next,
    the `Progress` of each yield)."""
    forwards = [0]
    handle = model.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    stats = remask.GenerationStats()
    per_next, seen = [], []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            steps = freedave_steps(get_spec(model), prompt, stats=stats, gen_length=GEN, block_length=BLOCK, **kw)
            assert forwards[0] == 0   # nothing runs before the first next()
            view = as_progress(steps, model)
            while True:
                before = forwards[0]
                try:
                    progress = next(view)
                except StopIteration as stop:
                    per_next.append(forwards[0] - before)
                    out = stop.value
                    break
                per_next.append(forwards[0] - before)
                assert isinstance(progress, Progress)
                seen.append((progress.final, progress.x.clone()))
    finally:
        handle.remove()
    return out, stats, per_next, seen


def generate(model, prompt, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return freedave_generate(model, prompt, gen_length=GEN, block_length=BLOCK, **kw)


CASES = [
    ("tiny-llada", dict(use_cache="dual", config=FreeDave(draft_steps=4))),
    ("llada_small", dict(use_cache=None, config=FreeDave(draft_steps=3, draft_mode="batch_expanding"))),
    ("llada_small", dict(use_cache="prefix", config=FreeDave(draft_steps=4, confidence_threshold=0.3,
                                                             match_rule="exact"))),
    ("dream_small", dict(use_cache="dual", config=FreeDave(draft_steps=4))),
    ("dream_small", dict(use_cache="prefix", config=FreeDave(draft_steps=2, draft_mode="batch_expanding"))),
]


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("name, kw", CASES)
def test_one_forward_per_step_and_the_tokens_of_generate(name, kw, batch, model_of):
    model = model_of(name)
    prompt = prompts_for(name, batch)
    P = prompt.shape[1]
    out, stats, per_next, seen = drive_by_hand(model, prompt, **kw)
    expected = generate(model, prompt, **kw)
    assert torch.equal(out, expected)
    assert max(per_next) <= 1 and per_next[-1] == 0   # no forward between the last yield and the return
    assert sum(per_next) == stats.nfe
    assert len(seen) >= stats.nfe
    # Progress.final: never decreases, never past gen_length, and what it declares final is the output's.
    finals = [final for final, _ in seen]
    assert finals == sorted(finals) and 0 <= finals[0] and finals[-1] <= GEN
    assert finals[-1] > 0
    for final, x in seen:
        assert x.shape == out.shape
        assert torch.equal(x[:, :P], prompt)
        assert torch.equal(x[:, P:P + final], out[:, P:P + final])


@pytest.mark.parametrize("kwargs, match", [
    (dict(steps=16), "steps"), (dict(use_cache="paged"), "use_cache"), (dict(config="fast"), "config"),
    (dict(block_length=12), "block_length"), (dict(gen_length=0), "gen_length"),
])
def test_bad_arguments_raise_at_the_call(kwargs, match, tiny_llada):
    forwards = []
    handle = tiny_llada.register_forward_hook(lambda *_: forwards.append(1))
    try:
        with pytest.raises(ValueError, match=match):
            freedave_steps(get_spec(tiny_llada), prompts_for("tiny-llada", 1),
                           **(dict(gen_length=32, block_length=8) | kwargs))
    finally:
        handle.remove()
    assert not forwards

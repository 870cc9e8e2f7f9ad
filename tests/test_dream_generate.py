"""Properties of remask.diffusion_generate (Dream's sampler and Fast-dLLM's confidence_threshold)."""
from __future__ import annotations

import pytest
import torch

import remask
from remask.diffusion.parts.scoring import score_tokens

from helpers import left_pad, random_prompt

MASK = 299  # dream_small's mask id


@pytest.mark.parametrize("alg", ["origin", "maskgit_plus", "topk_margin", "entropy"])
def test_every_algorithm_fills_every_mask(load_model, alg):
    model = load_model("dream_small")
    prompt = random_prompt(2, 5, 0)
    out = remask.diffusion_generate(model, prompt, max_new_tokens=12, steps=6, alg=alg,
                                    generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 17)
    assert torch.equal(out[:, :5], prompt)
    assert not (out == MASK).any()


def test_history_and_return_dict(load_model):
    model = load_model("dream_small")
    out = remask.diffusion_generate(model, random_prompt(1, 5, 1), max_new_tokens=8, steps=4, alg="maskgit_plus",
                                    return_dict_in_generate=True, output_history=True)
    assert isinstance(out, remask.DreamModelOutput)
    assert len(out.history) == 4 and torch.equal(out.history[-1], out.sequences)
    masks_left = [int((h == MASK).sum()) for h in out.history]
    assert masks_left == sorted(masks_left, reverse=True) and masks_left[-1] == 0


def test_schedule_counts_follow_linspace(load_model):
    model = load_model("dream_small")
    stats = remask.GenerationStats()
    remask.diffusion_generate(model, random_prompt(1, 5, 2), max_new_tokens=16, steps=4, alg="entropy", stats=stats)
    t = torch.linspace(1, 1e-3, 5)
    remaining, expected = 16, []
    for i in range(4):
        n = int(torch.tensor(remaining, dtype=torch.float32) * (1 - t[i + 1] / t[i])) if i < 3 else remaining
        expected.append(n)
        remaining -= n
    assert stats.tokens_per_step == expected and stats.nfe == 4


def test_left_padded_batch_equals_rows_alone(load_model):
    model = load_model("dream_small")
    rows = [random_prompt(1, 4, 3)[0], random_prompt(1, 7, 4)[0]]
    ids, mask = left_pad(rows, pad_id=298)
    batch = remask.diffusion_generate(model, ids, attention_mask=mask, max_new_tokens=8, steps=8, alg="entropy")
    for i, row in enumerate(rows):
        alone = remask.diffusion_generate(model, row[None], max_new_tokens=8, steps=8, alg="entropy")
        assert torch.equal(batch[i, -8:], alone[0, -8:])


def test_max_length_and_default_length(load_model):
    model = load_model("dream_small")
    prompt = random_prompt(1, 5, 5)
    assert remask.diffusion_generate(model, prompt, max_length=12, steps=7, alg="maskgit_plus").shape == (1, 12)
    with pytest.warns(UserWarning, match="max_length"):
        out = remask.diffusion_generate(model, prompt, steps=4, alg="maskgit_plus")
    assert out.shape == (1, 25)


def test_hooks_are_called(load_model):
    model = load_model("dream_small")
    calls = []

    def tokens_hook(step, x, logits):
        calls.append(step)
        return x

    def logits_hook(step, x, logits):
        logits[..., 5] = 1e9  # force token 5 everywhere
        return logits

    out = remask.diffusion_generate(model, random_prompt(1, 5, 6), max_new_tokens=6, steps=3, alg="maskgit_plus",
                                    generation_tokens_hook_func=tokens_hook, generation_logits_hook_func=logits_hook)
    assert calls == [None, 0, 1, 2]
    assert (out[0, 5:] == 5).all()


def test_confidence_threshold_defers_low_confidence_picks(load_model):
    model = load_model("dream_small")
    prompt = random_prompt(1, 5, 7)
    strict = remask.GenerationStats()
    remask.diffusion_generate(model, prompt, max_new_tokens=16, steps=4, alg="confidence_threshold",
                              threshold=1.0, stats=strict)
    assert strict.tokens_per_step[0] == 1 and sum(strict.tokens_per_step) == 16
    loose = remask.GenerationStats()
    out = remask.diffusion_generate(model, prompt, max_new_tokens=16, steps=4, alg="confidence_threshold",
                                    threshold=1e-6, stats=loose)
    assert loose.tokens_per_step == [4, 4, 4, 4] and not (out == MASK).any()


def test_generation_config_object_and_unknown_kwargs(load_model):
    model = load_model("dream_small")
    prompt = random_prompt(1, 5, 8)
    config = remask.DreamGenerationConfig(max_new_tokens=8, steps=4, alg="entropy")
    a = remask.diffusion_generate(model, prompt, generation_config=config)
    b = remask.diffusion_generate(model, prompt, max_new_tokens=8, steps=4, alg="entropy")
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="unknown keyword"):
        remask.diffusion_generate(model, prompt, max_new_tokens=8, steps=4, stepz=3)


@pytest.mark.parametrize("kwargs,match", [
    (dict(alg="greedy"), "alg"),
    (dict(steps=0), "steps"),
    (dict(max_new_tokens=None, max_length=3), "max_length"),
    (dict(max_new_tokens=200000), "maximum sequence length"),
    (dict(mask_token_id=5000), "mask_id"),
    (dict(mask_token_id=298), "pad"),
    (dict(alg="confidence_threshold", threshold=2.0), "threshold"),
    (dict(alg="confidence_threshold", steps=3), "divisible"),
])
def test_bad_input_names_the_parameter(load_model, kwargs, match):
    model = load_model("dream_small")
    args = dict(max_new_tokens=8, steps=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        remask.diffusion_generate(model, random_prompt(1, 5, 9), **args)


def test_mask_token_is_never_chosen():
    """Where the reference would commit the mask token itself, remask takes the best other token."""
    logits = torch.zeros(3, 10)
    logits[:, 7] = 5.0
    logits[0, 3] = 4.0
    for sampler in ("gumbel", "categorical"):
        x0, conf = score_tokens(logits, sampler=sampler, exclude_id=7)
        assert x0.tolist() == [3, 0, 0]
        torch.testing.assert_close(conf, logits.softmax(-1)[torch.arange(3), x0])
    untouched = torch.randn(4, 10)
    untouched[:, 7] = -5
    assert torch.equal(score_tokens(untouched, exclude_id=7)[0], score_tokens(untouched)[0])


def test_top_p_ties_follow_torch_topk_by_default(load_model):
    """With top_p at temperature 0 the nucleus of one makes every confidence exactly 1.0: Dream
    commits through `torch.topk`, whose order among ties is its own (not the lowest index).
    `diffusion_generate` reproduces it by default; `reference_ties=False` commits the lower index
    first (remask's library-independent rule); the engine uses its `reference_ties` field."""
    model = load_model("dream_small")
    prompt = random_prompt(1, 5, 7)
    seen = []
    kwargs = dict(max_new_tokens=40, steps=8, alg="maskgit_plus", temperature=0.0, top_p=0.01)

    def capture(step, x, logits):
        seen.append(x.clone())
        return x

    remask.diffusion_generate(model, prompt, generation_tokens_hook_func=capture, **kwargs)
    first = (seen[1][0, 5:] != MASK).nonzero().flatten()           # seen[0]: before the first step
    conf = torch.full((1, 45), -torch.inf)
    conf[0, 5:] = 1.0
    n = len(first)
    assert sorted((torch.topk(conf, n).indices[0] - 5).tolist()) == first.tolist()
    assert first.tolist() != list(range(n))                           # not the lowest indices here
    seen.clear()
    remask.diffusion_generate(model, prompt, generation_tokens_hook_func=capture, reference_ties=False, **kwargs)
    assert (seen[1][0, 5:] != MASK).nonzero().flatten().tolist() == list(range(n))
    llm = remask.LLM(model)
    for ties in (True, False):
        engine = llm.generate([prompt[0].tolist()], remask.SamplingParams(
            max_tokens=40, steps=8, alg="maskgit_plus", temperature=0.0, top_p=0.01, reference_ties=ties),
            use_tqdm=False)[0].outputs[0].all_token_ids
        direct = remask.diffusion_generate(model, prompt, reference_ties=ties, **kwargs)[0, 5:].tolist()
        assert engine == direct
    with pytest.raises(ValueError, match="reference_ties"):
        remask.diffusion_generate(model, prompt, reference_ties="yes", **kwargs)

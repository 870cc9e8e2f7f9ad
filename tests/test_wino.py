"""WINO (wide-in, narrow-out revocable decoding): token-for-token reproduction of the official
`decoding_wino` (Feng-Hong/WINO-DLLM, run with its own LLaDA modeling on tiny checkpoints; see the
fixture's meta), rows of a batch decided alone, and the invariants."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from remask.diffusion.parts.stats import GenerationStats
from remask.diffusion.methods.wino import WINO, shadow_attention, wino_generate, wino_steps
from remask.models.spec import get_spec

from helpers import as_progress, load_fixture_checkpoint, margin_case

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "wino_reference.json").read_text())
MASK = 299
@pytest.fixture(scope="module")
def load(tmp_path_factory):
    return lambda name: load_fixture_checkpoint(tmp_path_factory, FIXTURE["meta"]["checkpoints"], name)


def run(model, prompt, kwargs, commit_mask_token=False, **extra):
    config = WINO(threshold=kwargs["threshold"], threshold_back=kwargs["threshold_back"],
                  commit_mask_token=commit_mask_token)
    return wino_generate(model, prompt, config=config, gen_length=kwargs["gen_length"],
                         block_length=kwargs["block_length"], **extra)


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=[c["name"] for c in FIXTURE["cases"]])
def test_reproduces_the_official_decoding_wino(load, case):
    margin_case("wino_reference.json", case)
    model = load(case["checkpoint"])
    prompt = torch.tensor([case["prompt"]])
    x, forwards = run(model, prompt, case["kwargs"], commit_mask_token=True)
    assert x[0].tolist() == case["output_ids"]
    assert forwards.tolist() == [case["steps"]]
    stats = GenerationStats()
    x, forwards = run(model, prompt, case["kwargs"], stats=stats)
    assert (x[0].tolist() == case["output_ids"]) != case["default_differs"]
    assert not bool((x == MASK).any()) and torch.equal(x[:, :prompt.shape[1]], prompt)
    assert stats.nfe == int(forwards[0]) and len(stats.tokens_per_step) == stats.nfe


def test_commit_mask_token_decodes_earlier_mask_tokens_again_as_upstream(load):
    """At a low threshold (0.2, below the published configs) upstream can commit the mask token in a
    block; the next block's mask index covers the whole sequence, so upstream decodes those positions
    again. The fixture's cases where the official run's forwards saw this (a hook on the reference)
    are reproduced by `test_reproduces_the_official_decoding_wino`; here the streamed canvas shows the
    re-opening, and no position reported final changes afterwards."""
    cases = [c for c in FIXTURE["cases"] if c.get("reopens_earlier_block")]
    assert len(cases) >= 3 and {c["kwargs"]["threshold"] for c in cases} == {0.2}
    reopened = []
    for case in cases:
        model, k = load(case["checkpoint"]), case["kwargs"]
        prompt = torch.tensor([case["prompt"]])
        P, block = prompt.shape[1], k["block_length"]
        config = WINO(threshold=0.2, threshold_back=k["threshold_back"], commit_mask_token=True)
        waiting = set()   # generated positions holding the mask token before the block a forward decodes

        def look(module, args, kwargs):
            ids = (args[0] if args else kwargs["input_ids"])[0]
            start = int(kwargs["position_ids"][0, -block])
            waiting.update(i - P for i in range(P, start) if int(ids[i]) == MASK)
        hook = model.register_forward_pre_hook(look, with_kwargs=True)
        try:
            view = as_progress(wino_steps(get_spec(model), prompt, config=config, gen_length=k["gen_length"],
                                          block_length=block), model)
            seen = []
            while True:
                try:
                    progress = next(view)
                except StopIteration as stop:
                    x, forwards = stop.value
                    break
                seen.append((progress.x.clone(), progress.final))
        finally:
            hook.remove()
        assert x[0].tolist() == case["output_ids"] and forwards.tolist() == [case["steps"]]
        for canvas, final in seen:   # what was reported final never changes
            assert canvas[0, :P + final].tolist() == case["output_ids"][:P + final]
        assert waiting, case["name"]
        # decoded again: a block-local loop would have returned the mask token there
        reopened.append(any(case["output_ids"][P + i] != MASK for i in waiting))
    assert any(reopened)


def test_shadow_attention_layout():
    allowed = shadow_attention(2, 4, 4, 2, torch.device("cpu"))[0, 0]
    assert allowed.shape == (8, 8)
    assert bool(allowed[:6, :6].all()) and not bool(allowed[:6, 6:].any())     # nobody real sees the shadow
    assert bool(allowed[6:, 6:].all())                                           # shadow sees shadow
    assert allowed[6:, 4:6].tolist() == [[False, True], [True, False]]          # ... but not its own twin
    assert bool(allowed[6:, :4].all())


def test_batch_rows_are_decided_alone(load):
    model = load("llada_small_peaked")
    prompts = torch.tensor([[5, 17, 42, 99, 7, 8], [200, 3, 77, 150, 12, 9], [44, 44, 1, 2, 3, 250]])
    kwargs = dict(threshold=0.6, threshold_back=0.9, gen_length=32, block_length=16)
    x, forwards = run(model, prompts, kwargs)
    for b in range(3):
        alone, n = run(model, prompts[b:b + 1], kwargs)
        assert torch.equal(x[b], alone[0]) and int(forwards[b]) == int(n[0])
    assert len(set(forwards.tolist())) > 1      # the rows did not move in lockstep
    assert not bool((x == MASK).any()) and torch.equal(x[:, :6], prompts)


def test_left_padded_rows_decode(load):
    model = load("llada_small_peaked")
    prompt = torch.tensor([[297, 297, 5, 17, 42, 99], [200, 3, 77, 150, 12, 9]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    x, _ = wino_generate(model, prompt, gen_length=16, block_length=16, attention_mask=mask)
    alone, _ = wino_generate(model, prompt[1:], gen_length=16, block_length=16)
    assert torch.equal(x[1], alone[0]) and not bool((x == MASK).any()) and torch.equal(x[:, :6], prompt)


@pytest.mark.parametrize("field,value", [("threshold", 1.5), ("threshold_back", -0.1), ("accept_ratio", 0.0),
                                         ("accept_floor", 0), ("accept_cap", 0), ("initial_last_accept", 0)])
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        WINO(**{field: value})
    with pytest.raises((ValueError, TypeError), match="commit_mask_token"):
        WINO(commit_mask_token=1)
    with pytest.raises(ValueError, match="accept_floor"):
        WINO(accept_floor=30, accept_cap=20)


def test_argument_errors(load):
    model = load("llada_small")
    with pytest.raises(ValueError, match="block_length"):
        wino_generate(model, torch.tensor([[1, 2]]), gen_length=24, block_length=16)
    with pytest.raises(ValueError, match="mask token"):
        wino_generate(model, torch.tensor([[1, MASK]]), gen_length=16, block_length=16)
    with pytest.raises(ValueError, match="config"):
        wino_generate(model, torch.tensor([[1, 2]]), config={"threshold": 0.5}, gen_length=16, block_length=16)


def test_one_interface_generate_and_the_engine():
    """`decoder=remask.WINO(...)` in `remask.generate` and `remask.SamplingParams` equals `wino_generate`;
    a cache or a setting WINO does not read is refused by name."""
    import warnings

    import remask
    from remask.zoo import charset

    model, _ = remask.load("tiny-llada")
    prompt = torch.tensor([charset.encode_chat("rev abcdef")])
    config = remask.WINO(threshold=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected, _ = wino_generate(model, prompt, config=config, gen_length=32, block_length=16)
        got = remask.generate(model, prompt, steps=32, gen_length=32, block_length=16, decoder=config)
        served = remask.LLM(model).generate([prompt[0].tolist()], remask.SamplingParams(
            max_tokens=32, block_length=16, temperature=0.0, decoder=config), use_tqdm=False)[0]
    assert got.tolist() == expected.tolist()
    assert served.outputs[0].all_token_ids == expected[0, prompt.shape[1]:].tolist()
    # `steps` left at generate's default is not a setting the caller gave: accepted
    assert remask.generate(model, prompt, gen_length=32, block_length=16, decoder=config).tolist() == got.tolist()
    with pytest.raises(ValueError, match="steps"):
        remask.generate(model, prompt, steps=8, gen_length=32, block_length=16, decoder=config)
    with pytest.raises(ValueError, match="use_cache"):
        remask.generate(model, prompt, steps=32, gen_length=32, block_length=16, decoder=config, use_cache="dual")
    with pytest.raises(ValueError, match="threshold"):
        remask.generate(model, prompt, steps=32, gen_length=32, block_length=16, decoder=config, threshold=0.9)

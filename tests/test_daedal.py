"""DAEDAL (variable-length generation): token-for-token reproduction of the official `generate`
(Li-Jinsong/DAEDAL `models/LLaDA_DAEDAL.py`, run with its own LLaDA modeling on tiny EOS-biased
checkpoints; see the fixture's meta), each forward's canvas length included; the refusals; the
engine equal to the drop-in, packed with other requests; never a mask token in an output."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from remask.diffusion.methods.daedal import DAEDAL, daedal_generate, daedal_steps
from remask.diffusion.parts.stats import GenerationStats
from remask.models.spec import get_spec

from helpers import load_fixture_checkpoint, margin_case

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "daedal_reference.json").read_text())
CASES = FIXTURE["cases"]
MASK, EOS = 299, 298


@pytest.fixture(scope="module")
def load(tmp_path_factory):
    return lambda name: load_fixture_checkpoint(tmp_path_factory, FIXTURE["meta"]["checkpoints"], name)


def split(kwargs: dict) -> tuple[DAEDAL, int, int]:
    """(config, gen_length, block_length) of upstream's keyword arguments."""
    kw = dict(kwargs)
    return DAEDAL(**{k: v for k, v in kw.items() if k not in ("max_gen_length", "block_length", "cfg_scale")}), \
        kw.get("max_gen_length", 2048), kw.get("block_length", 32)


def generated_length(case: dict) -> int:
    return len(case["output_ids"]) - len(case["prompt"])


def sampling(case: dict) -> dict:
    """A seeded case's `temperature` and generator (upstream ran `torch.manual_seed(seed)` before the call), a
    guided case's `cfg_scale`."""
    out = {"cfg_scale": case["kwargs"]["cfg_scale"]} if "cfg_scale" in case["kwargs"] else {}
    if "seed" in case:
        out.update(temperature=case["temperature"], generator=torch.Generator().manual_seed(case["seed"]))
    return out


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_reproduces_the_official_daedal(load, case):
    margin_case("daedal_reference.json", case)
    model = load(case["checkpoint"])
    prompt = torch.tensor([case["prompt"]])
    config, gen_length, block_length = split(case["kwargs"])
    lengths = []
    hook = model.register_forward_pre_hook(lambda m, args, kw: lengths.append(args[0].shape[1]), with_kwargs=True)
    stats = GenerationStats()
    try:
        x = daedal_generate(model, prompt, config=config, gen_length=gen_length, block_length=block_length, stats=stats,
                            **sampling(case))
    finally:
        hook.remove()
    assert x[0].tolist() == case["output_ids"]
    assert lengths == case["canvas_lengths"] and stats.nfe == case["forwards"]
    assert not bool((x == MASK).any()) and torch.equal(x[:, :prompt.shape[1]], prompt)
    assert len(stats.tokens_per_step) == stats.nfe and stats.generated_tokens == generated_length(case)


def test_the_fixture_grows_inserts_and_stops_short():
    """The kept cases exercise both stages: canvases that grew and ones that did not, masks inserted
    while decoding, answers shorter than gen_length and ones that reached it."""
    grew = [c for c in CASES if c["stage1_forwards"] > 1]
    stayed = [c for c in CASES if c["stage1_forwards"] == 1]
    inserted = [c for c in CASES if any(b > a for a, b in zip(c["canvas_lengths"][c["stage1_forwards"]:],
                                                               c["canvas_lengths"][c["stage1_forwards"] + 1:]))]
    short = [c for c in CASES if generated_length(c) < c["kwargs"]["max_gen_length"]]
    assert len(CASES) >= 8 and len(grew) >= 5 and len(stayed) >= 5 and len(inserted) >= 3
    assert 5 <= len(short) < len(CASES)
    assert all(generated_length(c) <= c["kwargs"]["max_gen_length"] for c in CASES)


def test_rows_of_a_batch_are_decoded_alone(load):
    """Each row decodes as alone (its pads hidden); a row that ended shorter is filled with EOS."""
    model = load("llada_eos_a")
    picked = [c for c in CASES if c["checkpoint"] == "llada_eos_a" and c["kwargs"] == CASES[0]["kwargs"]
              and "seed" not in c][:2]
    config, gen_length, block_length = split(picked[0]["kwargs"])
    P = max(len(c["prompt"]) for c in picked)
    prompt = torch.tensor([[297] * (P - len(c["prompt"])) + c["prompt"] for c in picked])
    mask = torch.tensor([[0] * (P - len(c["prompt"])) + [1] * len(c["prompt"]) for c in picked])
    x = daedal_generate(model, prompt, config=config, gen_length=gen_length, block_length=block_length,
                        attention_mask=mask)
    lengths = set()
    for b in range(len(picked)):
        alone = daedal_generate(model, prompt[b:b + 1], config=config, gen_length=gen_length,
                                block_length=block_length, attention_mask=mask[b:b + 1])
        assert torch.equal(x[b, :alone.shape[1]], alone[0]) and bool((x[b, alone.shape[1]:] == EOS).all())
        lengths.add(alone.shape[1])
    assert x.shape[1] == max(lengths) and not bool((x == MASK).any()) and torch.equal(x[:, :P], prompt)


@pytest.mark.parametrize("field,value", [("initial_gen_length", 0), ("expansion_factor", -1), ("eos_check_tokens", 0),
                                         ("high_conf_threshold", float("nan")), ("low_conf_threshold", "0.1"),
                                         ("eos_confidence_threshold", float("inf")),
                                         ("expand_eos_confidence_threshold", None), ("initial_gen_length", 8.0)])
def test_config_errors_name_the_field(field, value):
    with pytest.raises((ValueError, TypeError), match=field):
        DAEDAL(**{field: value})


def test_argument_errors(load):
    model = load("llada_eos_a")
    with pytest.raises(ValueError, match="mask token"):
        daedal_generate(model, torch.tensor([[1, MASK]]), gen_length=16)
    with pytest.raises(ValueError, match="config"):
        daedal_generate(model, torch.tensor([[1, 2]]), config={"initial_gen_length": 8}, gen_length=16)
    for name, kwargs in (("gen_length", dict(gen_length=0)), ("block_length", dict(gen_length=16, block_length=0))):
        with pytest.raises(ValueError, match=name):
            daedal_steps(get_spec(model), torch.tensor([[1, 2]]), **kwargs)


def test_a_model_without_an_eos_id_is_refused(load, monkeypatch):
    import dataclasses

    from remask.diffusion.methods import daedal

    checked = daedal.check_method_call
    monkeypatch.setattr(daedal, "check_method_call", lambda *args, **kwargs: (
        dataclasses.replace(checked(*args, **kwargs)[0], eos_id=None), GenerationStats()))
    with pytest.raises(ValueError, match="no eos id"):
        daedal_generate(load("llada_eos_a"), torch.tensor([[1, 2]]), gen_length=16)


def test_a_model_proposing_only_the_mask_token_still_decodes(tmp_path):
    """Every candidate's argmax is the mask token: each forward commits the best other token of the position
    where it is most probable (upstream's fallback), so the canvas is decoded one position a forward."""
    from transformers import AutoModel

    from remask.models import tiny

    tiny.write_tiny_llada(str(tmp_path), seed=3, vocab_size=300, embedding_size=300, mask_token_id=MASK,
                          eos_token_id=EOS, pad_token_id=297, include_bias=True, logit_bias={MASK: 100.0})
    model = AutoModel.from_pretrained(str(tmp_path)).eval()
    stats = GenerationStats()
    x = daedal_generate(model, torch.tensor([[1, 2, 3]]), config=DAEDAL(initial_gen_length=8, expansion_factor=4),
                        gen_length=12, block_length=4, stats=stats)
    assert x.shape == (1, 15) and not bool((x == MASK).any())
    assert [n for n in stats.tokens_per_step if n] == [1] * 12   # (the length forwards commit nothing)


def test_gen_length_bounds_every_canvas(load):
    """`gen_length` is an "at most": an initial length past it starts at it, no canvas exceeds it."""
    model = load("llada_eos_a")
    prompt = torch.tensor([CASES[0]["prompt"]])
    lengths = []
    hook = model.register_forward_pre_hook(lambda m, args, kw: lengths.append(args[0].shape[1]), with_kwargs=True)
    try:
        x = daedal_generate(model, prompt, config=DAEDAL(initial_gen_length=64, expansion_factor=4,
                                                         eos_check_tokens=8), gen_length=12, block_length=5)
    finally:
        hook.remove()
    assert x.shape[1] <= prompt.shape[1] + 12 and max(lengths) <= prompt.shape[1] + 12
    assert not bool((x == MASK).any())


def test_the_engine_equals_the_drop_in(load):
    """`remask.LLM(model).generate(..., SamplingParams(decoder=remask.DAEDAL(...)))`: each request's
    tokens are its drop-in call's (its canvas grew and shrank between engine steps), packed with
    requests of other lengths and another method; `max_tokens` bounds the answer."""
    import remask

    model = load("llada_eos_a")
    cases = [c for c in CASES if c["checkpoint"] == "llada_eos_a" and "seed" not in c   # greedy (seeded, CFG: below)
             and "cfg_scale" not in c["kwargs"]]
    cases = sorted(cases, key=lambda c: (c["forwards"], c["name"]))[:: max(1, len(cases) // 6)][:6]
    assert len({generated_length(c) for c in cases}) > 1
    prompts, params = [], []
    for c in cases:
        config, gen_length, block_length = split(c["kwargs"])
        prompts.append(c["prompt"])
        params.append(remask.SamplingParams(max_tokens=gen_length, block_length=block_length, decoder=config))
    prompts.append(cases[0]["prompt"])
    params.append(remask.SamplingParams(max_tokens=16, block_length=8, decoder=remask.WINO()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outs = remask.LLM(model).generate(prompts, params, use_tqdm=False)
    for c, out, p in zip(cases, outs, params):
        got = out.outputs[0].all_token_ids
        assert got == c["output_ids"][len(c["prompt"]):] and len(got) <= p.max_tokens
        assert out.outputs[0].nfe == c["forwards"] and MASK not in got
    assert len(outs[-1].outputs[0].all_token_ids) == 16
    # the JSON form (HTTP API, CLI) and remask.generate take it too
    c = cases[0]
    config, gen_length, block_length = split(c["kwargs"])
    as_json = remask.SamplingParams(max_tokens=gen_length, block_length=block_length,
                                    decoder={"name": "daedal", **{k: v for k, v in c["kwargs"].items()
                                                                  if k not in ("max_gen_length", "block_length")}})
    assert as_json.decoder == config
    got = remask.generate(model, torch.tensor([c["prompt"]]), gen_length=gen_length, block_length=block_length,
                          decoder=config)
    assert got[0].tolist() == c["output_ids"]


def test_settings_it_does_not_read_are_refused(load):
    import remask

    model = load("llada_eos_a")
    prompt = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="top_p"):
        remask.SamplingParams(max_tokens=16, temperature=0.7, top_p=0.9, decoder=remask.DAEDAL())
    with pytest.raises(ValueError, match="temperature"):
        remask.generate(model, prompt, gen_length=16, block_length=8, temperature=-1.0, decoder=remask.DAEDAL())
    with pytest.raises(ValueError, match="cfg_scale"):
        remask.generate(model, prompt, gen_length=16, block_length=8, cfg_scale=-1.0, decoder=remask.DAEDAL())
    with pytest.raises(ValueError, match="use_cache"):
        remask.generate(model, prompt, gen_length=16, block_length=8, use_cache="dual", decoder=remask.DAEDAL())


def test_seeded_sampling_in_the_engine(load):
    """`temperature` > 0 with a seed: the engine's tokens are the seeded fixture's (SamplingParams.seed is the
    generator's seed, as upstream's `torch.manual_seed`), whatever requests decode beside it; the same seed gives
    the same tokens and the cases' samples are not the greedy answers."""
    import remask

    model = load("llada_eos_a")
    seeded = [c for c in CASES if "seed" in c and c["checkpoint"] == "llada_eos_a"][:4]
    assert len(seeded) == 4
    prompts, params = [], []
    for c in seeded:
        config, gen_length, block_length = split(c["kwargs"])
        prompts.append(c["prompt"])
        params.append(remask.SamplingParams(max_tokens=gen_length, block_length=block_length, decoder=config,
                                            temperature=c["temperature"], seed=c["seed"]))
    llm = remask.LLM(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        together = llm.generate(prompts, params, use_tqdm=False)
        alone = [llm.generate([p], q, use_tqdm=False)[0] for p, q in zip(prompts[::-1], params[::-1])][::-1]
    for c, a, b in zip(seeded, together, alone):
        assert a.outputs[0].all_token_ids == b.outputs[0].all_token_ids == c["output_ids"][len(c["prompt"]):]
    greedy = [daedal_generate(model, torch.tensor([c["prompt"]]), config=split(c["kwargs"])[0],
                              gen_length=split(c["kwargs"])[1], block_length=split(c["kwargs"])[2])[0].tolist()
              for c in CASES if "seed" in c]
    assert sum(g != c["output_ids"] for g, c in zip(greedy, [c for c in CASES if "seed" in c])) >= len(greedy) // 2


def test_guided_cases_in_the_engine(load):
    """`cfg_scale` > 0 (LLaDA's unsupervised CFG on the denoising forwards, as upstream): the engine gives the
    fixture's tokens and forward counts, greedy and seeded, packed together."""
    import remask

    model = load("llada_eos_b")
    guided = [c for c in CASES if "cfg_scale" in c["kwargs"] and c["checkpoint"] == "llada_eos_b"][::3]
    assert len(guided) >= 5 and any("seed" in c for c in guided) and any("seed" not in c for c in guided)
    prompts, params = [], []
    for c in guided:
        config, gen_length, block_length = split(c["kwargs"])
        prompts.append(c["prompt"])
        params.append(remask.SamplingParams(max_tokens=gen_length, block_length=block_length, decoder=config,
                                            cfg_scale=c["kwargs"]["cfg_scale"], temperature=c.get("temperature", 0.0),
                                            seed=c.get("seed")))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outs = remask.LLM(model).generate(prompts, params, use_tqdm=False)
    for c, out in zip(guided, outs):
        assert out.outputs[0].all_token_ids == c["output_ids"][len(c["prompt"]):]
        assert out.outputs[0].nfe == c["forwards"]

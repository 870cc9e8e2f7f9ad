"""Prophet (`remask.Prophet`, diffusion/methods/prophet.py): token-for-token and forward-for-forward
reproduction of the official `generate_earlyexit.generate` (pixeli99/Prophet, run with Fast-dLLM
v1's LLaDA modeling on tiny checkpoints; see the fixture's meta), its refusals by name, rows of a
batch decoded alone, and the engine equal to the drop-in."""
from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch

import remask
from remask.diffusion.methods import registry
from remask.diffusion.methods.prophet import Prophet, prophet_generate
from remask.diffusion.parts.checks import CombinationError
from remask.diffusion.parts.stats import GenerationStats
from remask.models.spec import get_spec

from helpers import load_fixture_checkpoint, margin_case

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "prophet_reference.json").read_text())
MASK = 299
CONFIG_KEYS = ("answer_start_pos", "early_exit_thresholds", "constraints")


@pytest.fixture(scope="module")
def load(tmp_path_factory):
    return lambda name: load_fixture_checkpoint(tmp_path_factory, FIXTURE["meta"]["checkpoints"], name)


def split(kwargs: dict) -> tuple[Prophet, dict]:
    """A case's keyword arguments: the Prophet config, and the block loop's settings."""
    return Prophet(**{k: v for k, v in kwargs.items() if k in CONFIG_KEYS}), \
        {k: v for k, v in kwargs.items() if k not in CONFIG_KEYS}


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=[c["name"] for c in FIXTURE["cases"]])
def test_reproduces_the_official_prophet(load, case):
    margin_case("prophet_reference.json", case)
    model = load(case["checkpoint"])
    prompt = torch.tensor([case["prompt"]])
    config, settings = split(case["kwargs"])
    stats = GenerationStats()
    if case.get("seed") is not None:   # random remasking: upstream's uniforms from torch's global generator
        torch.manual_seed(case["seed"])
    x = prophet_generate(model, prompt, config=config, stats=stats, **settings)
    assert x[0].tolist() == case["output_ids"]
    assert stats.nfe == case["nfe"] == (case["exit_step"] or settings["steps"])
    assert not bool((x == MASK).any()) and torch.equal(x[:, :prompt.shape[1]], prompt)


def test_fixture_covers_exits_in_every_phase_and_runs_without_one():
    phases = set()
    for case in FIXTURE["cases"]:
        if case["exit_step"] is not None:
            progress = case["exit_step"] / case["kwargs"]["steps"]
            phases.add("early" if progress < 0.33 else "mid" if progress < 0.67 else "late")
    assert phases == {"early", "mid", "late"}
    assert any(c["exit_step"] is None and c["kwargs"].get("answer_start_pos") is not None for c in FIXTURE["cases"])
    kinds = [k for c in FIXTURE["cases"] for k in ("cfg_scale", "constraints", "remasking") if k in c["kwargs"]]
    assert {"cfg_scale", "constraints", "remasking"} <= set(kinds)


def test_generate_and_the_engine_equal_the_drop_in(load):
    """`remask.generate(decoder=Prophet(...))` and the engine (`SamplingParams(decoder=...)`: CFG and
    random remasking read) give the official tokens, one case of each setting."""
    seen = set()
    for case in FIXTURE["cases"]:
        kind = case["name"].rsplit("_p", 1)[0]
        if kind in seen or case.get("seed") is not None:
            continue
        seen.add(kind)
        model = load(case["checkpoint"])
        config, settings = split(case["kwargs"])
        got = remask.generate(model, torch.tensor([case["prompt"]]), decoder=config, **settings)
        assert got[0].tolist() == case["output_ids"], case["name"]
        served = remask.LLM(model).generate([case["prompt"]], remask.SamplingParams(
            max_tokens=settings["gen_length"], block_length=settings["block_length"], steps=settings["steps"],
            cfg_scale=settings.get("cfg_scale", 0.0), decoder=config), use_tqdm=False)[0]
        assert served.outputs[0].all_token_ids == case["output_ids"][len(case["prompt"]):], case["name"]
    assert len(seen) >= 8
    # seeded random remasking: the engine's request generator (seed=3) is the drop-in's `generator`
    model, prompt = load("llada_small"), [5, 17, 42, 99, 7, 8]
    config = Prophet(answer_start_pos=16, early_exit_thresholds={"late": 0.7})
    expected = prophet_generate(model, torch.tensor([prompt]), config=config, steps=16, gen_length=16,
                                block_length=16, remasking="random", generator=torch.Generator().manual_seed(3))
    served = remask.LLM(model).generate([prompt], remask.SamplingParams(
        max_tokens=16, steps=16, remasking="random", seed=3, decoder=config), use_tqdm=False)[0]
    assert served.outputs[0].all_token_ids == expected[0, 6:].tolist() and not bool((expected == MASK).any())


def test_rows_of_a_left_padded_batch_decode_alone(load):
    model = load("llada_small_peaked")
    prompt = torch.tensor([[297, 297, 5, 17, 42, 99], [200, 3, 77, 150, 12, 9], [44, 44, 1, 2, 3, 250]])
    attention_mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6, [1] * 6])
    config = Prophet(answer_start_pos=14, early_exit_thresholds={"early": 4.0, "mid": 3.0, "late": 2.0},
                     constraints={1: 17})
    stats = GenerationStats()
    x = prophet_generate(model, prompt, config=config, steps=16, gen_length=16, block_length=8,
                         attention_mask=attention_mask, stats=stats)
    forwards = []
    for b in range(3):
        alone = GenerationStats()
        row = prophet_generate(model, prompt[b:b + 1], config=config, steps=16, gen_length=16, block_length=8,
                               attention_mask=attention_mask[b:b + 1], stats=alone)
        assert torch.equal(x[b], row[0])
        forwards.append(alone.nfe)
    assert stats.nfe == sum(forwards) and len(set(forwards)) > 1     # each row stopped at its own exit
    assert not bool((x == MASK).any()) and torch.equal(x[:, :6], prompt) and bool((x[:, 7] == 17).all())


@pytest.mark.parametrize("field,value", [
    ("answer_start_pos", -1), ("answer_start_pos", 2.5), ("answer_length", 0),
    ("early_exit_thresholds", {"ealry": 1.0}), ("early_exit_thresholds", [7.5, 5.0, 2.5]),
    ("early_exit_thresholds", {"mid": math.nan}), ("early_exit_thresholds", {"late": "2.5"}),
    ("constraints", [(0, 5)]), ("constraints", {-1: 5}), ("constraints", {0: -3}), ("constraints", {"x": 5})])
def test_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        Prophet(**{field: value})


def test_call_refusals_name_the_parameter(load):
    model = load("llada_small")
    prompt = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="constraints"):      # upstream drops it silently
        prophet_generate(model, prompt, config=Prophet(constraints={16: 5}), steps=16, gen_length=16, block_length=16)
    with pytest.raises(ValueError, match="constraints"):      # it would stay a mask in the output
        prophet_generate(model, prompt, config=Prophet(constraints={0: MASK}), steps=16, gen_length=16, block_length=16)
    with pytest.raises(ValueError, match="constraints"):
        prophet_generate(model, prompt, config=Prophet(constraints={0: 300}), steps=16, gen_length=16, block_length=16)
    for start in (0, 19):   # [0, 3) is the prompt, 19 lies past the sequence: upstream would never exit
        with pytest.raises(ValueError, match="answer_start_pos"):
            prophet_generate(model, prompt, config=Prophet(answer_start_pos=start, answer_length=3 if start == 0 else 5),
                             steps=16, gen_length=16, block_length=16)
    with pytest.raises(ValueError, match="steps"):
        prophet_generate(model, prompt, steps=3, gen_length=16, block_length=8)
    with pytest.raises(ValueError, match="cfg_scale"):
        prophet_generate(model, prompt, steps=16, gen_length=16, block_length=16, cfg_scale=-1.0)
    with pytest.raises(ValueError, match="config"):
        prophet_generate(model, prompt, config={"answer_start_pos": 3}, steps=16, gen_length=16, block_length=16)
    with pytest.raises(ValueError, match="use_cache"):
        remask.generate(model, prompt, steps=16, gen_length=16, block_length=16, decoder=Prophet(), use_cache="dual")
    with pytest.raises(ValueError, match="temperature"):   # greedy, as every decoder=
        remask.generate(model, prompt, steps=16, gen_length=16, block_length=16, decoder=Prophet(), temperature=0.5)
    with pytest.raises(ValueError, match="constraints"):
        remask.SamplingParams(max_tokens=16, decoder=Prophet(constraints={20: 5}))
    # a structure is taken (tests/test_structured_own_loops.py), but not with pinned tokens it could refuse
    with pytest.raises(CombinationError, match="structured_outputs.*constraints"):
        from remask.diffusion.methods.prophet import prophet_steps
        prophet_steps(get_spec(model), prompt, config=Prophet(constraints={0: 5}), steps=16, gen_length=16,
                      block_length=16, structure=object())


def test_registered_with_its_json_name():
    method = registry.METHODS["prophet"]
    assert method.config is remask.Prophet and not method.is_rule and "cfg_scale" in method.reads
    params = remask.SamplingParams(max_tokens=16, decoder={"name": "prophet", "answer_start_pos": 10,
                                                           "early_exit_thresholds": {"mid": 3},
                                                           "constraints": {"3": 17}})
    assert params.decoder == Prophet(answer_start_pos=10, early_exit_thresholds={"mid": 3.0}, constraints={3: 17})
    assert Prophet(early_exit_thresholds={"mid": 3}).threshold_at(1, 2) == 3.0      # progress 0.5: mid
    assert Prophet().threshold_at(1, 4) == 7.5 and Prophet().threshold_at(3, 4) == 2.5


def test_exit_fills_every_block_on_tiny_llada():
    """On the trained tiny-llada the answer is sure at once: one forward fills all the blocks, no mask left."""
    from remask.zoo import charset

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = remask.load("tiny-llada")[0]
        prompt = torch.tensor([charset.encode_chat("sort 52814")])
        P = prompt.shape[1]
        stats = GenerationStats()
        x = remask.generate(model, prompt, steps=16, gen_length=16, block_length=4, stats=stats,
                            decoder=Prophet(answer_start_pos=P, early_exit_thresholds={"early": 2.0}))
        plain = remask.generate(model, prompt, steps=16, gen_length=16, block_length=4)
    assert stats.nfe == 1 and not bool((x == remask.get_spec(model).mask_id).any())
    assert torch.equal(x[:, :P], prompt) and x[0, P:P + 5].tolist() == plain[0, P:P + 5].tolist()


def test_on_dream_the_engine_equals_the_drop_in(tmp_path):
    """LLaDA's block loop reads any mask model through its spec (Dream's shifted logits included), so
    Prophet runs on Dream too (docs/compatibility.md); the exit reads the aligned logits."""
    from transformers import AutoModel

    from remask.models import tiny

    tiny.write_tiny_dream(str(tmp_path), seed=2)
    model = AutoModel.from_pretrained(str(tmp_path)).eval()
    prompt = [5, 17, 42, 99, 7, 8]
    config = Prophet(answer_start_pos=14, early_exit_thresholds={"early": 1.0, "mid": 0.5, "late": 0.2})
    stats = GenerationStats()
    x = remask.generate(model, torch.tensor([prompt]), steps=16, gen_length=16, block_length=8, decoder=config,
                        stats=stats)
    served = remask.LLM(model).generate([prompt], remask.SamplingParams(
        max_tokens=16, steps=16, block_length=8, decoder=config), use_tqdm=False)[0]
    assert served.outputs[0].all_token_ids == x[0, 6:].tolist() and stats.nfe < 16
    assert not bool((x == remask.get_spec(model).mask_id).any())

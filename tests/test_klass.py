"""KLASS (`remask.KLASS`, diffusion/methods/klass.py): the official samplers' tokens (shkim0116/KLASS,
`llada_klass.stable_confident_decode` and Dream's `alg="klass"`, run outside the repository on tiny
official-format checkpoints: tests/fixtures/klass_reference.json; seeded where upstream draws: its temperature
and `unmask_strategy="random"`), the refusals, the engine equal to the drop-in, and the rule on a block family's own
loop."""
from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM

import remask
from remask.diffusion.methods import registry
from remask.diffusion.methods.dinfer import dinfer_generate
from remask.models import get_spec, tiny

from helpers import margin_case, rule_on_sdar_drop_in_equals_engine

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "klass_reference.json")
with open(FIXTURE) as f:
    DATA = json.load(f)
_MODELS: dict[str, torch.nn.Module] = {}


def checkpoint(tmp_path_factory, name: str) -> torch.nn.Module:
    ck = DATA["meta"]["checkpoints"][name]
    if name not in _MODELS:
        path = str(tmp_path_factory.mktemp(name))
        assert getattr(tiny, ck["writer"])(path, **ck["kwargs"]) == ck["digest"], "the tiny writer changed"
        _MODELS[name] = AutoModel.from_pretrained(path).eval()
    return _MODELS[name]


def rule_of(kwargs: dict) -> remask.KLASS:
    return remask.KLASS(**{k: kwargs[k] for k in ("conf_threshold", "kl_threshold", "kl_history_length",
                                                  "unmask_strategy") if k in kwargs})


def decode(model: torch.nn.Module, case: dict, stats: remask.GenerationStats | None = None) -> list:
    kw = case["kwargs"]
    # a seeded case: upstream's torch.manual_seed(seed) before the call (Dream's batch: before its first row's call)
    sampling = dict(temperature=case["temperature"], generator=torch.Generator().manual_seed(case["seed"])) \
        if "seed" in case else {}
    mask = None if case.get("attention_mask") is None else torch.tensor(case["attention_mask"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # generation beyond the tiny models' trained length
        if case["checkpoint"].startswith("llada"):
            return remask.generate(model, torch.tensor([case["prompt"]]), steps=kw["steps"], gen_length=kw["gen_length"],
                                   block_length=kw["block_length"], decoder=rule_of(kw), stats=stats,
                                   **sampling)[0].tolist()
        return remask.diffusion_generate(model, torch.tensor(case["prompt"]), max_new_tokens=kw["gen_length"],
                                         block_length=kw["gen_length"], decoder=rule_of(kw), attention_mask=mask,
                                         **sampling).tolist()


@pytest.mark.parametrize("case", DATA["cases"], ids=lambda c: c["name"])
def test_reproduces_the_official_klass(case, tmp_path_factory):
    """Token for token, and LLaDA's forward count (upstream's `used_steps`); where upstream stopped with
    masks left (Dream's `steps` cap: `masks_left`), remask decodes on: the same tokens wherever upstream
    decoded one, and no mask."""
    model = checkpoint(tmp_path_factory, case["checkpoint"])
    margin_case(os.path.basename(FIXTURE), case)
    stats = remask.GenerationStats()
    out, ref = decode(model, case, stats), case["output_ids"]
    if not case.get("masks_left"):
        assert out == ref
        if "forwards" in case:
            assert stats.nfe == case["forwards"]
        return
    mask = get_spec(model).mask_id
    flat = (lambda rows: [t for row in rows for t in row]) if isinstance(ref[0], list) else (lambda row: row)
    assert mask not in flat(out)
    assert all(a == b for a, b in zip(flat(out), flat(ref)) if b != mask)


def test_the_cases_exercise_the_rule():
    """Upstream's greedy outputs are not its plain confidence schedule's: the KL-and-confidence commits decide; its
    seeded Dream outputs are mostly not its greedy ones: the fallback's draws decide."""
    greedy = [c for c in DATA["cases"] if "seed" not in c]
    assert len(greedy) >= 8 and {c["checkpoint"][:5] for c in greedy} == {"llada", "dream"}
    assert sum(bool(c.get("differs_from_plain")) for c in greedy) >= len(greedy) // 2
    seeded = [c for c in DATA["cases"] if "seed" in c and c["checkpoint"].startswith("dream") and not is_random(c)]
    assert len(seeded) >= 8 and sum(len(c["prompt"]) > 1 for c in seeded) >= 2
    assert sum(c["differs_from_greedy"] for c in seeded) >= len(seeded) // 2


def is_random(case: dict) -> bool:
    return case["kwargs"].get("unmask_strategy") == "random"


def test_the_random_cases_draw():
    """unmask_strategy="random" on each loop, greedy and at temperature > 0: at least eight cases drew among ready
    positions (`picks`: upstream's torch.randint calls) and most decode otherwise than "max_conf" with the same seed."""
    for family in ("llada", "dream"):
        cases = [c for c in DATA["cases"] if is_random(c) and c["checkpoint"].startswith(family)]
        assert len(cases) >= 8 and sum(c["picks"] > 0 for c in cases) >= 8
        assert {c["temperature"] > 0 for c in cases} == {False, True}
        assert sum(c["differs_from_max_conf"] for c in cases) >= len(cases) // 2


def test_llada_cases_exercise_the_kl_rule(tmp_path_factory):
    """On LLaDA too: in at least four cases upstream's KL-and-confidence commits decided (its tokens or its
    forward count are not LLaDA's plain low-confidence schedule with the same steps, decoded here), and each
    case's recorded `differs_from_plain` says so."""
    differs = []
    for case in (c for c in DATA["cases"] if c["checkpoint"].startswith("llada") and "seed" not in c):   # greedy
        model, kw, stats = checkpoint(tmp_path_factory, case["checkpoint"]), case["kwargs"], remask.GenerationStats()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plain = remask.generate(model, torch.tensor([case["prompt"]]), steps=kw["steps"],
                                    gen_length=kw["gen_length"], block_length=kw["block_length"], stats=stats)
        assert stats.nfe == kw["steps"]   # the schedule: one forward per step
        differs.append(plain[0].tolist() != case["output_ids"] or case["forwards"] != stats.nfe)
        assert differs[-1] == case["differs_from_plain"], case["name"]
    assert sum(differs) >= 4, f"{sum(differs)} of {len(differs)} LLaDA cases differ from the plain schedule"


@pytest.mark.parametrize("kwargs, name", [
    (dict(conf_threshold="0.9"), "conf_threshold"), (dict(kl_threshold=float("inf")), "kl_threshold"),
    (dict(kl_history_length=0), "kl_history_length"), (dict(kl_history_length=2.0), "kl_history_length"),
    (dict(unmask_strategy="best"), "unmask_strategy")])
def test_refuses_bad_values_by_name(kwargs, name):
    with pytest.raises(ValueError, match=name):
        remask.KLASS(**kwargs)


def test_refusals_at_the_call():
    model = remask.load("tiny-llada")[0]
    prompt = torch.tensor([[5, 6, 7]])
    rule = remask.KLASS()
    for kwargs, name in ((dict(use_cache="dual"), "use_cache"), (dict(temperature=-0.5, block_length=16), "temperature"),
                         (dict(steps=5, gen_length=16, block_length=8), "steps"),
                         (dict(gen_length=16, block_length=5), "block_length")):
        with pytest.raises(ValueError, match=name):
            remask.generate(model, prompt, decoder=rule, **{"gen_length": 16, **kwargs})
    with pytest.raises(ValueError, match="state"):
        rule.commit(prompt, torch.zeros(1, 3, 8), 7)


def test_random_is_refused_where_klass_is_a_rule():
    """"random" draws from the generator of KLASS's own loop; the loops that run it as a commit rule (Elastic-Cache's
    window, dInfer's blocks) refuse it by name at the call."""
    model, prompt = remask.load("tiny-llada")[0], torch.tensor([[5, 6, 7]])
    rule = remask.KLASS(unmask_strategy="random")
    for call in (lambda: remask.generate(model, prompt, gen_length=16, block_length=16, decoder=rule,
                                         use_cache=remask.ElasticCache()),
                 lambda: dinfer_generate(model, prompt, gen_length=16, block_length=8, decoder=rule)):
        with pytest.raises(ValueError, match="unmask_strategy"):
            call()


def test_registered_with_its_json_name():
    assert registry.METHODS["klass"].config is remask.KLASS and registry.METHODS["klass"].is_rule
    params = remask.SamplingParams(max_tokens=16, block_length=8, decoder={"name": "klass", "kl_threshold": 0.05})
    assert params.decoder == remask.KLASS(kl_threshold=0.05)


def test_engine_equals_the_drop_in(tmp_path_factory):
    """`LLM.generate` with `decoder=remask.KLASS(...)` gives `remask.generate`'s tokens (LLaDA's loop,
    two blocks, LLaDA's schedule as the fallback), greedy and seeded."""
    case = next(c for c in DATA["cases"] if c["checkpoint"] == "llada_peaked" and c["kwargs"]["block_length"] <
                c["kwargs"]["gen_length"])
    model, kw = checkpoint(tmp_path_factory, "llada_peaked"), case["kwargs"]
    served = remask.LLM(model).generate([case["prompt"]], remask.SamplingParams(
        max_tokens=kw["gen_length"], block_length=kw["block_length"], steps=kw["steps"], decoder=rule_of(kw)),
        use_tqdm=False)[0]
    assert served.outputs[0].all_token_ids == decode(model, case)[len(case["prompt"]):]
    # seeded (temperature > 0): SamplingParams.seed is upstream's torch.manual_seed, beside a greedy request
    seeded = [c for c in DATA["cases"] if "seed" in c and c["checkpoint"] == "llada_peaked"][:2]
    served = remask.LLM(model).generate([c["prompt"] for c in seeded] + [case["prompt"]], [remask.SamplingParams(
        max_tokens=c["kwargs"]["gen_length"], block_length=c["kwargs"]["block_length"], steps=c["kwargs"]["steps"],
        decoder=rule_of(c["kwargs"]), temperature=c["temperature"], seed=c["seed"]) for c in seeded] + [
        remask.SamplingParams(max_tokens=kw["gen_length"], block_length=kw["block_length"], steps=kw["steps"],
                              decoder=rule_of(kw))], use_tqdm=False)
    for c, out in zip(seeded, served):
        assert out.outputs[0].all_token_ids == c["output_ids"][len(c["prompt"]):]


def test_engine_samples_dream_as_the_seeded_fixture(tmp_path_factory):
    """Dream's loop: `SamplingParams(temperature=, seed=)` draws from the request's own generator (upstream after
    `torch.manual_seed(seed)`): a seeded case's tokens alone and packed beside another seeded and a greedy request,
    which gets `diffusion_generate`'s; the fallback's `top_p` / `top_k` (upstream's `sample_tokens`) are refused."""
    model = checkpoint(tmp_path_factory, "dream_peaked")
    greedy = next(c for c in DATA["cases"] if c["checkpoint"] == "dream_peaked" and not c.get("masks_left"))
    seeded = [c for c in DATA["cases"] if "seed" in c and c["checkpoint"] == "dream_peaked" and len(c["prompt"]) == 1
              and not is_random(c)]
    cases = [seeded[0], greedy, seeded[-1]]

    def params(c: dict, **extra) -> remask.SamplingParams:
        sampling = dict(temperature=c["temperature"], seed=c["seed"]) if "seed" in c else {}
        return remask.SamplingParams(max_tokens=c["kwargs"]["gen_length"], decoder=rule_of(c["kwargs"]),
                                     **sampling, **extra)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        alone = remask.LLM(model).generate([seeded[0]["prompt"][0]], params(seeded[0]), use_tqdm=False)[0]
        packed = remask.LLM(model).generate([c["prompt"][0] for c in cases], [params(c) for c in cases],
                                            use_tqdm=False)
    assert alone.outputs[0].all_token_ids == seeded[0]["output_ids"][0][len(seeded[0]["prompt"][0]):]
    kw = seeded[0]["kwargs"]   # LLaDA's drop-in on the Dream model hands the method temperature as Dream's does
    assert remask.generate(model, torch.tensor(seeded[0]["prompt"]), steps=kw["steps"], gen_length=kw["gen_length"],
                           block_length=kw["gen_length"], decoder=rule_of(kw), temperature=seeded[0]["temperature"],
                           generator=torch.Generator().manual_seed(seeded[0]["seed"]))[0].tolist() \
        == seeded[0]["output_ids"][0]
    for c, out in zip(cases, packed):
        assert out.outputs[0].all_token_ids == c["output_ids"][0][len(c["prompt"][0]):], c["name"]
    for name, value in (("top_p", 0.9), ("top_k", 5)):
        with pytest.raises(ValueError, match=name):
            remask.LLM(model).generate([greedy["prompt"][0]], params(seeded[0], **{name: value}), use_tqdm=False)


def test_engine_draws_random_as_the_drop_in(tmp_path_factory):
    """unmask_strategy="random": `SamplingParams(seed=)` is upstream's torch.manual_seed, each request its own
    generator; on LLaDA's loop and on Dream's, a greedy and a sampling request packed give the drop-in's tokens."""
    for name in ("llada_peaked", "dream_peaked"):
        model, llada = checkpoint(tmp_path_factory, name), name.startswith("llada")
        ours = [c for c in DATA["cases"] if is_random(c) and c["checkpoint"] == name and "attention_mask" not in c]
        cases = [next(c for c in ours if c["temperature"] == 0), next(c for c in ours if c["temperature"] > 0)]
        prompts = [c["prompt"] if llada else c["prompt"][0] for c in cases]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            served = remask.LLM(model).generate(prompts, [remask.SamplingParams(
                max_tokens=c["kwargs"]["gen_length"], steps=c["kwargs"]["steps"], decoder=rule_of(c["kwargs"]),
                block_length=c["kwargs"].get("block_length"), temperature=c["temperature"], seed=c["seed"])
                for c in cases], use_tqdm=False)
        for c, prompt, out in zip(cases, prompts, served):
            dropped_in = decode(model, c) if llada else decode(model, c)[0]
            assert out.outputs[0].all_token_ids == dropped_in[len(prompt):], c["name"]


def test_as_a_rule_on_sdar_drop_in_equals_engine(tmp_path):
    tiny.write_tiny_sdar(str(tmp_path), seed=0)   # SDAR's own loop, KLASS choosing the commits block by block
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rule_on_sdar_drop_in_equals_engine(AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval(),
                                           remask.KLASS(conf_threshold=0.5, kl_threshold=0.5))


def test_the_rule_commits_only_masks_and_at_least_one():
    mask = 9
    rule = remask.KLASS(conf_threshold=0.5, kl_threshold=0.5, kl_history_length=1)
    state = rule.new_state()
    block = torch.tensor([[1, mask, mask, mask], [mask, mask, mask, mask]])
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        logits = torch.randn(2, 4, 10, generator=g) * 4
        logits[..., mask] += 6.0   # a likely mask token: never proposed
        commit, tokens = rule.commit(block, logits, mask, state)
        assert not bool((commit & (block != mask)).any()) and not bool((tokens[commit] == mask).any())
        assert bool(commit[(block == mask).any(dim=-1)].any(dim=-1).all())
        block = torch.where(commit, tokens, block)

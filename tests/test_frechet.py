"""Fast-dLLM++'s Fréchet profile rule (`remask.FrechetRule`, diffusion/methods/frechet.py, and the flat
`frechet_margin=` of `remask.generate` / `SamplingParams`): the official loops (Ringo-Star/FastdLLM_plusplus
`v1/llada/generate.py`: no cache, prefix and dual cache) reproduced token for token and in NFE on tiny
official-format checkpoints (tests/fixtures/frechet_reference.json), a left-padded batch equal to its
rows alone, the rule written out against the commit, its refusals, and the rule on the loops that take
`decoder=` (LLaDA, Dream, SDAR, LLaDA2), the engine equal to the drop-in, with structured output. Its Dream
form (`v1/dream/model/generation_utils_block.py`: Fast-dLLM's Dream block decoder, prefix and dual cache) as
`remask.diffusion_generate(..., frechet_margin=)` (tests/fixtures/frechet_dream_reference.json)."""
from __future__ import annotations

import json
import math
import os
import warnings

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM

import remask
from remask.compat.fast_dllm import dream_diffusion_generate
from remask.diffusion.methods import registry
from remask.diffusion.parts.rules import rule_commit
from remask.diffusion.parts.selection import frechet_profile_counts
from remask.models import get_spec, tiny
from remask.zoo import charset

from helpers import left_pad, load_fixture_checkpoint, margin_case, random_prompt, rule_on_sdar_drop_in_equals_engine

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "frechet_reference.json")
with open(FIXTURE) as f:
    DATA = json.load(f)
with open(os.path.join(os.path.dirname(__file__), "fixtures", "frechet_dream_reference.json")) as f:
    DREAM = json.load(f)


def _id(case: dict) -> str:
    return f"{case['checkpoint']}-{case['mode']}-" + "-".join(f"{k}{v}" for k, v in case["kwargs"].items())


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {name: load_fixture_checkpoint(tmp_path_factory, DATA["meta"]["checkpoints"], name)
            for name in DATA["meta"]["checkpoints"]}


def _generate(model, prompt, case, attention_mask=None):
    kw = dict(case["kwargs"])
    sampled = kw.get("temperature", 0) > 0   # upstream's float64 torch noise stream
    stats = remask.GenerationStats()
    x = remask.generate(model, prompt, attention_mask, mask_id=case["mask_id"], stats=stats, reference_rng=sampled,
                        use_cache=None if case["mode"] == "none" else case["mode"], **kw)
    return x, stats.nfe


@pytest.mark.parametrize("case", DATA["cases"], ids=_id)
def test_reproduces_fast_dllm_plus_plus(case, models):
    margin_case("frechet_reference.json", case)
    if case.get("seed") is not None:
        torch.manual_seed(case["seed"])
    x, nfe = _generate(models[case["checkpoint"]], torch.tensor(case["prompt"]), case)
    assert not bool((x == case["mask_id"]).any())
    ref = torch.tensor(case["tokens"])
    if bool((ref == case["mask_id"]).any()):
        # upstream's dual cache runs at most `steps` forwards a block and leaves masks (docs/quirks.md); remask
        # finishes the block: up to the end of the first block upstream left unfinished, every position it
        # decoded is identical, and remask needed more forwards
        P, block = len(case["prompt"][0]), case["kwargs"]["block_length"]
        first_left = int((ref == case["mask_id"]).any(dim=0).nonzero()[0])
        end = P + ((first_left - P) // block + 1) * block
        decided = ref[:, :end] != case["mask_id"]
        assert case["mode"] == "dual" and torch.equal(x[:, :end][decided], ref[:, :end][decided])
        assert nfe > case["nfe"]
        return
    assert x.tolist() == case["tokens"] and nfe == case["nfe"]


@pytest.mark.parametrize("case", DATA["leftpad"], ids=_id)
def test_a_left_padded_batch_equals_the_reference_rows_alone(case, models):
    """Upstream takes no attention mask: each row was decoded alone by the reference; remask decodes
    them as one left-padded batch (pads masked) and alone, token for token (alone: NFE too)."""
    margin_case("frechet_reference.json", case)
    model, P = models[case["checkpoint"]], max(map(len, case["prompts"]))
    ids, mask = left_pad([torch.tensor(r) for r in case["prompts"]], case["pad_id"])
    x, nfe = _generate(model, ids, case, mask)
    # a batch's block ends when all its rows' have: its forwards are at least each row's alone
    assert x[:, P:].tolist() == case["tokens"] and nfe >= max(case["nfe"])
    for row, tokens, row_nfe in zip(case["prompts"], case["tokens"], case["nfe"]):
        alone, alone_nfe = _generate(model, torch.tensor([row]), case)
        assert alone[0, len(row):].tolist() == tokens and alone_nfe == row_nfe


def test_fixture_covers_the_three_loops_several_margins_and_parallel_commits():
    cases = DATA["cases"] + DATA["leftpad"]
    assert {c["mode"] for c in cases} == {"none", "prefix", "dual"} and len(DATA["cases"]) >= 8
    assert len({c["kwargs"]["frechet_margin"] for c in cases}) >= 4
    # fewer forwards than positions: several commits per step, so the profile decides
    assert any(c["nfe"] < c["kwargs"]["gen_length"] for c in DATA["cases"])
    assert all(c["min_margin"] is None or c["min_margin"] >= DATA["margins"]["bound"] for c in cases)


def written_out(block: torch.Tensor, logits: torch.Tensor, mask_id: int, margin: float) -> torch.Tensor:
    """The rule position by position: the masked positions by float64 confidence (lower index first),
    the score of each prefix n, ``Σ c − (n − 1) − (1 − c_n)``, the longest prefix above `margin` (at
    least one) committed to each position's argmax (the mask token excluded)."""
    out = block.clone()
    for b in range(block.shape[0]):
        conf, best = {}, {}
        for i in range(block.shape[1]):
            if int(block[b, i]) == mask_id:
                row = logits[b, i].double()
                avoid = row.clone()
                avoid[mask_id] = -math.inf
                best[i] = int(avoid.argmax())
                conf[i] = float(torch.softmax(row, dim=-1)[best[i]])
        order = sorted(conf, key=lambda i: (-conf[i], i))
        total, take = 0.0, min(1, len(order))
        for n, i in enumerate(order, start=1):
            total += conf[i]
            if n > 1 and (total - (n - 1)) - (1 - conf[i]) > margin:
                take = n
        for i in order[:take]:
            out[b, i] = best[i]
    return out


@pytest.mark.parametrize("seed", range(6))
def test_the_rule_commits_the_longest_profile_prefix(seed):
    g = torch.Generator().manual_seed(seed)
    mask = 13
    block = torch.tensor([[2, mask, mask, 5, mask, mask, mask, 1, mask], [mask] * 9, [1, 2, 3, 4, 5, 6, 7, 8, 9]])
    logits = torch.randn(3, 9, 17, generator=g) * (1.0 + 2 * seed)   # flat to sharp distributions
    logits[:, :, mask] += 4.0 * (seed % 2)                              # a likely mask token: never proposed
    kept = block.clone(), logits.clone()
    counts = set()
    for margin in (-1.0, -0.2, 0.0, 0.25, 0.6, 1.0):
        rule = remask.FrechetRule(frechet_margin=margin)
        commit, tokens = rule_commit(block, logits, mask, rule)
        assert torch.equal(block, kept[0]) and torch.equal(logits, kept[1])   # nothing in place
        assert torch.equal(torch.where(commit, tokens, block), written_out(block, logits, mask, margin))
        assert not bool((commit & (block != mask)).any()) and not bool((tokens[commit] == mask).any())
        assert bool(commit[:2].any(dim=-1).all()) and not bool(commit[2].any())
        counts.add(int(commit[1].sum()))
    assert 1 in counts   # δ = 1 commits one a step


def test_equal_confidences_are_fast_dllms_factor_rule_at_one_minus_margin():
    """The README's sanity check: with every confidence 1 − ε the score of n is ``1 − (n + 1)·ε``, so the rule
    commits the largest n with ``(n + 1)·ε < 1 − δ``: Fast-dLLM's factor condition at f = 1 − δ."""
    for eps in (0.013, 0.031, 0.07, 0.19):
        for margin in (0.0, 0.25, 0.5):
            conf = torch.full((1, 32), 1 - eps, dtype=torch.float64)
            n = int(frechet_profile_counts(conf, torch.ones_like(conf, dtype=torch.bool), margin))
            want = max([m for m in range(1, 33) if (m + 1) * eps < 1 - margin - 1e-12] + [1])
            assert n == want, (eps, margin)


def test_registered_exported_and_refusals(models):
    assert registry.METHODS["frechet"].config is remask.FrechetRule and registry.METHODS["frechet"].is_rule
    assert remask.FrechetRule().frechet_margin == 0.25
    params = remask.SamplingParams(max_tokens=16, block_length=8, decoder={"name": "frechet", "frechet_margin": 0.1})
    assert params.decoder == remask.FrechetRule(frechet_margin=0.1)
    for bad in (math.nan, math.inf, "0.2", True, None):
        with pytest.raises(ValueError, match="frechet_margin"):
            remask.FrechetRule(frechet_margin=bad)
        if bad is not None:
            with pytest.raises(ValueError, match="frechet_margin"):
                remask.SamplingParams(max_tokens=16, frechet_margin=bad)
    model = models["llada_bias_frechet"]
    prompt = random_prompt(1, 5, seed=1)
    for other in (dict(threshold=0.9), dict(factor=1.0)):
        name = next(iter(other))
        with pytest.raises(ValueError, match=f"at most one of .*got {name} and frechet_margin"):
            remask.generate(model, prompt, gen_length=8, block_length=8, frechet_margin=0.2, **other)
        with pytest.raises(ValueError, match="frechet_margin"):
            remask.SamplingParams(max_tokens=8, frechet_margin=0.2, **other)
        with pytest.raises(ValueError, match="frechet_margin"):
            remask.LLM(model).generate([prompt[0].tolist()], remask.SamplingParams(
                max_tokens=8, frechet_margin=0.2, **other), use_tqdm=False)
    with pytest.raises(ValueError, match=r"does not read \['frechet_margin'\]"):   # a decoder runs its own rule
        remask.generate(model, prompt, gen_length=8, block_length=8, frechet_margin=0.2,
                        decoder=remask.FrechetRule())
    with pytest.raises(ValueError, match="frechet_margin"):
        remask.SamplingParams(max_tokens=8, frechet_margin=0.2, decoder=remask.FrechetRule())
    with pytest.raises(ValueError, match="frechet_margin"):                         # Dream's own sampler
        remask.SamplingParams(max_tokens=8, frechet_margin=0.2, alg="entropy")


@pytest.mark.parametrize("use_cache", [None, "prefix", "dual"])
def test_engine_equals_the_drop_in(use_cache, models):
    model = models["llada_bias_frechet"]
    prompts = [random_prompt(1, n, seed=20 + n)[0] for n in (5, 9)]
    params = remask.SamplingParams(max_tokens=16, block_length=8, frechet_margin=0.25, use_cache=use_cache)
    served = remask.LLM(model).generate([p.tolist() for p in prompts], params, use_tqdm=False)
    for p, out in zip(prompts, served):
        alone = remask.generate(model, p[None], gen_length=16, block_length=8, steps=16, frechet_margin=0.25,
                                use_cache=use_cache)
        assert out.outputs[0].all_token_ids == alone[0, len(p):].tolist()


def test_the_rule_on_the_loops_that_take_a_rule_drop_in_equals_engine(tmp_path):
    rule = remask.FrechetRule(frechet_margin=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = remask.load("tiny-llada")[0]          # LLaDA: dInfer's block loop
        prompt = torch.tensor([charset.encode_chat("sort 52814")])
        x = remask.generate(model, prompt, gen_length=16, block_length=8, decoder=rule)
        assert torch.equal(x[:, :prompt.shape[1]], prompt) and not bool((x == get_spec(model).mask_id).any())
        served = remask.LLM(model).generate([prompt[0].tolist()], remask.SamplingParams(
            max_tokens=16, block_length=8, decoder=rule), use_tqdm=False)[0]
        assert served.outputs[0].all_token_ids == x[0, prompt.shape[1]:].tolist()
        dream_path = tmp_path / "dream"                # Dream: the same loop on shifted logits
        tiny.write_tiny_dream(str(dream_path), seed=4, vocab_size=300, mask_token_id=299, eos_token_id=298,
                              pad_token_id=298, bos_token_id=298)
        dream = AutoModel.from_pretrained(str(dream_path)).eval()
        prompt = random_prompt(1, 7, seed=3)
        x = remask.diffusion_generate(dream, prompt, max_new_tokens=16, block_length=8, decoder=rule)
        assert torch.equal(x[:, :7], prompt) and not bool((x == 299).any())
        served = remask.LLM(dream).generate([prompt[0].tolist()], remask.SamplingParams(
            max_tokens=16, block_length=8, decoder=rule), use_tqdm=False)[0]
        assert served.outputs[0].all_token_ids == x[0, 7:].tolist()
        tiny.write_tiny_sdar(str(tmp_path / "sdar"), seed=0)   # SDAR's own loop, the rule choosing the commits
        rule_on_sdar_drop_in_equals_engine(AutoModelForCausalLM.from_pretrained(str(tmp_path / "sdar")).eval(), rule)


def test_structured_output_flat_and_rule_drop_in_equals_engine():
    pytest.importorskip("llguidance")
    from remask.structured import StructuredOutputsParams

    model, tok = remask.load("tiny-llada")
    structure = StructuredOutputsParams(choice=["yes", "no", "maybe"])
    prompt = torch.tensor([charset.encode_chat("colour of grass")])
    llm = remask.LLM(model, tokenizer=tok)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for setting in (dict(frechet_margin=0.25), dict(decoder=remask.FrechetRule(frechet_margin=0.25))):
            steps = dict(steps=16) if "frechet_margin" in setting else {}
            x = remask.generate(model, prompt, gen_length=16, block_length=8, structured_outputs=structure,
                                tokenizer=tok, **steps, **setting)
            answer = x[0, prompt.shape[1]:].tolist()
            text = charset.decode_answer(answer)
            assert text in ("yes", "no", "maybe"), (setting, text)
            served = llm.generate([prompt[0].tolist()], remask.SamplingParams(
                max_tokens=16, block_length=8, structured_outputs=structure, **setting), use_tqdm=False)[0]
            assert served.outputs[0].all_token_ids == answer


# --- the Dream form: Fast-dLLM's Dream block decoder with the rule (Fast-dLLM++ v1/dream) ---

@pytest.fixture(scope="module")
def dream_models(tmp_path_factory):
    out = {}
    for name, ck in DREAM["meta"]["checkpoints"].items():
        path = str(tmp_path_factory.mktemp(name))
        assert tiny.write_tiny_dream(path, **ck["kwargs"]) == ck["digest"], "the tiny writer changed"
        out[name] = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    return out


def _dream_id(case: dict) -> str:
    return f"{case['checkpoint']}-{case['mode']}-b{len(case['prompts'])}-" + "-".join(
        f"{k}{v}" for k, v in case["kwargs"].items())


def _dream(model, rows, case):
    """Upstream's call through remask's drop-in of it (`dual_cache=`), left-padded rows with their mask; its
    `threshold` beside `frechet_margin` (upstream ignores it) left out: remask refuses the two together."""
    ids, mask = left_pad([torch.tensor(r) for r in rows], model.config.pad_token_id)
    kw = {k: v for k, v in case["kwargs"].items() if k != "threshold"}
    stats = remask.GenerationStats()
    x = dream_diffusion_generate(model, ids, attention_mask=None if bool(mask.all()) else mask,
                                 dual_cache=case["mode"] == "dual", stats=stats, **kw)
    return x, stats.nfe


@pytest.mark.parametrize("case", DREAM["cases"], ids=_dream_id)
def test_reproduces_fast_dllm_plus_plus_dream(case, dream_models):
    """Token for token and in NFE; a batch upstream never returned from (a decoded row gets the mask token
    written back while a batch-mate decodes: docs/quirks.md) equals its rows, each decoded alone by upstream."""
    margin_case("frechet_dream_reference.json", case)
    model = dream_models[case["checkpoint"]]
    x, nfe = _dream(model, case["prompts"], case)
    assert not bool((x == model.config.mask_token_id).any())
    if case["tokens"] is not None:
        assert x.tolist() == case["tokens"] and nfe == case["nfe"]
    for i, (row, alone, alone_nfe) in enumerate(zip(case["prompts"], case.get("alone", []), case.get("alone_nfe", []))):
        P = x.shape[1] - case["kwargs"]["max_new_tokens"]
        assert x[i, P:].tolist() == alone[len(row):] and nfe >= alone_nfe
        y, y_nfe = _dream(model, [row], case)
        assert y[0].tolist() == alone and y_nfe == alone_nfe


def test_dream_fixture_covers_both_caches_margins_blocks_and_batches():
    cases = DREAM["cases"]
    assert {c["mode"] for c in cases} == {"prefix", "dual"} and len(cases) >= 20
    assert len({c["kwargs"]["frechet_margin"] for c in cases}) >= 4
    assert len({c["kwargs"].get("block_length", 32) for c in cases}) >= 3
    assert any(len(c["prompts"]) == 2 for c in cases)
    assert any(c["tokens"] is not None and c["nfe"] < c["kwargs"]["max_new_tokens"] for c in cases)
    assert all(c["min_margin"] is None or c["min_margin"] >= DREAM["margins"]["bound"] for c in cases)


@pytest.mark.parametrize("use_cache", [None, "prefix", "dual"])
def test_dream_engine_equals_the_drop_in(use_cache, dream_models):
    model = dream_models["dream_frechet"]
    prompts = [random_prompt(1, n, seed=30 + n, high=8000)[0] for n in (5, 9)]
    for margin in (-0.5, 0.25):
        params = remask.SamplingParams(max_tokens=16, alg="entropy", block_length=8, frechet_margin=margin,
                                       use_cache=use_cache)
        served = remask.LLM(model).generate([p.tolist() for p in prompts], params, use_tqdm=False)
        for p, out in zip(prompts, served):
            alone = remask.diffusion_generate(model, p[None], max_new_tokens=16, steps=16, block_length=8,
                                              use_cache=use_cache, frechet_margin=margin)
            assert out.outputs[0].all_token_ids == alone[0, len(p):].tolist()


def test_dream_refusals_name_the_parameter(dream_models):
    model = dream_models["dream_frechet"]
    prompt = random_prompt(1, 5, seed=1, high=8000)
    run = dict(max_new_tokens=16, steps=16, block_length=8, use_cache="prefix")
    with pytest.raises(ValueError, match="at most one of .*got threshold and frechet_margin"):
        remask.diffusion_generate(model, prompt, frechet_margin=0.2, threshold=0.9, **run)
    with pytest.raises(ValueError, match="at most one of .*got threshold and frechet_margin"):
        dream_diffusion_generate(model, prompt, frechet_margin=0.2, threshold=0.9, max_new_tokens=16, steps=16)
    for bad in (math.nan, -math.inf, "0.2", True):
        with pytest.raises(ValueError, match="frechet_margin"):
            remask.diffusion_generate(model, prompt, frechet_margin=bad, **run)
    # Dream's own sampler (no block_length / use_cache: upstream's generation_utils.py has no rule), decoder=, dInfer
    for other in (dict(max_new_tokens=16, steps=16), dict(run, decoder=remask.FrechetRule()),
                  dict(max_new_tokens=16, use_cache=remask.VicinityCache())):
        with pytest.raises(ValueError, match="frechet_margin"):
            remask.diffusion_generate(model, prompt, frechet_margin=0.2, **other)
    for other in (dict(), dict(block_length=8, threshold=0.9), dict(block_length=8, factor=1.0)):
        with pytest.raises(ValueError, match="frechet_margin"):
            remask.SamplingParams(max_tokens=16, alg="confidence_threshold", frechet_margin=0.2, **other)
    remask.SamplingParams(max_tokens=16, alg="entropy", frechet_margin=0.2, use_cache="dual")   # the block decoder

"""d3LLM's multi-block decoding: token-for-token reproduction of the official `generate_multi_block`
(hao-ai-lab/d3LLM, run with its own LLaDA modeling on tiny checkpoints; see the fixture's meta), its
returned NFE, its refusals, rows of a batch decided alone, and the engine equal to the drop-in; SGLang's
port (`FullAttnMultiBlock`, `variant="sglang"`) at the end."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from remask.diffusion.methods.multiblock import MultiBlock, multiblock_generate
from remask.diffusion.parts.stats import GenerationStats

from helpers import left_pad, load_fixture_checkpoint, margin_case, random_prompt

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "multiblock_reference.json").read_text())
MASK, EOS = 299, 298


@pytest.fixture(scope="module")
def load(tmp_path_factory):
    return lambda name: load_fixture_checkpoint(tmp_path_factory, FIXTURE["meta"]["checkpoints"], name)


def run(model, prompt, kwargs, **extra):
    kw = dict(kwargs)
    gen_length, block_length = kw.pop("gen_length"), kw.pop("block_length")
    commit_mask_token = extra.pop("commit_mask_token", False)
    return multiblock_generate(model, prompt, config=MultiBlock(**kw, commit_mask_token=commit_mask_token),
                               gen_length=gen_length, block_length=block_length, **extra)


def sampling(case):
    """A seeded case's draws (upstream ran after `torch.manual_seed(seed)`): the same stream from a CPU generator."""
    if "seed" not in case:
        return {}
    return dict(temperature=case["temperature"], remasking=case.get("remasking", "low_confidence"),
                generator=torch.Generator().manual_seed(case["seed"]))


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=[c["name"] for c in FIXTURE["cases"]])
def test_reproduces_the_official_generate_multi_block(load, case):
    margin_case("multiblock_reference.json", case)
    model = load(case["checkpoint"])
    prompt = torch.tensor([case["prompt"]])
    stats = GenerationStats()
    x, nfe = run(model, prompt, case["kwargs"], stats=stats, **sampling(case))
    # a seeded case where upstream drew the mask token (meta.seeded.note): remask's default departs there
    assert (x[0].tolist() == case["output_ids"] and nfe.tolist() == [case["nfe"]]) != case.get("commit_mask_token", False)
    assert not bool((x == MASK).any()) and torch.equal(x[:, :prompt.shape[1]], prompt)
    # upstream's NFE counts one step more than it forwards when an early stop leaves no mask
    assert stats.nfe in (int(nfe[0]), int(nfe[0]) - 1) and len(stats.tokens_per_step) == stats.nfe
    # no step of a greedy case proposed the mask token (meta.note): upstream's mode gives the same
    x, nfe = run(model, prompt, case["kwargs"], commit_mask_token=True, **sampling(case))
    assert x[0].tolist() == case["output_ids"] and nfe.tolist() == [case["nfe"]]


def test_fixture_covers_the_settings_and_upstream_quirks():
    cases = FIXTURE["cases"]
    kwargs = [c["kwargs"] for c in cases]
    assert len(cases) >= 8 and len({k["threshold"] for k in kwargs}) >= 5 and None in {k["threshold"] for k in kwargs}
    assert len({k["block_add_threshold"] for k in kwargs}) >= 4 and len({k["decoded_token_threshold"] for k in kwargs}) >= 4
    assert {k["early_stop"] for k in kwargs} == {True, False}
    stopped = [c for c in cases if c["kwargs"]["early_stop"] and EOS in c["output_ids"][len(c["prompt"]):]]
    assert len(stopped) >= 5
    # several blocks in flight: fewer forwards than one a token, and fewer than a block at a time would need
    assert any(c["nfe"] < c["kwargs"]["gen_length"] // 4 for c in cases)
    # upstream's tail: a token after the first EOS (the last step's commit over the early stop's fill)
    def tail(c):
        answer = c["output_ids"][len(c["prompt"]):]
        return EOS in answer and any(t != EOS for t in answer[answer.index(EOS):])
    assert any(tail(c) for c in stopped)


def test_batch_rows_are_decided_alone(load):
    model = load("llada_small_eos")
    prompts = random_prompt(3, 7, seed=5)
    kwargs = dict(gen_length=32, block_length=8, threshold=2.0, block_add_threshold=0.25,
                  decoded_token_threshold=0.5, early_stop=True, eos_token_id=EOS)
    x, nfe = run(model, prompts, kwargs)
    for b in range(3):
        alone, n = run(model, prompts[b:b + 1], kwargs)
        assert torch.equal(x[b], alone[0]) and int(nfe[b]) == int(n[0])
    assert len(set(nfe.tolist())) > 1      # the rows did not move in lockstep
    assert not bool((x == MASK).any()) and torch.equal(x[:, :7], prompts)


def test_left_padded_rows_decode(load):
    model = load("llada_small_peaked")
    prompt, mask = left_pad([torch.tensor([5, 17, 42, 99]), torch.tensor([200, 3, 77, 150, 12, 9])], pad_id=297)
    kwargs = dict(gen_length=16, block_length=8, threshold=1.0)
    x, _ = run(model, prompt, kwargs, attention_mask=mask)
    alone, _ = run(model, prompt[1:], kwargs)
    assert torch.equal(x[1], alone[0]) and not bool((x == MASK).any()) and torch.equal(x[:, :6], prompt)


def test_the_mask_token_is_never_returned_by_default(tmp_path):
    from transformers import AutoModel

    from remask.models import tiny

    tiny.write_tiny_llada(str(tmp_path), seed=3, vocab_size=300, embedding_size=300, mask_token_id=MASK,
                          eos_token_id=EOS, pad_token_id=297, include_bias=True, logit_bias={MASK: 100.0})
    model = AutoModel.from_pretrained(str(tmp_path)).eval()
    x, nfe = multiblock_generate(model, torch.tensor([[1, 2, 3]]), config=MultiBlock(threshold=None),
                                 gen_length=16, block_length=8)
    assert not bool((x == MASK).any()) and int(nfe[0]) <= 16


def test_the_forward_guard_ends_a_row_committing_the_mask_token(tmp_path, monkeypatch):
    """With `commit_mask_token` a model that always proposes the mask token never decodes a position: upstream's
    guard (`MAX_FORWARDS`) ends the row one forward past it."""
    from transformers import AutoModel

    from remask.diffusion.methods import multiblock
    from remask.models import tiny

    tiny.write_tiny_llada(str(tmp_path), seed=3, vocab_size=300, embedding_size=300, mask_token_id=MASK,
                          eos_token_id=EOS, pad_token_id=297, include_bias=True, logit_bias={MASK: 100.0})
    model = AutoModel.from_pretrained(str(tmp_path)).eval()
    monkeypatch.setattr(multiblock, "MAX_FORWARDS", 3)
    _, nfe = multiblock_generate(model, torch.tensor([[1, 2, 3]]), config=MultiBlock(commit_mask_token=True),
                                 gen_length=16, block_length=8)
    assert nfe.tolist() == [4]


@pytest.mark.parametrize("field,value", [("threshold", float("nan")), ("threshold", "0.5"),
                                         ("block_add_threshold", None), ("decoded_token_threshold", float("inf")),
                                         ("early_stop", 1), ("eos_token_id", -1), ("eos_token_id", 2.0),
                                         ("commit_mask_token", "yes")])
def test_config_errors_name_the_field(field, value):
    with pytest.raises((ValueError, TypeError), match=field):
        MultiBlock(**{field: value})


def test_argument_errors(load):
    model = load("llada_small")
    with pytest.raises(ValueError, match="block_length"):
        multiblock_generate(model, torch.tensor([[1, 2]]), gen_length=24, block_length=16)
    with pytest.raises(ValueError, match="block_length"):
        multiblock_generate(model, torch.tensor([[1, 2]]), gen_length=8, block_length=16)
    with pytest.raises(ValueError, match="mask token"):
        multiblock_generate(model, torch.tensor([[1, MASK]]), gen_length=16, block_length=8)
    with pytest.raises(ValueError, match="config"):
        multiblock_generate(model, torch.tensor([[1, 2]]), config={"threshold": 0.5}, gen_length=16, block_length=8)
    with pytest.raises(ValueError, match="eos_token_id"):
        multiblock_generate(model, torch.tensor([[1, 2]]), config=MultiBlock(early_stop=True, eos_token_id=300),
                            gen_length=16, block_length=8)
    with pytest.raises(ValueError, match="eos_token_id"):   # checked whether or not early_stop reads it
        multiblock_generate(model, torch.tensor([[1, 2]]), config=MultiBlock(eos_token_id=300),
                            gen_length=16, block_length=8)


def test_one_interface_generate_and_the_engine():
    """`decoder=remask.MultiBlock(...)` in `remask.generate` and `remask.SamplingParams` equals
    `multiblock_generate`; a cache or a setting MultiBlock does not read is refused by name."""
    import remask
    from remask.zoo import charset

    model, _ = remask.load("tiny-llada")
    prompt = torch.tensor([charset.encode_chat("rev abcdef")])
    config = remask.MultiBlock(threshold=1.0, block_add_threshold=0.25, early_stop=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected, nfe = multiblock_generate(model, prompt, config=config, gen_length=32, block_length=8)
        got = remask.generate(model, prompt, gen_length=32, block_length=8, decoder=config)
        served = remask.LLM(model).generate([prompt[0].tolist()], remask.SamplingParams(
            max_tokens=32, block_length=8, temperature=0.0, decoder=config), use_tqdm=False)[0]
        named = remask.generate(model, prompt, gen_length=32, block_length=8, decoder=remask.MultiBlock())
    assert got.tolist() == expected.tolist() and int(nfe[0]) < 32
    assert served.outputs[0].all_token_ids == expected[0, prompt.shape[1]:].tolist()
    assert not bool((named == model.config.mask_token_id).any())
    with pytest.raises(ValueError, match="steps"):
        remask.generate(model, prompt, steps=8, gen_length=32, block_length=8, decoder=config)
    with pytest.raises(ValueError, match="use_cache"):
        remask.generate(model, prompt, gen_length=32, block_length=8, decoder=config, use_cache="dual")
    with pytest.raises(ValueError, match="threshold"):
        remask.generate(model, prompt, gen_length=32, block_length=8, decoder=config, threshold=0.9)
    with pytest.raises(ValueError, match="block_length"):
        remask.SamplingParams(max_tokens=30, block_length=8, decoder=config)
    # ignore_eos: refused only where MultiBlock itself ends the row at EOS (early_stop)
    engine = remask.LLMEngine(model)
    with pytest.raises(ValueError, match="fills the rest of a row with EOS"):
        engine.add_request("stop", prompt[0].tolist(), remask.SamplingParams(
            max_tokens=32, block_length=8, decoder=config, ignore_eos=True))
    plain = remask.MultiBlock(threshold=1.0, block_add_threshold=0.25)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kept = remask.LLM(model).generate([prompt[0].tolist()], remask.SamplingParams(
            max_tokens=32, block_length=8, decoder=plain, ignore_eos=True), use_tqdm=False)[0]
        alone = remask.generate(model, prompt, gen_length=32, block_length=8, decoder=plain)
    assert kept.outputs[0].all_token_ids == alone[0, prompt.shape[1]:].tolist()


def test_seeded_fixture_cases_cover_temperature_remasking_and_early_stop(load, load_dream):
    for fixture, loader in ((FIXTURE, load), (DREAM, load_dream)):
        cases = [c for c in fixture["cases"] if "seed" in c]
        assert len(cases) >= 12 and {c["kwargs"]["early_stop"] for c in cases} == {True, False}
        assert {0.5, 1.0} <= {c["temperature"] for c in cases} and len({c["checkpoint"] for c in cases}) == 3
        # the draws matter: greedy decoding gives other tokens in several seeded cases
        differ = sum(run(loader(c["checkpoint"]), torch.tensor([c["prompt"]]), c["kwargs"])[0][0].tolist()
                     != c["output_ids"] for c in cases[::3])
        assert differ >= 3
    assert {c.get("remasking") for c in FIXTURE["cases"] if "seed" in c} == {"low_confidence", "random"}


def seeded_case(fixture, checkpoint, early_stop):
    return next(c for c in fixture["cases"] if "seed" in c and c["checkpoint"] == checkpoint and not
                c.get("commit_mask_token") and c["kwargs"]["early_stop"] == early_stop and c["temperature"] > 0)


@pytest.mark.parametrize("which", ["llada", "dream"])
def test_the_engine_samples_as_the_seeded_fixture_alone_and_packed(load, load_dream, which):
    """`SamplingParams(decoder=MultiBlock(...), temperature=, seed=)` draws from the request's own generator: the
    fixture's tokens (upstream after `torch.manual_seed(seed)`), alone and packed beside another request."""
    import remask

    fixture, loader = (FIXTURE, load) if which == "llada" else (DREAM, load_dream)
    case = seeded_case(fixture, "llada_small_eos" if which == "llada" else "dream_small_peaked", True)
    model, kw = loader(case["checkpoint"]), dict(case["kwargs"])
    gen_length, block_length = kw.pop("gen_length"), kw.pop("block_length")
    params = remask.SamplingParams(max_tokens=gen_length, block_length=block_length, decoder=MultiBlock(**kw),
                                   temperature=case["temperature"], seed=case["seed"],
                                   remasking=case.get("remasking", "low_confidence"))
    other = remask.SamplingParams(max_tokens=32, block_length=8, decoder=MultiBlock(threshold=1.0), temperature=0.7,
                                  seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        alone = remask.LLM(model).generate([case["prompt"]], params, use_tqdm=False)[0]
        packed = remask.LLM(model).generate([[5, 6, 7, 8], case["prompt"]], [other, params], use_tqdm=False)
        drop_in = remask.generate(model, torch.tensor([case["prompt"]]), gen_length=gen_length,
                                  block_length=block_length, decoder=MultiBlock(**kw), **sampling(case))
    expected = case["output_ids"][len(case["prompt"]):]
    assert alone.outputs[0].all_token_ids == expected == packed[1].outputs[0].all_token_ids
    assert drop_in[0].tolist() == case["output_ids"]


def test_sampling_settings_it_does_not_read_are_refused_by_name(load, load_dream):
    import remask

    model, prompt = load("llada_small"), torch.tensor([[1, 2, 3]])
    for name, value in (("top_p", 0.9), ("top_k", 5)):   # neither file filters its draws
        with pytest.raises(ValueError, match=name):
            remask.LLM(model).generate([[1, 2, 3]], remask.SamplingParams(
                max_tokens=16, block_length=8, decoder=MultiBlock(), temperature=0.5, **{name: value}), use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        multiblock_generate(model, prompt, gen_length=16, block_length=8, temperature=-1.0)
    with pytest.raises(ValueError, match="remasking"):
        multiblock_generate(model, prompt, gen_length=16, block_length=8, remasking="top_k_margin")
    with pytest.raises(ValueError, match="remasking"):   # Dream's file has no random remasking
        multiblock_generate(load_dream("dream_small"), prompt, gen_length=16, block_length=8, remasking="random")
    with pytest.raises(ValueError, match="generator"):
        multiblock_generate(model, prompt, gen_length=16, block_length=8, temperature=0.5, generator=0)


# --- the delayed KV cache (`generate_multi_block_kv_cache`, Dream's `_sample_multi_block_kv_cache`) -----------
# The fixtures' `*_kv_*` cases, MultiBlock(cache_delay_iter=..., refresh_interval=...), run by the reference tests.

def kv_cases(fixture):
    return [c for c in fixture["cases"] if "cache_delay_iter" in c["kwargs"]]


@pytest.mark.parametrize("which", ["llada", "dream"])
def test_kv_cache_fixture_covers_its_settings_and_the_cache_matters(load, load_dream, which):
    """The cached cases vary the cache's settings and the others', stop at EOS, sample (seeded: Dream draws over the
    forwarded rows only), and the greedy ones decode otherwise without the cache in several of them."""
    fixture, loader = (FIXTURE, load) if which == "llada" else (DREAM, load_dream)
    cases = kv_cases(fixture)
    kwargs = [c["kwargs"] for c in cases]
    assert len(cases) >= 8 and len({k["cache_delay_iter"] for k in kwargs}) >= 3
    assert len({k["refresh_interval"] for k in kwargs}) >= 3 and len({k["threshold"] for k in kwargs}) >= 4
    assert len({k["block_add_threshold"] for k in kwargs}) >= 3
    assert len({k["decoded_token_threshold"] for k in kwargs}) >= 3
    assert sum(k["early_stop"] and k["eos_token_id"] in c["output_ids"][len(c["prompt"]):]
               for k, c in zip(kwargs, cases)) >= 5
    assert sum("seed" in c for c in cases) >= 8
    differ = 0
    for c in [c for c in cases if "seed" not in c][::4]:
        plain = {k: v for k, v in c["kwargs"].items() if k not in ("cache_delay_iter", "refresh_interval")}
        x, nfe = run(loader(c["checkpoint"]), torch.tensor([c["prompt"]]), plain)
        differ += x[0].tolist() != c["output_ids"] or nfe.tolist() != [c["nfe"]]
    assert differ >= 3


@pytest.mark.parametrize("which", ["llada", "dream"])
def test_kv_cache_rows_of_a_batch_and_padded_rows_are_decided_alone(load, load_dream, which):
    """Each row keeps its own cache (its blocks are cached at their own steps); a left-padded row as alone."""
    model = load("llada_small_eos") if which == "llada" else load_dream("dream_short")
    eos, pad, high = (EOS, 297, 290) if which == "llada" else (1, 46, 44)
    prompts = random_prompt(3, 7, seed=5, high=high)
    kwargs = dict(gen_length=32, block_length=8, threshold=0.5, block_add_threshold=0.25, early_stop=True,
                  eos_token_id=eos, cache_delay_iter=1, refresh_interval=3)
    stats = GenerationStats()
    x, nfe = run(model, prompts, kwargs, stats=stats)
    for b in range(3):
        alone, n = run(model, prompts[b:b + 1], kwargs)
        assert torch.equal(x[b], alone[0]) and int(nfe[b]) == int(n[0])
    assert len(set(nfe.tolist())) > 1 and stats.kv_cache_bytes > 0
    assert stats.forward_positions < stats.nfe * 3 * x.shape[1]   # the cached positions are not forwarded again
    padded, mask = left_pad([prompts[0, 2:], prompts[1]], pad_id=pad)
    x, _ = run(model, padded, kwargs, attention_mask=mask)
    assert torch.equal(x[1], run(model, prompts[1:2], kwargs)[0][0])


@pytest.mark.parametrize("which", ["llada", "dream"])
def test_kv_cache_in_the_engine_alone_and_packed(load, load_dream, which):
    """`SamplingParams(decoder=MultiBlock(..., cache_delay_iter=...))`: the fixture's tokens alone and packed
    beside another request (cached or not), as the drop-in."""
    import remask

    fixture, loader = (FIXTURE, load) if which == "llada" else (DREAM, load_dream)
    case = next(c for c in kv_cases(fixture) if c["kwargs"]["early_stop"] and c["nfe"] > 6)
    model, kw = loader(case["checkpoint"]), dict(case["kwargs"])
    gen_length, block_length = kw.pop("gen_length"), kw.pop("block_length")
    params = remask.SamplingParams(max_tokens=gen_length, block_length=block_length, decoder=MultiBlock(**kw),
                                   temperature=0.0)
    others = [remask.SamplingParams(max_tokens=32, block_length=8, decoder=MultiBlock(threshold=1.0)),
              remask.SamplingParams(max_tokens=32, block_length=8,
                                    decoder=MultiBlock(threshold=0.5, cache_delay_iter=0))]
    expected = case["output_ids"][len(case["prompt"]):]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        alone = remask.LLM(model).generate([case["prompt"]], params, use_tqdm=False)[0]
        assert alone.outputs[0].all_token_ids == expected
        for other in others:
            packed = remask.LLM(model).generate([[5, 6, 7, 8], case["prompt"]], [other, params], use_tqdm=False)
            assert packed[1].outputs[0].all_token_ids == expected
        drop_in = remask.generate(model, torch.tensor([case["prompt"]]), gen_length=gen_length,
                                  block_length=block_length, decoder=MultiBlock(**kw))
    assert drop_in[0].tolist() == case["output_ids"]


def test_kv_cache_errors_name_the_field():
    for field, value in (("cache_delay_iter", -1), ("cache_delay_iter", 1.5), ("refresh_interval", 0)):
        with pytest.raises((ValueError, TypeError), match=field):
            MultiBlock(**{field: value})


# --- Dream (d3LLM's `d3llm_dream_generate_util.py`, `_sample_multi_block`) ------------------------------------

DREAM = json.loads((Path(__file__).parent / "fixtures" / "multiblock_dream_reference.json").read_text())
DREAM_MASK = {name: ck["kwargs"]["mask_token_id"] for name, ck in DREAM["meta"]["checkpoints"].items()}


@pytest.fixture(scope="module")
def load_dream(tmp_path_factory):
    return lambda name: load_fixture_checkpoint(tmp_path_factory, DREAM["meta"]["checkpoints"], name)


@pytest.mark.parametrize("case", DREAM["cases"], ids=[c["name"] for c in DREAM["cases"]])
def test_reproduces_the_official_dream_generate_multi_block(load_dream, case):
    """The model's layout picks Dream's rule (`variant=None`); naming it, or upstream's mask-token mode, is the same."""
    margin_case("multiblock_dream_reference.json", case)
    model = load_dream(case["checkpoint"])
    prompt, mask = torch.tensor([case["prompt"]]), DREAM_MASK[case["checkpoint"]]
    stats = GenerationStats()
    x, nfe = run(model, prompt, case["kwargs"], stats=stats, **sampling(case))
    # a seeded case where upstream drew the mask token (meta.seeded.note): remask's default departs there
    assert (x[0].tolist() == case["output_ids"] and nfe.tolist() == [case["nfe"]]) != case.get("commit_mask_token", False)
    assert not bool((x == mask).any()) and torch.equal(x[:, :prompt.shape[1]], prompt)
    assert stats.nfe in (int(nfe[0]), int(nfe[0]) - 1) and len(stats.tokens_per_step) == stats.nfe
    x, nfe = run(model, prompt, dict(case["kwargs"], variant="dream"), commit_mask_token=True, **sampling(case))
    assert x[0].tolist() == case["output_ids"] and nfe.tolist() == [case["nfe"]]


def test_dream_fixture_covers_the_settings_and_differs_from_the_llada_rule(load_dream):
    cases = DREAM["cases"]
    kwargs = [c["kwargs"] for c in cases]
    assert len(cases) >= 60 and len({k["threshold"] for k in kwargs}) >= 6 and len(DREAM["meta"]["checkpoints"]) == 3
    assert len({k["block_add_threshold"] for k in kwargs}) >= 5 and len({k["decoded_token_threshold"] for k in kwargs}) >= 6
    assert {k["early_stop"] for k in kwargs} == {True, False}
    stopped = [c for c in cases if c["kwargs"]["early_stop"] and c["kwargs"]["eos_token_id"] in c["output_ids"][len(c["prompt"]):]]
    assert len(stopped) >= 10
    assert any(c["nfe"] < c["kwargs"]["gen_length"] // 4 for c in cases)
    # Dream's rule is its own: LLaDA's (at most the threshold, the lowest entropy always) decodes many cases otherwise
    differ = 0
    for c in cases[::3]:
        x, nfe = run(load_dream(c["checkpoint"]), torch.tensor([c["prompt"]]), dict(c["kwargs"], variant="llada"))
        differ += x[0].tolist() != c["output_ids"] or nfe.tolist() != [c["nfe"]]
    assert differ >= 5


def test_dream_batch_rows_are_decided_alone(load_dream):
    model = load_dream("dream_short")
    prompts = random_prompt(3, 7, seed=5, high=44)
    kwargs = dict(gen_length=32, block_length=8, threshold=1.0, block_add_threshold=0.25,
                  decoded_token_threshold=0.5, early_stop=True, eos_token_id=1)
    x, nfe = run(model, prompts, kwargs)
    for b in range(3):
        alone, n = run(model, prompts[b:b + 1], kwargs)
        assert torch.equal(x[b], alone[0]) and int(nfe[b]) == int(n[0])
    assert len(set(nfe.tolist())) > 1 and not bool((x == 47).any()) and torch.equal(x[:, :7], prompts)
    padded, mask = left_pad([prompts[0, 2:], prompts[1]], pad_id=46)
    x, _ = run(model, padded, kwargs, attention_mask=mask)
    alone, _ = run(model, prompts[1:2], kwargs)
    assert torch.equal(x[1], alone[0]) and not bool((x == 47).any()) and torch.equal(x[:, :7], padded)


def test_a_dream_step_that_would_repeat_itself_commits_its_lowest_entropy_position(load_dream):
    """With `decoded_token_threshold` above 1 no block is fully activated, and Dream's rule commits only what
    is under `threshold`: upstream then repeats one step to its guard (measured: 10 001 forwards, the answer
    returned masked but for what it decoded first; docs/quirks.md). remask commits the step's lowest-entropy
    position there instead, and matches upstream up to the stall."""
    model = load_dream("dream_small")
    prompt = torch.tensor([[197, 215, 20, 132, 261]])   # run_ref.py's first dream_small prompt
    for threshold, decoded, upstream in ((1.0, 1.5, {}), (2.0, 1.2, {4: 177})):
        kwargs = dict(gen_length=32, block_length=8, threshold=threshold, decoded_token_threshold=decoded)
        x, nfe = run(model, prompt, kwargs)
        assert not bool((x == 299).any()) and int(nfe[0]) <= 32
        assert all(int(x[0, 5 + i]) == token for i, token in upstream.items())


def test_dream_in_generate_and_the_engine(load_dream):
    """`decoder=MultiBlock` on a Dream model through `remask.generate` and the engine (a batch of requests)
    equals the drop-in row by row; `variant` is checked by name."""
    import remask

    model = load_dream("dream_small_peaked")
    prompts = random_prompt(3, 6, seed=9)
    config = remask.MultiBlock(threshold=1.0, block_add_threshold=0.25, early_stop=True, eos_token_id=206)
    expected = [multiblock_generate(model, prompts[b:b + 1], config=config, gen_length=32, block_length=8)[0]
                for b in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = remask.generate(model, prompts, gen_length=32, block_length=8, decoder=config)
        served = remask.LLM(model).generate([p.tolist() for p in prompts], remask.SamplingParams(
            max_tokens=32, block_length=8, temperature=0.0, decoder=config), use_tqdm=False)
    for b in range(3):
        assert torch.equal(got[b], expected[b][0])
        assert served[b].outputs[0].all_token_ids == expected[b][0, 6:].tolist()
    assert len({tuple(e[0].tolist()) for e in expected}) == 3
    with pytest.raises(ValueError, match="variant"):
        remask.MultiBlock(variant="SGLang")
    with pytest.raises(ValueError, match="use_cache"):
        remask.generate(model, prompts, gen_length=32, block_length=8, decoder=config, use_cache="prefix")


def test_dreams_early_stop_recounts_every_block():
    """Dream's file recounts each block's masks after the early stop's fill (LLaDA's only the block holding the
    first EOS): they differ where a committed mask token left a count below the masks (`commit_mask_token`)."""
    from remask.diffusion.methods.multiblock import _Row

    config = MultiBlock(early_stop=True, commit_mask_token=True)
    for dream, counts in ((True, [2, 1, 0]), (False, [0, 1, 0])):
        row = _Row(config, 2, 12, 4, dream)
        row._open(masks=4, full=False)
        row._open(masks=4, full=False)
        row.blocks[1].masks = 0   # two mask tokens "committed" there: upstream's count says none is left
        x = torch.tensor([7, 8, 9, MASK, 5, MASK, MASK, 6, EOS, MASK, 4, 4, MASK, MASK])
        assert not row._early_stop(x, MASK, EOS)
        assert [b.masks for b in row.blocks[1:]] == counts and x[9:].tolist() == [EOS] * 5
        assert row.blocks[3].full and not row.blocks[2].full


# --- SGLang's port (sgl-project/sglang `FullAttnMultiBlock`, `variant="sglang"`) --------------------------------

SGLANG = json.loads((Path(__file__).parent / "fixtures" / "multiblock_sglang_reference.json").read_text())


@pytest.fixture(scope="module")
def load_sglang(tmp_path_factory):
    return lambda name: load_fixture_checkpoint(tmp_path_factory, SGLANG["meta"]["checkpoints"], name)


def sglang_case(case):
    """(prompt [B, P], gen_length, block_length, the other settings, expected rows): a case alone or a batch."""
    kw = dict(case["kwargs"])
    gen_length, block_length = kw.pop("gen_length"), kw.pop("block_length")
    batch = "prompts" in case
    return (torch.tensor(case["prompts"] if batch else [case["prompt"]]), gen_length, block_length, kw,
            case["output_ids"] if batch else [case["output_ids"]])


@pytest.mark.parametrize("case", SGLANG["cases"], ids=[c["name"] for c in SGLANG["cases"]])
def test_reproduces_sglangs_full_attn_multi_block(load_sglang, case):
    """`remask.generate(..., decoder=MultiBlock.sglang(**settings))` (SGLang's defaults under the case's settings):
    upstream's ids, its NFE the forwards (a batch's: its longest row's). Where upstream committed a mask-token argmax
    and ran to its guard, `commit_mask_token=True` gives its masks and NFE; where it stalled (no block fully
    activated), remask's commit of the step's lowest-entropy position keeps every id upstream decoded."""
    import remask

    margin_case("multiblock_sglang_reference.json", case)
    model = load_sglang(case["checkpoint"])
    mask = model.config.mask_token_id
    prompt, gen_length, block_length, kw, expected = sglang_case(case)
    stats = GenerationStats()
    x = remask.generate(model, prompt, gen_length=gen_length, block_length=block_length,
                        decoder=MultiBlock.sglang(**kw), stats=stats)
    assert not bool((x == mask).any()) and torch.equal(x[:, :prompt.shape[1]], prompt)
    upstream = torch.tensor(expected)
    if case.get("upstream_stalled"):
        assert bool((upstream == mask).any()) and stats.nfe <= gen_length
        assert torch.equal(x[upstream != mask], upstream[upstream != mask])
        return
    assert (x.tolist() == expected and stats.nfe == case["nfe"]) != case.get("commit_mask_token", False)
    # upstream's mode: no step of the other cases committed the mask token
    x, nfe = multiblock_generate(model, prompt, config=MultiBlock.sglang(commit_mask_token=True, **kw),
                                 gen_length=gen_length, block_length=block_length)
    assert x.tolist() == expected and max(nfe.tolist()) == case["nfe"]
    if case.get("commit_mask_token"):   # SGLang's guard: gen_length + 1 forwards, then one more, masks left
        assert case["nfe"] == gen_length + 2 and bool((x == mask).any())


def test_sglang_fixture_covers_its_settings_and_differs_from_d3llm(load_sglang):
    """Both models, SGLang's defaults, its block opening (all blocks at once with block_add_threshold <= 0), partial
    last blocks, batches, its guard and stalls; d3LLM's Dream rule with the same settings decodes several otherwise."""
    import dataclasses

    cases = SGLANG["cases"]
    kwargs = [c["kwargs"] for c in cases]
    for family in ("llada", "dream"):
        assert sum(c["checkpoint"].startswith(family) for c in cases) >= 8
    assert sum(set(k) == {"gen_length", "block_length"} for k in kwargs) >= 4   # SGLang's own defaults
    assert len({k.get("threshold") for k in kwargs}) >= 6 and any(k.get("block_add_threshold", 1) <= 0 for k in kwargs)
    assert any(k["gen_length"] % k["block_length"] for k in kwargs) and any(
        k["block_length"] > k["gen_length"] for k in kwargs)
    assert sum("prompts" in c for c in cases) >= 4 and any(c.get("commit_mask_token") for c in cases)
    assert sum(bool(c.get("upstream_stalled")) for c in cases) >= 2
    assert any(c["nfe"] < c["kwargs"]["gen_length"] // 4 for c in cases)
    differ = 0   # where SGLang's blocks differ from d3LLM's: all open at once, the first fully activated past 1
    for c in [c for c in cases if "prompt" in c and not c.get("upstream_stalled") and (
            c["kwargs"].get("block_add_threshold", 0.1) <= 0 or c["kwargs"].get("decoded_token_threshold", 0) > 1)]:
        prompt, gen_length, block_length, kw, expected = sglang_case(c)
        config = dataclasses.replace(MultiBlock.sglang(**kw), variant="dream")
        x, nfe = multiblock_generate(load_sglang(c["checkpoint"]), prompt, config=config, gen_length=gen_length,
                                     block_length=block_length)
        differ += x.tolist() != expected or nfe.tolist() != [c["nfe"]]
    assert differ >= 3


@pytest.mark.parametrize("which", ["llada", "dream"])
def test_sglang_batch_rows_are_decided_alone_and_in_the_engine(load_sglang, which):
    """A fixture batch's rows each as alone (each with its own NFE: upstream reports the batch's for every row), and
    `SamplingParams(decoder=MultiBlock.sglang(...))` serves a case's tokens alone and packed beside another request."""
    import remask

    batch = next(c for c in SGLANG["cases"] if "prompts" in c and c["checkpoint"].startswith(which) and c["nfe"] > 4)
    model = load_sglang(batch["checkpoint"])
    prompt, gen_length, block_length, kw, expected = sglang_case(batch)
    config = MultiBlock.sglang(**kw)
    x, nfe = multiblock_generate(model, prompt, config=config, gen_length=gen_length, block_length=block_length)
    assert x.tolist() == expected and max(nfe.tolist()) == batch["nfe"] and len(set(nfe.tolist())) > 1
    for b in range(prompt.shape[0]):
        alone, n = multiblock_generate(model, prompt[b:b + 1], config=config, gen_length=gen_length,
                                       block_length=block_length)
        assert torch.equal(alone[0], x[b]) and int(n[0]) == int(nfe[b])
    # a case whose last block is partial: the engine takes SGLang's layout as the drop-in does
    case = next(c for c in SGLANG["cases"] if "prompt" in c and c["checkpoint"].startswith(which) and c["nfe"] > 4
                and set(c) == {"name", "checkpoint", "prompt", "kwargs", "output_ids", "nfe", "min_margin"}
                and c["kwargs"]["gen_length"] % c["kwargs"]["block_length"])
    model, (prompt, gen_length, block_length, kw, expected) = load_sglang(case["checkpoint"]), sglang_case(case)
    params = remask.SamplingParams(max_tokens=gen_length, block_length=block_length, temperature=0.0,
                                   decoder=MultiBlock.sglang(**kw))
    other = remask.SamplingParams(max_tokens=16, block_length=8, decoder=MultiBlock(threshold=1.0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        alone = remask.LLM(model).generate([case["prompt"]], params, use_tqdm=False)[0]
        packed = remask.LLM(model).generate([[5, 6, 7, 8], case["prompt"]], [other, params], use_tqdm=False)
    assert alone.outputs[0].all_token_ids == expected[0][prompt.shape[1]:] == packed[1].outputs[0].all_token_ids


def test_sglang_settings_it_does_not_have_are_refused_by_name(load_sglang):
    import remask

    model, prompt = load_sglang("llada_small"), torch.tensor([[1, 2, 3]])
    assert MultiBlock.sglang() == MultiBlock(threshold=0.4, block_add_threshold=0.1, decoded_token_threshold=0.95,
                                             variant="sglang")
    for field, value in (("early_stop", True), ("cache_delay_iter", 1)):
        with pytest.raises(ValueError, match=field):
            MultiBlock.sglang(**{field: value})
    with pytest.raises(ValueError, match="temperature"):   # the port decodes greedily
        multiblock_generate(model, prompt, config=MultiBlock.sglang(), gen_length=16, block_length=8, temperature=0.5)
    with pytest.raises(ValueError, match="remasking"):
        multiblock_generate(model, prompt, config=MultiBlock.sglang(), gen_length=16, block_length=8,
                            remasking="random")
    remask.SamplingParams(max_tokens=30, block_length=8, decoder=MultiBlock.sglang())   # its last block partial
    with pytest.raises(ValueError, match="block_length"):   # d3LLM's blocks tile max_tokens
        remask.SamplingParams(max_tokens=30, block_length=8, decoder=MultiBlock())

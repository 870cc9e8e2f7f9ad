"""d2Cache: token-for-token reproduction of the official d2Cache decoding on LLaDA (Kamichanw/d2Cache,
`vanilla_generate` with `d2Cache`, run on tiny checkpoints; see the fixture's meta), the cache seam,
the row-selection helpers, batches, and the invariants."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModel

from remask.diffusion.methods.d2cache import (D2Cache, D2KVCache, certainty_density, d2cache_generate, inflate, nucleus,
                                      top_up)
from remask.diffusion.parts.stats import GenerationStats
from remask.models import tiny

from helpers import left_pad, load_fixture_checkpoint, margin_case

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "d2cache_reference.json").read_text())
MASK = 299
@pytest.fixture(scope="module")
def load(tmp_path_factory):
    return lambda name: load_fixture_checkpoint(tmp_path_factory, FIXTURE["meta"]["checkpoints"], name)


def run(model, case, **extra):
    g = case["gen"]
    am = case.get("attention_mask")
    return d2cache_generate(model, torch.tensor(case["prompt"]), config=D2Cache(**case["cache"]),
                            steps=g["gen_length"] // g["num_transfer_tokens"], gen_length=g["gen_length"],
                            block_length=g["block_length"], prior_sigma=g["sigma"],
                            attention_mask=None if am is None else torch.tensor(am), **extra)


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=[c["name"] for c in FIXTURE["cases"]])
def test_reproduces_the_official_d2cache(load, case):
    margin_case("d2cache_reference.json", case)
    model = load(case["checkpoint"])
    stats = GenerationStats()
    x = run(model, case, stats=stats, independent_rows=False)   # upstream's coupled batch
    assert x.tolist() == case["output_ids"]
    P = len(case["prompt"][0])
    assert not bool((x == MASK).any()) and x[:, :P].tolist() == case["prompt"]
    # one forward per upstream step; the first computes everything, the later ones fewer rows
    assert stats.nfe == case["num_steps"]
    T = P + case["gen"]["gen_length"]
    assert len(case["prompt"]) * T < stats.forward_positions < stats.nfe * len(case["prompt"]) * T


def test_cache_seam_full_then_partial_forward(load):
    """A full forward through the cache gives the plain forward's logits; re-forwarding some rows of the
    same tokens over the cached keys/values gives those rows' logits again; the rollout is row-stochastic."""
    model = load("llada_small")
    x = torch.tensor([[5, 17, 42, 99, 7, 8, 30, 31, MASK, MASK, MASK, MASK]])
    pos = torch.arange(12)[None]
    with torch.no_grad():
        plain = model(x).logits
        cache = D2KVCache()
        cache.full()
        full = model(x, past_key_values=cache, position_ids=pos).logits
        torch.testing.assert_close(full, plain, rtol=1e-5, atol=1e-5)
        assert cache.rollout.shape == (1, 12, 12)
        torch.testing.assert_close(cache.rollout.sum(-1), torch.ones(1, 12))
        rows = torch.zeros(1, 12, dtype=torch.bool)
        rows[0, [2, 8, 9, 11]] = True
        cache.partial(rows)
        part = model(x[rows][None], past_key_values=cache, position_ids=pos[rows][None]).logits
    torch.testing.assert_close(part, full[rows][None], rtol=1e-5, atol=1e-5)
    assert cache.k[0].shape[2] == 12 and cache.nbytes > 0
    with pytest.raises(RuntimeError, match="full"):
        D2KVCache().partial(rows)


def test_selection_helpers():
    # density: 1 where everything around is decoded, lower next to masks, symmetric kernel
    d = certainty_density(torch.tensor([[True] * 8, [True] * 4 + [False] * 4]), 2.0)
    torch.testing.assert_close(d[0], torch.ones(8), rtol=1e-5, atol=1e-5)
    assert bool((d[1, 4:].diff() < 0).all()) and float(d[1, 0]) > float(d[1, 7])
    # nucleus: the largest always, then while the cumulative mass stays within p, never a disallowed one
    s = torch.tensor([[0.5, 0.3, 0.1, 0.1]])
    allowed = torch.tensor([[True, True, True, True]])
    assert nucleus(s, 0.1, allowed).tolist() == [[True, False, False, False]]
    assert nucleus(s, 0.85, allowed).tolist() == [[True, True, False, False]]
    assert nucleus(s, 0.1, torch.tensor([[False, True, True, True]])).tolist() == [[False, True, False, False]]
    # inflate: gaps of at most w positions between selected ones are filled, edges never
    sel = torch.tensor([[False, True, False, False, True, False, False, False, False, True, False]])
    assert inflate(sel, 3)[0].nonzero()[:, 0].tolist() == [1, 2, 3, 4, 9]
    assert inflate(sel, 5)[0].nonzero()[:, 0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert torch.equal(inflate(sel, 0), sel)
    # top-up to the largest count by priority
    rows = torch.tensor([[True, True, False, False], [True, False, False, False]])
    got = top_up(rows, torch.tensor([[0.0, 0.0, 1.0, 2.0], [0.0, 3.0, 1.0, 2.0]]), 2)
    assert got.tolist() == [[True, True, False, False], [True, True, False, False]]


def test_batches(load):
    """Upstream couples a batch's rows (top-up to equal counts, a batch-wide block bias); by default
    (independent_rows=True) remask decodes each row alone: a batch holding a fixture prompt twice
    gives the reference's tokens for it alone in both rows, and in a left-padded batch each row is
    the same row decoded alone. (Upstream's coupled output is the fixture's batch cases, reproduced
    with independent_rows=False by `test_reproduces_the_official_d2cache`.)"""
    assert sum(len(c["prompt"]) > 1 for c in FIXTURE["cases"]) >= 4   # coupled batches stay checked
    rows = [next(c for c in FIXTURE["cases"] if c["name"] == f"llada_small_peaked_g64_b32_n2_s3.0_current_k8_sigma3.0_inflate_w2_{p}")
            for p in ("p0", "p2")]
    model = load(rows[0]["checkpoint"])
    twice = run(model, dict(rows[0], prompt=rows[0]["prompt"] * 2))
    assert twice.tolist() == rows[0]["output_ids"] * 2
    ids, mask = left_pad([torch.tensor(c["prompt"][0]) for c in rows], pad_id=297)
    padded = dict(rows[0], prompt=ids.tolist(), attention_mask=mask.tolist())
    x = run(model, padded)
    for b in range(2):
        one = dict(padded, prompt=[padded["prompt"][b]], attention_mask=[padded["attention_mask"][b]])
        assert torch.equal(x[b], run(model, one)[0])
    assert not bool((x == MASK).any()) and x[:, :ids.shape[1]].tolist() == padded["prompt"]


def test_without_committing_the_mask_token(load):
    """Upstream commits an argmax equal to the mask id (the position stays masked, one step more);
    commit_mask_token=False commits the best other token: no extra step, nothing masked left."""
    case = next(c for c in FIXTURE["cases"] if c["name"] == "llada_small_g48_b16_n1_sNone_current_k8_p0")
    assert case["num_steps"] > case["gen"]["gen_length"]
    model = load(case["checkpoint"])
    stats = GenerationStats()
    x = run(model, case, commit_mask_token=False, stats=stats)
    assert stats.nfe == case["gen"]["gen_length"]
    assert not bool((x == MASK).any()) and x[:, :len(case["prompt"][0])].tolist() == case["prompt"]


def test_config_and_argument_errors(load):
    for field, value in (("rollout_p", 1.5), ("rollout_p", -0.1), ("current_k", 0), ("sigma", 0.0),
                         ("inflate_w", -1)):
        with pytest.raises(ValueError, match=field):
            D2Cache(**{field: value})
    with pytest.raises((ValueError, TypeError), match="current_k"):
        D2Cache(current_k=2.5)
    model = load("llada_small")
    p = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="config"):
        d2cache_generate(model, p, config=object(), steps=16, gen_length=16, block_length=16)
    with pytest.raises(ValueError, match="steps"):
        d2cache_generate(model, p, steps=5, gen_length=16, block_length=16)
    with pytest.raises(ValueError, match="block_length"):
        d2cache_generate(model, p, steps=16, gen_length=24, block_length=16)
    with pytest.raises(ValueError, match="block_length"):
        d2cache_generate(model, p, steps=4, gen_length=32, block_length=4)     # 8 per step > block
    with pytest.raises(ValueError, match="prior_sigma"):
        d2cache_generate(model, p, steps=16, gen_length=16, block_length=16, prior_sigma=0.0)
    with pytest.raises((ValueError, TypeError), match="independent_rows"):
        d2cache_generate(model, p, steps=16, gen_length=16, block_length=16, independent_rows=1)
    with pytest.raises(ValueError, match="mask token"):
        d2cache_generate(model, torch.tensor([[1, MASK]]), steps=16, gen_length=16, block_length=16)


def test_refuses_dream(tmp_path):
    tiny.write_tiny_dream(str(tmp_path), seed=4, vocab_size=300, mask_token_id=299, eos_token_id=298,
                          pad_token_id=297, bos_token_id=296)
    dream = AutoModel.from_pretrained(str(tmp_path)).eval()
    with pytest.raises(ValueError, match="LLaDA"):
        d2cache_generate(dream, torch.tensor([[1, 2, 3]]), steps=16, gen_length=16, block_length=16)


def test_one_interface_generate_and_the_engine():
    """`use_cache=remask.D2Cache(...)` in `remask.generate` and `remask.SamplingParams` equals
    `d2cache_generate`; a decoder or a setting it does not read is refused by name."""
    import warnings

    import remask
    from remask.zoo import charset

    model, _ = remask.load("tiny-llada")
    prompt = torch.tensor([charset.encode_chat("add 31+447")])
    cache = remask.D2Cache(current_k=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = d2cache_generate(model, prompt, config=cache, steps=16, gen_length=32, block_length=32)
        got = remask.generate(model, prompt, steps=16, gen_length=32, block_length=32, use_cache=cache)
        served = remask.LLM(model).generate([prompt[0].tolist()], remask.SamplingParams(
            max_tokens=32, steps=16, block_length=32, temperature=0.0, use_cache=cache), use_tqdm=False)[0]
    assert got.tolist() == expected.tolist()
    assert served.outputs[0].all_token_ids == expected[0, prompt.shape[1]:].tolist()
    with pytest.raises(ValueError, match="decoder"):
        remask.generate(model, prompt, steps=16, gen_length=32, block_length=32, use_cache=cache,
                        decoder=remask.WINO())
    with pytest.raises(ValueError, match="remasking"):
        remask.generate(model, prompt, steps=16, gen_length=32, block_length=32, use_cache=cache, remasking="random")

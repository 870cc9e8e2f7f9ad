"""Property fuzzing of the public API on the shipped tiny models and a tiny random Dream.

Random *valid* settings must keep remask's invariants: the output has the right shape, holds no
mask token, returns the prompt unchanged; the same seed gives the same tokens; the statistics
agree with the output; and where decoding is deterministic (temperature 0, no random remasking)
a left-padded row decodes to exactly what it decodes to alone. Random *invalid* settings must
raise ValueError/TypeError naming the parameter, before the model runs.

Profiles (tests/conftest.py): "ci" (default: few examples, derandomized, well under a minute)
and "nightly" (`HYPOTHESIS_PROFILE=nightly pytest tests/test_fuzz.py`: hundreds, random seeds).
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import remask
from remask.zoo import charset, tasks

MASK = charset.MASK_ID
PROBLEMS = [charset.encode_chat(p.prompt) for p in tasks.problems(40, tasks.EVAL_SEED)]


@pytest.fixture(scope="module")
def models(load_model):
    llada, tokenizer = remask.load("tiny-llada")
    ar, _ = remask.load("tiny-ar")
    return {"llada": llada, "ar": ar, "dream": load_model("dream_small")}


def _batch(rows: list[list[int]], pads: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad `rows` with `pads[i]` extra pads beyond the longest row."""
    width = max(len(r) for r in rows) + max(pads)
    ids = torch.full((len(rows), width), charset.PAD_ID, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        start = width - len(r)
        ids[i, start:], mask[i, start:] = torch.tensor(r), 1
    return ids, mask


prompts = st.lists(st.sampled_from(PROBLEMS), min_size=1, max_size=3)
pads = st.lists(st.integers(0, 6), min_size=3, max_size=3)


def _check_output(out: torch.Tensor, ids: torch.Tensor, width: int, mask_id: int = MASK) -> None:
    assert out.shape == (ids.shape[0], ids.shape[1] + width)
    assert not (out == mask_id).any(), "a mask token in the output"
    assert torch.equal(out[:, :ids.shape[1]], ids), "the prompt changed"


def _check_stats(stats: remask.GenerationStats, batch: int, width: int, early_stop: bool) -> None:
    assert stats.generated_tokens == batch * width
    assert stats.nfe == len(stats.tokens_per_step) >= 1
    assert stats.forward_positions >= stats.nfe
    committed = sum(stats.tokens_per_step)
    assert committed <= batch * width if early_stop else committed == batch * width
    assert stats.wall_time > 0


EXTRAS = ["none", "prefix", "dual", "paged", "cfg", "retention"]


@st.composite
def llada_settings(draw, extra: str):
    block_length = draw(st.sampled_from([2, 4, 8]))
    num_blocks = draw(st.integers(1, 2))
    kw = dict(block_length=block_length, gen_length=block_length * num_blocks,
              # steps per block up to one token per step (where retention's sparse steps happen)
              steps=num_blocks * draw(st.sampled_from([1, 2, block_length // 2, block_length, block_length])),
              temperature=draw(st.sampled_from([0.0, 0.0, 0.5, 2.0])),
              remasking=draw(st.sampled_from(["low_confidence", "low_confidence", "random"])),
              early_stop=draw(st.booleans()), logits_eos_inf=draw(st.booleans()),
              confidence_eos_eot_inf=draw(st.sampled_from([False, True, "corrected"])))
    rule = draw(st.sampled_from(["schedule", "threshold", "factor"]))
    if rule == "threshold":
        kw["threshold"] = draw(st.floats(0.05, 1.0))
    elif rule == "factor":
        kw["factor"] = draw(st.floats(0.1, 8.0))
    if extra in ("prefix", "dual", "paged"):
        kw["use_cache"] = extra
    elif extra == "cfg":
        kw["cfg_scale"] = draw(st.sampled_from([0.5, 1.0]))
    elif extra == "retention":
        kw["sparse"] = remask.SparseConfig(retention_ratio=draw(st.sampled_from([0.3, 0.5, 1.0])),
                                           delay_step=draw(st.integers(0, 2)),
                                           head_select=draw(st.booleans()),
                                           pool_kernel=draw(st.sampled_from([None, 1, 3, 5])))
    return kw


def _quiet(fn, *args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # gen_length beyond tiny-llada's training answers, on purpose
        return fn(*args, **kw)


@pytest.mark.parametrize("extra", EXTRAS)
@given(data=st.data(), rows=prompts, pads=pads, seed=st.integers(0, 2**31 - 1))
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_generate_keeps_its_invariants(models, extra, data, rows, pads, seed):
    model = models["llada"]
    kw = data.draw(llada_settings(extra), label="settings")
    ids, mask = _batch(rows, pads)
    stats = remask.GenerationStats()
    out = _quiet(remask.generate, model, ids, mask, generator=torch.Generator().manual_seed(seed), stats=stats, **kw)
    _check_output(out, ids, kw["gen_length"])
    _check_stats(stats, len(rows), kw["gen_length"], kw["early_stop"])
    again = _quiet(remask.generate, model, ids, mask, generator=torch.Generator().manual_seed(seed), **kw)
    assert torch.equal(out, again), "same seed, other tokens"
    if kw["temperature"] == 0 and kw["remasking"] == "low_confidence":
        for i, row in enumerate(rows):
            alone = _quiet(remask.generate, model, torch.tensor([row]), **kw)
            assert torch.equal(out[i, ids.shape[1] - len(row):], alone[0]), f"row {i} differs from the row alone"


@st.composite
def dream_settings(draw, mode: str):
    kw = dict(max_new_tokens=draw(st.sampled_from([4, 8])), temperature=draw(st.sampled_from([0.0, 0.0, 0.7])),
              eps=draw(st.sampled_from([1e-3, 0.0, 0.5])))
    if kw["temperature"] > 0:
        kw["top_p"] = draw(st.sampled_from([None, 0.9, 1.0]))
        kw["top_k"] = draw(st.sampled_from([None, 1, 20]))
    if mode == "blocks":
        kw["block_length"] = draw(st.sampled_from([2, 4]))
        kw["use_cache"] = draw(st.sampled_from([None, "prefix", "dual", "paged"]))
        kw["alg"] = draw(st.sampled_from(["confidence_threshold", "entropy"]))
        kw["steps"] = kw["max_new_tokens"] // kw["block_length"] * draw(st.sampled_from([1, 2]))
        kw["threshold"] = draw(st.floats(0.05, 1.0))
    else:
        kw["alg"] = draw(st.sampled_from(["origin", "maskgit_plus", "topk_margin", "entropy", "confidence_threshold"]))
        kw["steps"] = draw(st.sampled_from([1, 2, 4] if kw["alg"] == "confidence_threshold" else [1, 3, 4, 8]))
        if kw["alg"] not in ("origin", "confidence_threshold"):
            kw["alg_temp"] = draw(st.sampled_from([None, None, 0.5]))
    kw["num_return_sequences"] = draw(st.sampled_from([1, 1, 2]))
    return kw


@pytest.mark.parametrize("mode", ["sample", "blocks"])
@given(data=st.data(), rows=prompts, pads=pads, seed=st.integers(0, 2**31 - 1), which=st.sampled_from(["llada", "dream"]))
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_diffusion_generate_keeps_its_invariants(models, mode, data, rows, pads, seed, which):
    kw = data.draw(dream_settings(mode), label="settings")
    model = models[which]
    mask_id = remask.get_spec(model).mask_id
    ids, mask = _batch(rows, pads)
    stats = remask.GenerationStats()
    out = _quiet(remask.diffusion_generate, model, ids, attention_mask=mask, stats=stats,
                 generator=torch.Generator().manual_seed(seed), **kw)
    n = kw["num_return_sequences"]
    expanded = ids.repeat_interleave(n, dim=0)
    _check_output(out, expanded, kw["max_new_tokens"], mask_id)
    _check_stats(stats, expanded.shape[0], kw["max_new_tokens"], early_stop=False)
    again = _quiet(remask.diffusion_generate, model, ids, attention_mask=mask,
                   generator=torch.Generator().manual_seed(seed), **kw)
    assert torch.equal(out, again), "same seed, other tokens"
    deterministic = kw["temperature"] == 0 and kw["alg"] != "origin" and not kw.get("alg_temp")
    if deterministic and which == "llada":   # the trained model: no float-rounding near-ties
        for i, row in enumerate(rows):
            alone = _quiet(remask.diffusion_generate, model, torch.tensor([row]), **kw)
            got = out[i * n:(i + 1) * n, ids.shape[1] - len(row):]
            assert torch.equal(got, alone), f"row {i} differs from the row alone"


@given(rows=prompts, pads=pads, seed=st.integers(0, 2**31 - 1), max_new_tokens=st.integers(1, 12),
       temperature=st.sampled_from([0.0, 0.0, 0.8, 1.5]), top_k=st.sampled_from([None, 1, 5]),
       top_p=st.sampled_from([None, 0.5, 1.0]))
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_ar_generate_keeps_its_invariants(models, rows, pads, seed, max_new_tokens, temperature, top_k, top_p):
    model = models["ar"]
    ids, mask = _batch(rows, pads)
    kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p)
    stats = remask.GenerationStats()
    out = remask.ar_generate(model, ids, mask, generator=torch.Generator().manual_seed(seed), stats=stats, **kw)
    _check_output(out, ids, max_new_tokens)
    assert 1 <= stats.generated_tokens <= len(rows) * max_new_tokens
    again = remask.ar_generate(model, ids, mask, generator=torch.Generator().manual_seed(seed), **kw)
    assert torch.equal(out, again)
    if temperature == 0:
        for i, row in enumerate(rows):
            alone = remask.ar_generate(model, torch.tensor([row]), **kw)
            assert torch.equal(out[i, ids.shape[1] - len(row):], alone[0]), f"row {i} differs from the row alone"


# ---- invalid settings -------------------------------------------------------------------------

junk = st.one_of(st.text(max_size=3), st.none(), st.booleans(), st.lists(st.integers(0, 3), max_size=2),
                 st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
                 st.builds(torch.tensor, st.floats(-2, 2)), st.just(float("nan")))


def bad_real(low: float | None = None, high: float | None = None, low_open: bool = False, none_ok: bool = False):
    """Values that are not a finite real in the interval: junk, ±inf, NaN, and numbers outside it."""
    out = [junk.filter(lambda v: not (none_ok and v is None)), st.sampled_from([math.inf, -math.inf])]
    if low is not None:
        out.append(st.floats(max_value=low, exclude_max=not low_open, allow_nan=False, allow_infinity=False))
    if high is not None:
        out.append(st.floats(min_value=high, exclude_min=True, allow_nan=False, allow_infinity=False))
    return st.one_of(out)


def bad_int(minimum: int | None = None, maximum: int | None = None, none_ok: bool = False):
    out = [junk.filter(lambda v: not (none_ok and v is None)),
           st.floats(allow_nan=False).filter(lambda v: v != int(v) if math.isfinite(v) else True)]
    if minimum is not None:
        out.append(st.integers(max_value=minimum - 1))
    if maximum is not None:
        out.append(st.integers(min_value=maximum + 1))
    return st.one_of(out)


def bad_bool():
    return st.one_of(st.integers(), st.text(max_size=3), st.none(), st.floats(allow_nan=False))


def bad_object():
    return st.one_of(st.integers(), st.text(max_size=3), st.dictionaries(st.text(max_size=2), st.integers(), max_size=1),
                     st.lists(st.integers(), max_size=2))


V = 128   # tiny-llada / tiny-ar vocabulary
BAD = {
    "generate": {
        "temperature": bad_real(low=0, low_open=False), "cfg_scale": bad_real(low=0),
        "threshold": bad_real(low=0, high=1, low_open=True, none_ok=True),
        "factor": bad_real(low=0, low_open=True, none_ok=True),
        "steps": bad_int(1), "gen_length": bad_int(1), "block_length": bad_int(1),
        "remasking": st.one_of(st.text(max_size=4), st.none(), st.integers()),
        "mask_id": bad_int(0, V - 1, none_ok=True), "eos_id": bad_int(0, V - 1, none_ok=True),
        "eot_id": bad_int(0, V - 1, none_ok=True),
        "early_stop": bad_bool(), "logits_eos_inf": bad_bool(), "reference_rng": bad_bool(),
        "reference_ties": bad_bool(), "confidence_eos_eot_inf": st.one_of(st.integers(), st.text(max_size=4)).filter(
            lambda v: not (isinstance(v, str) and v == "corrected")),
        "generator": bad_object(), "stats": bad_object(), "on_step": bad_object().filter(lambda v: not callable(v)),
        "use_cache": st.one_of(st.text(max_size=5), st.integers(), st.lists(st.text(max_size=3), max_size=1)).filter(
            lambda v: v not in ("prefix", "dual", "paged")),
        "apd": bad_object(), "sparse": bad_object(), "verifier_stats": bad_object(),
    },
    "diffusion_generate": {
        "temperature": bad_real(low=0), "top_p": bad_real(low=0, high=1, low_open=True, none_ok=True),
        "top_k": bad_int(1, none_ok=True), "eps": bad_real(low=0, high=1) | st.just(1.0),
        "steps": bad_int(1), "alg_temp": bad_real(low=0, none_ok=True),
        "alg": st.one_of(st.text(max_size=4), st.none(), st.integers()),
        "num_return_sequences": bad_int(1), "max_new_tokens": bad_int(1, none_ok=True),
        "threshold": bad_real(low=0, high=1, low_open=True, none_ok=True), "block_length": bad_int(1, none_ok=True),
        "use_cache": st.one_of(st.text(max_size=5), st.integers()).filter(lambda v: v not in ("prefix", "dual", "paged")),
        "finish_blocks": bad_bool(), "output_history": bad_bool(), "return_dict_in_generate": bad_bool(),
        "generator": bad_object(), "stats": bad_object(), "pad_token_id": bad_int(0, V - 1, none_ok=True),
    },
    "ar_generate": {
        "temperature": bad_real(low=0), "top_k": bad_int(1, none_ok=True),
        "top_p": bad_real(low=0, high=1, low_open=True, none_ok=True), "max_new_tokens": bad_int(1),
        "pad_token_id": bad_int(0, V - 1, none_ok=True), "eos_token_id": bad_int(0, V - 1, none_ok=True).filter(
            lambda v: not isinstance(v, list)),
        "generator": bad_object(), "stats": bad_object(),
    },
}
BASE = {"generate": dict(steps=4, gen_length=8, block_length=4), "diffusion_generate": dict(max_new_tokens=8, steps=4),
        "ar_generate": dict(max_new_tokens=4)}
PARAMETERS = [(entry, name) for entry, names in BAD.items() for name in names]


@st.composite
def bad_call(draw):
    entry, name = draw(st.sampled_from(PARAMETERS))
    return entry, name, draw(BAD[entry][name])


@given(call=bad_call())
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_invalid_settings_raise_naming_the_parameter(models, call):
    entry, name, value = call
    model = models["ar" if entry == "ar_generate" else "llada"]
    ran = []

    def forward(*args, **kwargs):
        ran.append(1)
        raise AssertionError("the model ran")

    prompt = torch.tensor([PROBLEMS[0]])
    with pytest.MonkeyPatch.context() as patch, pytest.raises((ValueError, TypeError)) as info:
        patch.setattr(model, "forward", forward)
        _quiet(getattr(remask, entry), model, prompt, **{**BASE[entry], name: value})
    assert not ran, "the model ran before the bad value was refused"
    named = {"mask_id": ("mask_id",), "use_cache": ("use_cache",), "pad_token_id": ("pad_token_id", "pad"),
             "max_new_tokens": ("max_new_tokens", "max_length")}.get(name, (name,))
    assert any(n in str(info.value) for n in named), f"{name}={value!r}: {type(info.value).__name__}: {info.value}"
    assert isinstance(info.value, ValueError), f"{type(info.value).__name__} is not a ValueError: {info.value}"

"""Bad input, entry point by entry point: every case raises ValueError/TypeError naming the
parameter (never an IndexError or RuntimeError from deep inside torch), before any forward.
Plus the invariants that used to slip: no mask token out of any path, masks in the prompt infilled
or refused, padding-invariant Sparse-dLLM retention on tiny-llada, answer text cut at EOS."""
from __future__ import annotations

import warnings

import pytest
import torch

import remask
from remask.compat import fast_dllm
from remask.zoo import charset, tasks

MASK = charset.MASK_ID


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = remask.load("tiny-llada")
    ar, _ = remask.load("tiny-ar")
    return model, tokenizer, ar


@pytest.fixture(autouse=True)
def no_forward_on_bad_input(request, monkeypatch):
    """Bad-input tests: the model must not run (checks happen before anything is computed)."""
    if "bad" not in request.node.name:
        yield
        return
    model, _, ar = request.getfixturevalue("tiny")

    def refuse(*args, **kwargs):
        raise AssertionError("the model ran before the bad input was refused")

    for m in (model, ar):
        monkeypatch.setattr(m, "forward", refuse)
    yield


PROMPT = torch.tensor([charset.encode_chat("sort 52814")])
LLADA = dict(steps=8, gen_length=8, block_length=8)
INF, NAN = float("inf"), float("nan")

# (keyword arguments, the parameter the error must name)
GENERATE_BAD = [
    (dict(temperature=INF), "temperature"), (dict(temperature=NAN), "temperature"),
    (dict(temperature="0.5"), "temperature"), (dict(temperature=torch.tensor(0.5)), "temperature"),
    (dict(temperature=-0.1), "temperature"), (dict(steps=8.0), "steps"), (dict(steps=True), "steps"),
    (dict(steps=0), "steps"), (dict(gen_length="8"), "gen_length"), (dict(gen_length=-8), "gen_length"),
    (dict(block_length=None), "block_length"), (dict(gen_length=12, block_length=8), "gen_length"),
    (dict(steps=7, gen_length=16), "steps"), (dict(threshold=NAN), "threshold"), (dict(threshold=0), "threshold"),
    (dict(threshold="0.9"), "threshold"), (dict(factor=INF), "factor"), (dict(factor=0), "factor"),
    (dict(threshold=0.9, factor=1.0), "threshold"), (dict(cfg_scale="1"), "cfg_scale"),
    (dict(cfg_scale=-1), "cfg_scale"), (dict(cfg_scale=INF), "cfg_scale"), (dict(remasking=None), "remasking"),
    (dict(remasking="LOW_CONFIDENCE"), "remasking"), (dict(generator=3), "generator"),
    (dict(stats={}), "stats"),
    (dict(on_step=3), "on_step"), (dict(use_cache=["dual"]), "use_cache"), (dict(use_cache="full"), "use_cache"),
    (dict(use_cache=torch.tensor(1)), "use_cache"), (dict(mask_id="4"), "mask_id"), (dict(mask_id=-1), "mask_id"),
    (dict(mask_id=128), "mask_id"), (dict(mask_id=0), "pad"), (dict(eos_id=1000), "eos_id"),
    (dict(eot_id=2.0), "eot_id"), (dict(early_stop="yes"), "early_stop"), (dict(logits_eos_inf=1), "logits_eos_inf"),
    (dict(confidence_eos_eot_inf=1), "confidence_eos_eot_inf"), (dict(confidence_eos_eot_inf="yes"), "confidence_eos_eot_inf"),
    (dict(apd={}), "apd"), (dict(sparse={}), "sparse"), (dict(reference_ties="x"), "reference_ties"),
    (dict(reference_rng=0), "reference_rng"), (dict(verifier_stats=1), "verifier_stats"),
    (dict(gen_length=128, block_length=128, steps=128), "gen_length"),
    (dict(use_cache="dual", cfg_scale=1.0), "cfg_scale"), (dict(sparse=remask.SparseConfig(), use_cache="dual"), "use_cache"),
]

DREAM = dict(max_new_tokens=8, steps=8)
DIFFUSION_GENERATE_BAD = [
    (dict(temperature=INF), "temperature"), (dict(temperature="1"), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(top_p=NAN), "top_p"), (dict(top_k=0), "top_k"), (dict(top_k=1.5), "top_k"),
    (dict(eps=1.0), "eps"), (dict(eps=-0.1), "eps"), (dict(alg_temp=-1.0), "alg_temp"), (dict(alg_temp=INF), "alg_temp"),
    (dict(num_return_sequences=0), "num_return_sequences"), (dict(num_return_sequences=1.0), "num_return_sequences"),
    (dict(steps="8"), "steps"), (dict(steps=0), "steps"), (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=None, max_length=0), "max_length"), (dict(max_new_tokens=None, max_length=5), "max_length"),
    (dict(max_new_tokens=500), "max_length"), (dict(alg="greedy"), "alg"), (dict(alg=None), "alg"),
    (dict(alg="confidence_threshold", threshold=2.0), "threshold"), (dict(threshold=NAN), "threshold"),
    (dict(alg="confidence_threshold", threshold=None), "threshold"), (dict(finish_blocks="x"), "finish_blocks"), (dict(block_length="8"), "block_length"),
    (dict(block_length=3), "block_length"), (dict(use_cache="full"), "use_cache"),
    (dict(generation_tokens_hook_func=3), "generation_tokens_hook_func"), (dict(generator="x"), "generator"),
    (dict(output_history=1), "output_history"), (dict(return_dict_in_generate="yes"), "return_dict_in_generate"),
    (dict(pad_token_id=999), "pad_token_id"), (dict(mask_token_id=999), "mask_id"), (dict(stats=[]), "stats"),
    (dict(apd="apd"), "apd"), (dict(verifier_stats=0), "verifier_stats"), (dict(stepz=3), "stepz"),
]

AR = dict(max_new_tokens=4)
AR_GENERATE_BAD = [
    (dict(temperature=NAN), "temperature"), (dict(temperature=-1), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_k="2"), "top_k"), (dict(top_k=0), "top_k"), (dict(eos_token_id=999), "eos_token_id"),
    (dict(eos_token_id="2"), "eos_token_id"), (dict(pad_token_id=999), "pad_token_id"),
    (dict(max_new_tokens="4"), "max_new_tokens"), (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=200), "max_new_tokens"), (dict(generator=1), "generator"), (dict(stats=1), "stats"),
]


def _raises_naming(call, name):
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    assert name in str(info.value), f"{type(info.value).__name__}: {info.value}"
    # A wrong type is a ParameterTypeError: `except ValueError` catches every bad argument.
    assert isinstance(info.value, ValueError), f"{type(info.value).__name__}: {info.value}"


@pytest.mark.parametrize("kwargs,name", GENERATE_BAD, ids=[f"{n}-{i}" for i, (_, n) in enumerate(GENERATE_BAD)])
def test_generate_bad(tiny, kwargs, name):
    model = tiny[0]
    _raises_naming(lambda: remask.generate(model, PROMPT, **{**LLADA, **kwargs}), name)


@pytest.mark.parametrize("kwargs,name", DIFFUSION_GENERATE_BAD,
                         ids=[f"{n}-{i}" for i, (_, n) in enumerate(DIFFUSION_GENERATE_BAD)])
def test_diffusion_generate_bad(tiny, kwargs, name):
    model = tiny[0]
    _raises_naming(lambda: remask.diffusion_generate(model, PROMPT, **{**DREAM, **kwargs}), name)


def test_diffusion_generate_takes_threshold_none_where_upstream_does_not_read_it(tiny):
    """Fast-dLLM's Dream code reads `threshold` under alg="confidence_threshold" only, so elsewhere it runs with
    None: so does the drop-in, in Dream's sampler and in the block decoder (the tokens of the default)."""
    model = tiny[0]
    for extra in (dict(alg="origin"), dict(alg="entropy"), dict(alg="maskgit_plus", block_length=4, use_cache="dual")):
        want, got = (remask.diffusion_generate(model, PROMPT, **DREAM, **extra, **threshold,
                                               generator=torch.Generator().manual_seed(0))
                     for threshold in ({}, {"threshold": None}))
        assert torch.equal(got, want), extra


@pytest.mark.parametrize("kwargs,name", AR_GENERATE_BAD, ids=[f"{n}-{i}" for i, (_, n) in enumerate(AR_GENERATE_BAD)])
def test_ar_generate_bad(tiny, kwargs, name):
    ar = tiny[2]
    _raises_naming(lambda: remask.ar_generate(ar, PROMPT, **{**AR, **kwargs}), name)


BAD_TENSORS = [
    (torch.tensor([[1, 500]]), None, "vocabulary"), (torch.tensor([[1, -3]]), None, "vocabulary"),
    # with an attention mask check_prompt reads the ids on the device (without one, a small CPU prompt in Python)
    (torch.tensor([[1, 500]]), torch.tensor([[1, 1]]), "vocabulary"),
    (torch.tensor([[1, 5, 0]]), torch.tensor([[1, 1, 0]]), "left-padded"),
    (torch.tensor([[1, 5]]), torch.tensor([[1, 2]]), "attention_mask"),
    (torch.tensor([[0, 5]]), torch.tensor([[0.5, 1.0]]), "attention_mask"),
    (torch.tensor([[0, 0]]), torch.tensor([[0, 0]]), "no real token"),
    (torch.tensor([[1, 5]]), torch.tensor([[1, 1, 1]]), "attention_mask"),
    ([[1, 2]], None, "2-D"), (torch.tensor([1, 2]), None, "2-D"), (torch.zeros(1, 3), None, "integer"),
    (torch.zeros(0, 3, dtype=torch.long), None, "at least one"),
]


# Fast-dLLM's generate takes no attention mask: only the mask-free cases apply to it.
@pytest.mark.parametrize("entry,ids,mask,name", [
    (entry, *case) for entry in ("generate", "diffusion_generate", "ar_generate", "fast_dllm", "dream_block")
    for case in BAD_TENSORS if not (entry == "fast_dllm" and case[1] is not None)])
def test_bad_prompt_tensors(tiny, entry, ids, mask, name):
    model, _, ar = tiny
    calls = {
        "generate": lambda: remask.generate(model, ids, mask, **LLADA),
        "diffusion_generate": lambda: remask.diffusion_generate(model, ids, attention_mask=mask, **DREAM),
        "ar_generate": lambda: remask.ar_generate(ar, ids, mask, **AR),
        "fast_dllm": lambda: fast_dllm.generate(model, ids, mask_id=MASK, **LLADA),
        "dream_block": lambda: fast_dllm.dream_diffusion_generate(model, ids, attention_mask=mask, max_new_tokens=8,
                                                                   steps=8, block_length=8),
    }
    _raises_naming(calls[entry], name)


def test_model_kinds_bad(tiny):
    model, _, ar = tiny
    _raises_naming(lambda: remask.generate(ar, PROMPT, **LLADA), "ar_generate")
    _raises_naming(lambda: remask.diffusion_generate(ar, PROMPT, **DREAM), "ar_generate")
    _raises_naming(lambda: fast_dllm.generate(ar, PROMPT, mask_id=MASK, **LLADA), "ar_generate")
    _raises_naming(lambda: remask.ar_generate(model, PROMPT, **AR), "diffusion model")
    _raises_naming(lambda: remask.APDConfig(model), "verifier")      # not causal
    _raises_naming(lambda: remask.APDConfig(None), "verifier")


@pytest.mark.parametrize("kwargs,name", [
    (dict(mixture_weight="0.7"), "mixture_weight"), (dict(mixture_weight=NAN), "mixture_weight"),
    (dict(kv_window=1.5), "kv_window"), (dict(max_lookahead=0), "max_lookahead"),
    (dict(coupled_gumbel=1), "coupled_gumbel"), (dict(dllm_cache="yes"), "dllm_cache"),
])
def test_apd_config_bad(tiny, kwargs, name):
    _raises_naming(lambda: remask.APDConfig(tiny[2], **kwargs), name)


@pytest.mark.parametrize("kwargs,name", [
    (dict(retention_ratio="0.5"), "retention_ratio"), (dict(retention_ratio=INF), "retention_ratio"),
    (dict(retention_ratio=0), "retention_ratio"), (dict(delay_step=1.0), "delay_step"),
    (dict(pool_kernel=2), "pool_kernel"), (dict(pool_kernel="3"), "pool_kernel"), (dict(head_select=1), "head_select"),
    (dict(method="flex"), "method"), (dict(skip_fraction=1.0), "skip_fraction"), (dict(kv_block_size=0), "kv_block_size"),
    (dict(block_len=0), "block_len"), (dict(corrected_scale="no"), "corrected_scale"),
])
def test_sparse_config_bad(kwargs, name):
    _raises_naming(lambda: remask.SparseConfig(**kwargs), name)


SAMPLING_PARAMS_BAD = [
    (dict(ignore_eos=1), "ignore_eos"), (dict(ignore_eos="true"), "ignore_eos"), (dict(ignore_eos=None), "ignore_eos"),
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=1.0), "min_tokens"), (dict(min_tokens=True), "min_tokens"),
    (dict(min_tokens="2"), "min_tokens"), (dict(min_tokens=None), "min_tokens"),
    (dict(max_tokens=16, min_tokens=17), "min_tokens"), (dict(ignore_eos=True, early_stop=True), "ignore_eos"),
]


@pytest.mark.parametrize("kwargs,name", SAMPLING_PARAMS_BAD,
                         ids=[f"{n}-{i}" for i, (_, n) in enumerate(SAMPLING_PARAMS_BAD)])
def test_sampling_params_bad(kwargs, name):
    """vLLM's ignore_eos (True/False only) and min_tokens (an int in [0, max_tokens]): the layer
    `LLM`, the CLI and the server share refuses anything else, naming the field."""
    _raises_naming(lambda: remask.SamplingParams(**kwargs), name)


# Work bounds (issue 29): settings that size a request's work, refused past the value that can still
# change the answer, so one request cannot allocate O(steps) buffers or pin the engine.
WORK_BOUNDS_BAD = [
    (dict(max_tokens=16, steps=10**9), "steps"), (dict(max_tokens=16, steps=17), "steps"),
    (dict(max_tokens=16, steps=32, alg="entropy"), "steps"),                       # Dream's sampler too
    (dict(seed=2**70), "seed"), (dict(seed=2**64), "seed"), (dict(seed=2**64 - 1, n=2), "seed"),
    (dict(seed=-1), "seed"), (dict(temperature=1e308), "temperature"), (dict(temperature=100.5), "temperature"),
    (dict(alg="entropy", alg_temp=1e308), "alg_temp"),
    (dict(max_tokens=True), "max_tokens"), (dict(n=True), "n"), (dict(seed=True), "seed"), (dict(steps=True), "steps"),
    (dict(temperature=True), "temperature"), (dict(top_p=True), "top_p"), (dict(top_k=True), "top_k"),
    (dict(block_length=True), "block_length"), (dict(threshold=True), "threshold"), (dict(cfg_scale=True), "cfg_scale"),
    (dict(stop_token_ids=[True]), "stop_token_ids"),
    (dict(decoder={"name": "sdar", "block_length": 4, "denoising_steps": 5}), "SDARDecoding.denoising_steps"),
    (dict(decoder={"name": "sdar", "denoising_steps": True}), "SDARDecoding.denoising_steps"),
    (dict(decoder={"name": "llada2", "block_length": 32, "steps": 33}), "LLaDA2Decoding.steps"),
    (dict(decoder={"name": "llada2", "block_length": 32, "num_to_transfer": 10**9}), "LLaDA2Decoding.num_to_transfer"),
    (dict(decoder={"name": "llada2", "max_post_steps": 10**9}), "LLaDA2Decoding.max_post_steps"),
    (dict(decoder={"name": "canvas", "max_denoising_steps": 10**9}), "CanvasDecoding.max_denoising_steps"),
    (dict(decoder={"name": "fast_dllm_v2", "block_size": 8, "small_block_size": 16}),
     "FastDLLMV2Decoding.small_block_size"),
]


@pytest.mark.parametrize("kwargs,name", WORK_BOUNDS_BAD, ids=[f"{n}-{i}" for i, (_, n) in enumerate(WORK_BOUNDS_BAD)])
def test_sampling_params_work_bounds_bad(kwargs, name):
    """`steps` past `max_tokens` (LLaDA's block rule, Dream's sampler: a step commits at least one
    token), a block-causal family's steps past its block, uncapped loops, seeds outside torch's
    64-bit range (named, never torch's "Overflow when unpacking long long"), temperatures past 100
    and booleans where numbers belong: each refused by name when SamplingParams is built."""
    _raises_naming(lambda: remask.SamplingParams(**kwargs), name)


def test_work_bounds_allow_their_maximum():
    """The bounds are the largest meaningful values, not below them."""
    remask.SamplingParams(max_tokens=16, steps=16)
    remask.SamplingParams(max_tokens=16, steps=16, alg="entropy")
    remask.SamplingParams(seed=2**64 - 1)
    remask.SamplingParams(seed=2**64 - 2, n=2)
    remask.SamplingParams(temperature=100)
    remask.SamplingParams(decoder=remask.SDARDecoding(block_length=4, denoising_steps=4))
    remask.SamplingParams(decoder=remask.CanvasDecoding(max_denoising_steps=1024))


# No silent clamps (issue 37): a decoder / cache / sparse / canvas setting past the largest value that can
# still change the decoding used to act as that value; the ones that remain bounded (FreeDave's draft steps,
# the canvas, Elastic-Cache's track_num, SparseD's kv_block_size) are refused, naming the setting and the
# maximum, as the work bounds above. Settings that read "at most" and cost no more work past it are taken
# (issue 44: the drop-in takes what the reference takes; TAKEN_PAST_THE_MAXIMUM below).
CONFIG_BOUNDS_BAD = [   # (SamplingParams keywords, the setting, its maximum there)
    (dict(max_tokens=16, block_length=16, decoder={"name": "freedave", "draft_steps": 10**9}), "decoder.draft_steps",
     16),
    (dict(max_tokens=16, block_length=16, decoder=remask.FreeDave(draft_steps=17)), "decoder.draft_steps", 16),
    (dict(max_tokens=16, decoder={"name": "wino", "accept_ratio": 1e308}), "accept_ratio", 1),
    (dict(decoder={"name": "canvas", "stability_threshold": 10**9}), "CanvasDecoding.stability_threshold", 1024),
    (dict(decoder=dict(name="canvas", max_denoising_steps=8, stability_threshold=9)), "CanvasDecoding.stability_threshold",
     8),
    (dict(stop=["x"] * 20_000), "stop", 64), (dict(stop=["x"] * 65), "stop", 64), (dict(stop=["x" * 257]), "stop", 256),
    (dict(stop=["a", "x" * 10**6]), "stop[1]", 256),
]


@pytest.mark.parametrize("kwargs,name,maximum", CONFIG_BOUNDS_BAD,
                         ids=[f"{n}-{i}" for i, (_, n, _) in enumerate(CONFIG_BOUNDS_BAD)])
def test_sampling_params_config_bounds_bad(kwargs, name, maximum):
    """Each refused when SamplingParams is built (LLM, the CLI, the server), naming the setting and
    its maximum."""
    with pytest.raises(ValueError) as info:
        remask.SamplingParams(**kwargs)
    assert name in str(info.value) and str(maximum) in str(info.value), str(info.value)
    assert len(str(info.value)) < 400   # 20,000 stop strings are counted, not echoed


def test_config_bounds_allow_their_maximum_and_the_defaults():
    """The maximum itself passes (max + 1 is refused above), and so does each config's default at
    any length (it reads "up to": `ElasticCache()` with 8 tokens, `FreeDave()` with blocks of 2)."""
    sp = remask.SamplingParams
    sp(max_tokens=16, block_length=16, decoder={"name": "freedave", "draft_steps": 16})
    sp(max_tokens=16, use_cache={"name": "elastic", "window_length": 16})
    sp(max_tokens=16, use_cache=remask.ElasticCache(window_length=8, threshold=None, tokens_per_iter=8))
    sp(max_tokens=16, use_cache=remask.D2Cache(current_k=16))
    sp(max_tokens=16, block_length=8, use_cache=remask.DKVCache(cache_reloading_step=8))
    sp(max_tokens=16, remasking="random", use_cache=remask.DKVCache(variant="greedy", window_size=16))
    sp(max_tokens=16, block_length=8, decoder=remask.WINO(accept_floor=8, accept_cap=8))
    sp(max_tokens=16, decoder=remask.WINO(accept_ratio=1.0))
    sp(max_tokens=16, block_length=8, sparse=remask.SparseConfig(delay_step=8))
    sp(decoder=remask.CanvasDecoding(stability_threshold=1024))
    sp(decoder=remask.CanvasDecoding(max_denoising_steps=8, stability_threshold=8))
    sp(stop=["x" * 256] * 64)
    sp(max_tokens=8, use_cache=remask.ElasticCache())                       # window_length 16
    sp(max_tokens=4, block_length=2, decoder=remask.FreeDave())             # draft_steps 4
    sp(max_tokens=8, use_cache=remask.D2Cache())                            # current_k 32
    sp(max_tokens=8, block_length=4, decoder=remask.WINO())                 # accept_floor 5, accept_cap 20
    sp(max_tokens=4, use_cache=remask.DKVCache())                           # cache_reloading_step 8


def _config_bounds_calls(model, ar):
    """(remask.generate keywords, the setting, its maximum) with PROMPT's 14 tokens: the bounds that
    need the prompt (T = 14 + gen_length) or the block of the drop-in call."""
    return [
        (dict(gen_length=16, block_length=16, decoder=remask.FreeDave(draft_steps=17)), "decoder.draft_steps", 16),
        (dict(gen_length=16, block_length=8, decoder=remask.FreeDave(draft_steps=10**9)), "decoder.draft_steps", 8),
        (dict(gen_length=16, block_length=16, use_cache=remask.ElasticCache(track_num=31)), "use_cache.track_num", 30),
        (dict(gen_length=16, block_length=8, steps=16, sparse=remask.SparseConfig(method="block_mask",
                                                                                  kv_block_size=10**9)),
         "sparse.kv_block_size", 30),
    ]


@pytest.mark.parametrize("case", range(4))
def test_drop_in_config_bounds_bad(tiny, case):
    """The drop-in call runs the same checks (with the prompt and the call's block), before any
    forward: a ValueError naming the setting and its maximum."""
    model, _, ar = tiny
    kwargs, name, maximum = _config_bounds_calls(model, ar)[case]
    with pytest.raises(ValueError) as info:
        remask.generate(model, PROMPT, **kwargs)
    assert name in str(info.value) and f"<= {maximum} " in str(info.value), str(info.value)


def test_drop_in_config_bounds_allow_their_maximum(tiny):
    """The maximum itself decodes (draft_steps = the block, window_length = gen_length, track_num =
    the sequence: torch's topk used to raise one past it)."""
    model = tiny[0]
    T = PROMPT.shape[1] + 8
    for kwargs in (dict(block_length=8, decoder=remask.FreeDave(draft_steps=8)),
                   dict(block_length=8, use_cache=remask.ElasticCache(window_length=8, track_num=T))):
        out = remask.generate(model, PROMPT, gen_length=8, **kwargs)
        assert out.shape == (1, T)


def test_apd_takes_every_lookahead_and_window_the_reference_takes(tiny):
    """Official APD runs `max_lookahead` past the answer (the window is the rest of it) and a
    `kv_window` past the sequence (the whole cache kept): so does the drop-in, with the tokens of
    the largest value that still changes anything (issue 44)."""
    model, _, ar = tiny
    T = PROMPT.shape[1] + 8

    def apd(**config):
        return remask.generate(model, PROMPT, gen_length=8, apd=remask.APDConfig(ar, **config))

    assert torch.equal(apd(max_lookahead=200), apd(max_lookahead=8))
    assert torch.equal(apd(max_lookahead=200), apd(max_lookahead=None))
    assert torch.equal(apd(kv_window=10**6), apd(kv_window=T - 1))
    assert torch.equal(apd(kv_window=10**6), apd(kv_window=None))


# (remask.generate keywords, the config's class, the setting, a value far past its maximum, the maximum)
# with PROMPT's 14 tokens (T = 14 + gen_length): "at most" settings the official code runs at any value
TAKEN_PAST_THE_MAXIMUM = [
    (dict(gen_length=16, block_length=8), "decoder", remask.WINO, dict(accept_floor=10**6, accept_cap=10**6),
     dict(accept_floor=8, accept_cap=8)),
    (dict(gen_length=16, block_length=8), "decoder", remask.WINO, dict(accept_cap=10**6), dict(accept_cap=8)),
    (dict(gen_length=16, block_length=16), "use_cache", remask.ElasticCache, dict(window_length=10**6),
     dict(window_length=16)),
    (dict(gen_length=16, block_length=16), "use_cache", remask.ElasticCache,
     dict(window_length=8, threshold=None, tokens_per_iter=10**6), dict(window_length=8, threshold=None, tokens_per_iter=8)),
    (dict(gen_length=16, block_length=16, steps=16), "use_cache", remask.D2Cache, dict(current_k=10**6),
     dict(current_k=16)),
    (dict(gen_length=16, block_length=16, steps=16), "use_cache", remask.D2Cache, dict(inflate_w=10**6),
     dict(inflate_w=29)),
    (dict(gen_length=16, block_length=8, steps=16), "use_cache", remask.DKVCache, dict(cache_reloading_step=10**6),
     dict(cache_reloading_step=8)),
    (dict(gen_length=16, block_length=8, steps=16, remasking="random"), "use_cache", remask.DKVCache,
     dict(variant="greedy", window_size=10**6), dict(variant="greedy", window_size=16)),
    # dInfer's blocks from position 0: [0, 16) [16, 32) [32, 46)
    (dict(gen_length=32, block_length=16), "use_cache", remask.VicinityCache, dict(prefix_look=10**6),
     dict(prefix_look=32)),
    (dict(gen_length=32, block_length=16), "use_cache", remask.VicinityCache, dict(after_look=10**6),
     dict(after_look=30)),
    (dict(gen_length=32, block_length=16), "use_cache", remask.VicinityCache, dict(warmup_steps=10**6),
     dict(warmup_steps=44)),
    (dict(gen_length=16, block_length=8, steps=16), "sparse", remask.SparseConfig, dict(delay_step=10**6),
     dict(delay_step=8)),
    (dict(gen_length=16, block_length=8, steps=16), "sparse", remask.SparseConfig, dict(pool_kernel=10**6 + 1),
     dict(pool_kernel=43)),
]


@pytest.mark.parametrize("kwargs,field,config,past,maximum", TAKEN_PAST_THE_MAXIMUM,
                         ids=[f"{c.__name__}-{'-'.join(p)}" for _, _, c, p, _ in TAKEN_PAST_THE_MAXIMUM])
def test_at_most_settings_take_every_value_the_reference_takes(tiny, kwargs, field, config, past, maximum):
    """Issue 44: a setting that reads "at most" (WINO's accept floor and cap, Elastic-Cache's window
    and top-k, d2Cache's current_k and inflate_w, dKV-Cache's reload step and greedy window, the
    vicinity cache's looks and warmup, Sparse-dLLM's delay and pooling) is no silent clamp: the
    official code runs any value, and so does the drop-in, with the tokens of the largest value that
    still changes anything."""
    model = tiny[0]

    def run(settings):
        return remask.generate(model, PROMPT, **kwargs, **{field: config(**settings)},
                               generator=torch.Generator().manual_seed(0))

    out = run(past)
    assert out.shape == (1, PROMPT.shape[1] + kwargs["gen_length"])
    assert torch.equal(out, run(maximum))


def test_config_bounds_through_the_engine_name_the_setting():
    """A bound SamplingParams cannot check alone (FreeDave's block: a block-causal model's own;
    Elastic-Cache's track_num: the prompt's) is refused at add_request, naming it; a setting that
    reads "at most" (the vicinity cache's windows, issue 44) is taken there, with the tokens of a
    value already past every block (the context, 128)."""
    llm = remask.LLM("tiny-llada")
    for params, name in ((remask.SamplingParams(max_tokens=16, decoder={"name": "freedave", "draft_steps": 10**9}),
                          "decoder.draft_steps must be <= 16 "),
                         (remask.SamplingParams(max_tokens=16, use_cache=remask.ElasticCache(track_num=10**9)),
                          "use_cache.track_num must be <= ")):
        with pytest.raises(ValueError, match=name):
            llm.generate("sort 52814", params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()

    def text(**looks):
        params = remask.SamplingParams(max_tokens=16, block_length=8, use_cache=remask.VicinityCache(**looks))
        return llm.generate("sort 52814", params, use_tqdm=False)[0].outputs[0].token_ids

    assert text(prefix_look=10**9, after_look=10**9) == text(prefix_look=128, after_look=128)
    assert not llm.engine.has_unfinished_requests()


def test_max_tokens_past_the_context_is_refused_at_add_request_naming_max_tokens():
    """`max_tokens=10**9`: refused by the engine before any decoder sizes a buffer by it, with an
    error naming `max_tokens` (it used to name the decoder's `gen_length`)."""
    import resource

    llm = remask.LLM("tiny-llada")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ValueError, match=r"^max_tokens = 1000000000 .*maximum sequence length 128"):
        llm.engine.add_request("r", "sort 52814", remask.SamplingParams(max_tokens=10**9))
    with pytest.raises(ValueError, match=r"^max_tokens"):
        llm.engine.add_request("r", "sort 52814", remask.SamplingParams(max_tokens=10**9, steps=10**9))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000     # KiB: nothing was allocated
    assert not llm.engine.has_unfinished_requests()
    ar = remask.LLM("tiny-ar")
    with pytest.raises(ValueError, match=r"^max_tokens"):
        ar.engine.add_request("r", "sort 52814", remask.SamplingParams(max_tokens=10**9))


def test_masks_in_the_prompt_bad(tiny):
    """Samplers that decode only after the prompt refuse a mask there (it would come back)."""
    model, _, ar = tiny
    ids = PROMPT.clone()
    ids[0, 3] = MASK
    _raises_naming(lambda: remask.generate(model, ids, **LLADA), "mask token")
    _raises_naming(lambda: remask.generate(model, ids, torch.ones_like(ids), **LLADA), "mask token")   # device path
    _raises_naming(lambda: fast_dllm.generate_with_dual_cache(model, ids, mask_id=MASK, **LLADA), "mask token")
    _raises_naming(lambda: remask.diffusion_generate(model, ids, use_cache="dual", block_length=8, **DREAM), "mask token")
    _raises_naming(lambda: remask.generate(model, ids, gen_length=8, apd=remask.APDConfig(ar)), "mask token")


@pytest.mark.parametrize("alg,alg_temp", [("origin", None), ("maskgit_plus", None), ("entropy", 0.5),
                                          ("topk_margin", None), ("confidence_threshold", None)])
def test_dream_sampler_infills_masks_in_the_prompt(tiny, alg, alg_temp):
    """Dream's sampler decodes every mask of the sequence: prompt masks are infilled (rows with
    different numbers of them included) and nothing else in the prompt changes."""
    model = tiny[0]
    rows = [charset.encode_chat("sort 52814"), charset.encode_chat("reverse abcd")]
    ids = torch.full((2, max(map(len, rows))), charset.PAD_ID)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, ids.shape[1] - len(r):] = torch.tensor(r)
        mask[i, ids.shape[1] - len(r):] = 1
    ids[0, -4] = MASK
    ids[0, -5] = MASK
    steps = 8 if alg != "confidence_threshold" else 1
    out = remask.diffusion_generate(model, ids[:1] if alg == "confidence_threshold" else ids,
                                    attention_mask=mask[:1] if alg == "confidence_threshold" else mask,
                                    max_new_tokens=8, steps=steps, alg=alg, alg_temp=alg_temp,
                                    generator=torch.Generator().manual_seed(0))
    assert not (out == MASK).any()
    P = ids.shape[1]
    keep = ids[: out.shape[0]] != MASK
    assert torch.equal(out[:, :P][keep], ids[: out.shape[0]][keep])


def test_temperature_inf_used_to_return_masks_and_now_is_refused(tiny):
    _raises_naming(lambda: remask.generate(tiny[0], PROMPT, temperature=float("inf"), **LLADA), "temperature")


def test_ar_model_never_emits_its_declared_mask_token(tiny):
    """tiny-ar shares tiny-llada's tokenizer and declares its mask id; boost it to the top."""
    _, _, ar = tiny
    bias = torch.zeros(ar.config.vocab_size)
    bias[MASK] = 100.0
    handle = ar.lm_head.register_forward_hook(lambda mod, inp, out: out + bias)
    try:
        out = remask.ar_generate(ar, PROMPT, max_new_tokens=6)
        sampled = remask.ar_generate(ar, PROMPT, max_new_tokens=6, temperature=1.0,
                                     generator=torch.Generator().manual_seed(0))
    finally:
        handle.remove()
    assert not (out == MASK).any() and not (sampled == MASK).any()


def test_retention_is_padding_invariant_on_tiny_llada(tiny):
    """0…6 left pads: the same kept positions, hence the same tokens, as the row alone (ties in
    the pooled scores go to the earlier position, whatever the row's offset)."""
    model = tiny[0]
    sparse = remask.SparseConfig(retention_ratio=0.5)
    for problem in tasks.problems(12, tasks.EVAL_SEED):
        ids = torch.tensor([charset.encode_chat(problem.prompt)])
        kw = dict(steps=16, gen_length=16, block_length=8, sparse=sparse)
        alone = remask.generate(model, ids, **kw)
        for pad in range(1, 7):
            padded = torch.cat([torch.full((1, pad), charset.PAD_ID), ids], dim=1)
            mask = torch.cat([torch.zeros(1, pad, dtype=torch.long), torch.ones_like(ids)], dim=1)
            out = remask.generate(model, padded, mask, **kw)
            assert torch.equal(out[:, pad:], alone), (problem.prompt, pad)
        # ... and inside a batch with other rows of other lengths
        other = torch.tensor([charset.encode_chat("greet Ann")])
        width = max(ids.shape[1], other.shape[1]) + 2
        batch = torch.full((2, width), charset.PAD_ID)
        mask = torch.zeros_like(batch)
        for i, r in enumerate((ids[0], other[0])):
            batch[i, width - len(r):], mask[i, width - len(r):] = r, 1
        out = remask.generate(model, batch, mask, **kw)
        assert torch.equal(out[0, width - ids.shape[1]:], alone[0]), problem.prompt


def test_answer_text_stops_at_the_first_eos(tiny):
    _, tokenizer, _ = tiny
    ids = charset.encode_text("Hello, Hugo!") + [charset.EOS_ID] + charset.encode_text("oo") + [charset.EOS_ID]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Hello, Hugo!oo"   # what we used to show
    assert remask.answer_text(tokenizer, ids) == "Hello, Hugo!"
    assert remask.answer_text(tokenizer, torch.tensor([ids, [charset.EOT_ID] + ids[:-1]])) == ["Hello, Hugo!", ""]
    assert remask.answer_text(tokenizer, ids, stop_ids=[]) == "Hello, Hugo!oo"
    assert charset.EOT_ID in remask.stop_token_ids(tokenizer)


def test_warnings(tiny):
    model = tiny[0]
    padded = torch.cat([torch.full((1, 2), charset.PAD_ID), PROMPT], dim=1)
    with pytest.warns(UserWarning, match="attention mask"):
        remask.generate(model, padded, **LLADA)
    with pytest.warns(UserWarning, match="trained on"):
        remask.generate(model, PROMPT, steps=32, gen_length=32, block_length=32)
    with pytest.warns(UserWarning, match="trained on"):
        remask.diffusion_generate(model, PROMPT, max_new_tokens=32, steps=32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        remask.generate(model, PROMPT, **LLADA)   # 8 <= 16 positions, no pads: silent

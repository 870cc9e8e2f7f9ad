"""Structured output under Dream's decoders and the step-generator methods (diffusion/parts/constrain.py):
Dream's sampler (its algs) and Fast-dLLM's Dream block decoder, FreeDave (LLaDA and Dream), dInfer's
rules (threshold / credit / hierarchical, the vicinity cache, iteration smoothing), WINO, MultiBlock, and the
cache methods dKV-Cache (Decode and Greedy; Dream's), d2Cache and Elastic-Cache (its own rule and a
dInfer rule), on the shipped tiny LLaDA and a tiny random Dream checkpoint with the tiny models'
character tokenizer.

Every output is checked: no mask token; finished with `stop` (an end token in it) it parses and
validates (`jsonschema`), else a valid prefix. The share that finishes with `stop` is tallied per
method (printed with `-s`, asserted > 0). The engine's tokens equal the drop-in call's; FreeDave
under a structure equals the constrained one-token-per-step block rule."""
from __future__ import annotations

import os
import shutil
import warnings

import pytest
import torch

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

import remask  # noqa: E402
from remask.structured import StructuredOutputsParams as S, compile_structure  # noqa: E402
from remask.zoo.charset import BOS_ID, EOS_ID, EOT_ID, MASK_ID, PAD_ID, decode_answer, encode_chat  # noqa: E402

from test_structured import CHOICE, REGEX, SCHEMAS, batch, check_answer, tally  # noqa: E402
from remask.models.spec import get_spec

# a few schemas of different shapes (the full set runs on LLaDA's block rule in test_structured.py)
SHAPES = ("flat", "nested", "array", "enum", "optional", "number_or_null")
CASES = [S(json=SCHEMAS[name]) for name in SHAPES] + [S(regex=REGEX), S(choice=CHOICE)]


def cases_for(methods: dict, method: str) -> list:
    """Half of CASES for each method of a sweep, the two halves in turn: each structure runs under half its methods,
    each method under JSON schemas and a regex or a choice (the whole of CASES under every method: twice the time)."""
    return CASES[list(methods).index(method) % 2::2]
PROMPTS = ["What is the capital of France?", "sort 3 1 2"]
ENDS = (EOS_ID, EOT_ID)


@pytest.fixture(scope="module")
def llada():
    return remask.load("tiny-llada")


@pytest.fixture(scope="module")
def dream(tmp_path_factory):
    """A tiny random Dream checkpoint (the official layout, tests/test_dream_*.py's writer) on the
    tiny models' character vocabulary, its tokenizer saved beside it."""
    from remask.models import tiny
    from transformers import AutoModel, AutoTokenizer

    path = str(tmp_path_factory.mktemp("dream") / "tiny-dream-chars")
    tiny.write_tiny_dream(path, seed=7, vocab_size=128, mask_token_id=MASK_ID, eos_token_id=EOS_ID,
                          pad_token_id=PAD_ID, bos_token_id=BOS_ID)
    src = os.path.join(remask.zoo.__path__[0], "checkpoints", "tiny-llada")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, name), path)
    return AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path), path


def check_rows(rows: list[list[int]], params, tok, name: str, counts: list[int]) -> None:
    compiled = compile_structure(params, tok, 128, (MASK_ID,))
    for row in rows:
        counts[1] += 1
        assert MASK_ID not in row, (name, row)
        assert compiled.matcher(ENDS).accepts(row) == len(row), (name, decode_answer(row))   # a valid prefix
        if any(t in ENDS for t in row):
            counts[0] += 1
            check_answer(decode_answer(row), params)


LLADA_METHODS = {
    "freedave": dict(decoder=remask.FreeDave(draft_steps=4), steps=32),
    "freedave++ dual": dict(decoder=remask.FreeDave(confidence_threshold=0.7, match_rule="exact"), steps=32,
                            use_cache="dual"),
    "dinfer threshold": dict(decoder=remask.ThresholdDecoding(threshold=0.7)),
    "dinfer credit prefix": dict(decoder=remask.CreditDecoding(threshold=0.7), use_cache="prefix"),
    "dinfer hierarchical": dict(decoder=remask.HierarchicalDecoding(threshold=0.7, low_threshold=0.4)),
    "dinfer vicinity": dict(use_cache=remask.VicinityCache()),
    "dinfer smoothing": dict(decoder=remask.ThresholdDecoding(threshold=0.7, smoothing=remask.IterationSmoothing())),
    "wino": dict(decoder=remask.WINO(threshold=0.5, threshold_back=0.8)),
    "multiblock": dict(decoder=remask.MultiBlock(threshold=1.0, block_add_threshold=0.25)),
    "multiblock early stop": dict(decoder=remask.MultiBlock(threshold=2.0, early_stop=True)),
}


@pytest.mark.parametrize("method", list(LLADA_METHODS))
def test_llada_methods(llada, method):
    model, tok = llada
    counts = [0, 0]
    prompt, mask = batch(PROMPTS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # gen_length beyond the tiny model's trained 16
        for params in cases_for(LLADA_METHODS, method):
            out = remask.generate(model, prompt, mask, gen_length=32, block_length=8, structured_outputs=params,
                                  **LLADA_METHODS[method])
            check_rows(out[:, prompt.shape[1]:].tolist(), params, tok, method, counts)
    tally(f"llada {method}", *counts)


DREAM_METHODS = {
    "sampler entropy": dict(alg="entropy", steps=16),
    "sampler origin T=1": dict(alg="origin", steps=16, temperature=1.0, generator=torch.Generator().manual_seed(0)),
    "sampler maskgit_plus alg_temp": dict(alg="maskgit_plus", steps=8, alg_temp=0.5, temperature=0.8,
                                          generator=torch.Generator().manual_seed(1)),
    "sampler confidence_threshold": dict(alg="confidence_threshold", steps=8, threshold=0.6),
    "block decoder dual": dict(alg="confidence_threshold", steps=32, threshold=0.6, block_length=8, use_cache="dual"),
    "block decoder entropy": dict(alg="entropy", steps=8, block_length=8),
    "freedave": dict(decoder=remask.FreeDave(), steps=32, block_length=8),
    "dinfer threshold": dict(decoder=remask.ThresholdDecoding(threshold=0.7), block_length=8),
}


@pytest.mark.parametrize("method", list(DREAM_METHODS))
def test_dream_decoders(dream, method):
    model, tok, _ = dream
    counts = [0, 0]
    prompt, mask = batch(PROMPTS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for params in cases_for(DREAM_METHODS, method):
            kw = dict(DREAM_METHODS[method])
            if "generator" in kw:
                kw["generator"] = torch.Generator().manual_seed(kw["generator"].initial_seed())
            out = remask.diffusion_generate(model, prompt, attention_mask=mask, max_new_tokens=32,
                                            structured_outputs=params, tokenizer=tok, **kw)
            check_rows(out[:, prompt.shape[1]:].tolist(), params, tok, method, counts)
    tally(f"dream {method}", *counts)


def test_freedave_equals_the_constrained_one_token_rule(llada):
    """FreeDave's exactness, kept under a structure: its tokens are those of the constrained block
    rule at one token per step (the same cache schedule), with fewer forwards."""
    model, _ = llada
    prompt, mask = batch(PROMPTS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for params in (S(json=SCHEMAS["flat"]), S(json=SCHEMAS["array"]), S(regex=REGEX)):
            for cache in (None, "dual"):
                fast, slow = remask.GenerationStats(), remask.GenerationStats()
                a = remask.generate(model, prompt, mask, steps=32, gen_length=32, block_length=8, use_cache=cache,
                                    decoder=remask.FreeDave(draft_steps=4), structured_outputs=params, stats=fast)
                b = remask.generate(model, prompt, mask, steps=32, gen_length=32, block_length=8, use_cache=cache,
                                    structured_outputs=params, stats=slow)
                assert torch.equal(a, b), (params.kind, cache)
                assert fast.nfe <= slow.nfe



def test_freedave_reopens_a_block_without_holes_its_matcher_has_not_consumed(llada):
    """FreeDave's guard (`freedave._Decoder.block`): a block with no holes whose tokens the row's matcher has not
    consumed (a state a draft could leave: the chain compares tokens, not the matcher) is undecided again from the
    frontier and decoded under the structure, never left as it is (the answer would break the structure)."""
    from remask.diffusion.methods.freedave import FreeDave, _Decoder
    from remask.diffusion.parts.constrain import CommitFilter
    from remask.diffusion.parts.stepper import drive

    model, tok = llada
    spec, params = get_spec(model), S(choice=CHOICE)
    prompt = torch.tensor([encode_chat(PROMPTS[0])])
    P, gen = prompt.shape[1], 8
    stray = tok.encode("zzzzzzzz", add_special_tokens=False)   # no choice starts with "z"
    x = torch.cat([prompt, torch.tensor([stray])], dim=1)
    cf = CommitFilter.start(compile_structure(params, tok, 128, (MASK_ID,)), ENDS, 1, MASK_ID, P, gen)
    assert cf.unsettled(x, P, P + gen) == [True] and not bool((x == MASK_ID).any())
    decoder = _Decoder(spec, FreeDave(), gen, None, None, P, P + gen, remask.GenerationStats())
    row = drive(decoder.run(x, gen, cf), model)[0, P:].tolist()
    assert row != stray and MASK_ID not in row
    assert compile_structure(params, tok, 128, (MASK_ID,)).matcher(ENDS).accepts(row) == len(row), decode_answer(row)
    assert cf.unsettled(x, P, P + gen) == [False]

def _engine_rows(llm, prompts, params):
    """The engine's first completion per prompt, the prompts given as the chat ids the drop-in calls get."""
    ids = [{"prompt_token_ids": encode_chat(text)} for text in prompts]
    return [out.outputs[0] for out in llm.generate(ids, params, use_tqdm=False)]


def same_tokens(completion, ref: list[int], name) -> None:
    """The engine's completion is the drop-in's answer: the same tokens up to the end token, `stop`
    exactly where the drop-in's answer holds an end token (the engine's end set is the tokenizer's
    stop ids, e.g. EOT for the Dream checkpoint whose config names only EOS: the end token's id may
    differ), `length` where it holds none."""
    body = list(completion.token_ids)
    if completion.finish_reason == "stop":
        assert body[:-1] == ref[:len(body) - 1] and ref[len(body) - 1] in ENDS, (name, body, ref)
    else:
        assert completion.finish_reason == "length" and body == ref and not any(t in ENDS for t in ref), name


def test_engine_equals_drop_in(llada, dream):
    """The engine's tokens are the drop-in call's (one prompt at a time, as the engine decodes each
    request alone), for a method on LLaDA and Dream's sampler and block decoder; finish reasons
    follow the end token."""
    model, tok = llada
    dmodel, dtok, dpath = dream
    schema = SCHEMAS["flat"]
    llm = remask.LLM(model, tok)
    dllm = remask.LLM(dpath)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for decoder in (remask.FreeDave(), remask.ThresholdDecoding(threshold=0.7), remask.WINO(),
                        remask.MultiBlock(early_stop=True)):
            params = remask.SamplingParams(max_tokens=32, block_length=8, decoder=decoder,
                                           structured_outputs=S(json=schema))
            for text, c in zip(PROMPTS, _engine_rows(llm, PROMPTS, params)):
                prompt = torch.tensor([encode_chat(text)])
                ref = remask.generate(model, prompt, gen_length=32, block_length=8, decoder=decoder,
                                      structured_outputs=S(json=schema))[0, prompt.shape[1]:].tolist()
                same_tokens(c, ref, type(decoder).__name__)
        for kw in (dict(alg="entropy", steps=16), dict(alg="confidence_threshold", steps=32, threshold=0.6,
                                                        block_length=8, use_cache="dual")):
            params = remask.SamplingParams(max_tokens=32, structured_outputs=S(json=schema), **kw)
            for text, c in zip(PROMPTS, _engine_rows(dllm, PROMPTS, params)):
                prompt = torch.tensor([encode_chat(text)])
                ref = remask.diffusion_generate(dmodel, prompt, max_new_tokens=32, structured_outputs=S(json=schema),
                                                tokenizer=dtok, **kw)[0, prompt.shape[1]:].tolist()
                same_tokens(c, ref, kw)
                if c.finish_reason == "stop":
                    jsonschema.validate(__import__("json").loads(c.text), schema)


def test_wino_revocations_roll_the_matcher_back(llada):
    """WINO's narrow-out remasks positions the matcher consumed: the matcher rolls back, and every
    output stays valid."""
    from remask.diffusion.methods.decoders import run_decoder
    from remask.diffusion.parts.constrain_loops import structure_for_call

    model, tok = llada
    prompt, mask = batch(PROMPTS)
    params = S(json=SCHEMAS["array_of_objects"])
    structure = structure_for_call(params, model, tok, MASK_ID, 32)
    seen = []
    import remask.diffusion.parts.constrain as constrain

    real = constrain.CommitFilter.filter

    def spy(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        seen.append(self.rolled_back)
        return out

    constrain.CommitFilter.filter = spy
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = run_decoder(model, prompt, mask, remask.WINO(threshold=0.3, threshold_back=0.95), gen_length=32,
                              block_length=16, use_cache=None, mask_id=None, stats=None, structure=structure)
    finally:
        constrain.CommitFilter.filter = real
    counts = [0, 0]
    check_rows(out[:, prompt.shape[1]:].tolist(), params, tok, "wino", counts)
    print(f"\n[structured] wino rollbacks: {sum(seen)}")


def _seeded(kw: dict) -> dict:
    """`kw` with a fresh generator of the same seed (each call draws the same randoms)."""
    kw = dict(kw)
    if "generator" in kw:
        kw["generator"] = torch.Generator().manual_seed(kw["generator"].initial_seed())
    return kw


CACHE_METHODS = {
    "dkv decode": dict(use_cache=remask.DKVCache(cache_reloading_step=2), steps=16, block_length=8),
    "dkv decode random": dict(use_cache=remask.DKVCache(cache_reloading_step=4), steps=32, block_length=8,
                              remasking="random", generator=torch.Generator().manual_seed(3)),
    "dkv greedy window": dict(use_cache=remask.DKVCache(variant="greedy", cache_reloading_step=2, window_size=2),
                              steps=16, block_length=8, remasking="random", generator=torch.Generator().manual_seed(5)),
    "d2cache": dict(use_cache=remask.D2Cache(current_k=4), steps=16, block_length=8),
    "d2cache one block": dict(use_cache=remask.D2Cache(inflate_w=0), steps=32, block_length=32),
    "elastic": dict(use_cache=remask.ElasticCache(window_length=8), block_length=32),
    "elastic top-k all masked": dict(use_cache=remask.ElasticCache(threshold=None, tokens_per_iter=2,
                                                                   block_caching=False, gamma=0.99), block_length=32),
    "elastic + dinfer threshold": dict(use_cache=remask.ElasticCache(),
                                       decoder=remask.ThresholdDecoding(threshold=0.7), block_length=32),
    "elastic + dinfer hierarchical": dict(use_cache=remask.ElasticCache(window_length=8),
                                          decoder=remask.HierarchicalDecoding(threshold=0.7, low_threshold=0.4),
                                          block_length=32),
}


@pytest.mark.parametrize("method", list(CACHE_METHODS))
def test_llada_cache_methods(llada, method):
    """dKV-Cache, d2Cache and Elastic-Cache: mask the frontier, the method's own rule, filter."""
    model, tok = llada
    counts = [0, 0]
    prompt, mask = batch(PROMPTS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for params in cases_for(CACHE_METHODS, method):
            out = remask.generate(model, prompt, mask, gen_length=32, structured_outputs=params,
                                  **_seeded(CACHE_METHODS[method]))
            check_rows(out[:, prompt.shape[1]:].tolist(), params, tok, method, counts)
    tally(f"llada {method}", *counts)


def test_d2cache_coupled_rows(llada):
    """d2Cache's upstream batch (`independent_rows=False`: rows coupled by the top-up) under a structure."""
    from remask.diffusion.methods.d2cache import d2cache_steps
    from remask.diffusion.parts.constrain_loops import structure_for_call
    from remask.diffusion.parts.stepper import drive

    model, tok = llada
    counts = [0, 0]
    prompt, mask = batch(PROMPTS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for params in CASES:
            structure = structure_for_call(params, model, tok, MASK_ID, 32)
            out = drive(d2cache_steps(get_spec(model), prompt, config=remask.D2Cache(current_k=4), steps=16,
                                      gen_length=32, block_length=8, independent_rows=False, attention_mask=mask,
                                      structure=structure), model)
            check_rows(out[:, prompt.shape[1]:].tolist(), params, tok, "d2cache coupled", counts)
    tally("llada d2cache coupled rows", *counts)


def test_dkv_greedy_rows_part_and_join(llada, monkeypatch):
    """dKV-Cache-Greedy under a structure: rows whose forwarded counts part (the filter's commits) run one by one,
    each with its own cache, and are batched again, their caches joined, once the counts agree before the next
    reload; the tokens are those of rows kept apart."""
    from remask.diffusion.methods import dkv

    model, tok = llada
    prompt, mask = batch(PROMPTS)
    kw = dict(gen_length=32, steps=16, block_length=8, remasking="random", structured_outputs=CASES[0],
              use_cache=remask.DKVCache(variant="greedy", cache_reloading_step=8, window_size=2))
    joined, join = [], dkv._joined

    def counted(parts):
        joined.append(len(parts))
        return join(parts)

    monkeypatch.setattr(dkv, "_joined", counted)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = remask.generate(model, prompt, mask, generator=torch.Generator().manual_seed(5), **kw)
        assert max(joined) == 2   # the two rows' caches joined at least once
        regroup = dkv._regroup
        monkeypatch.setattr(dkv, "_regroup", lambda *args: regroup(*args[:6]))   # rows never joined again
        apart = remask.generate(model, prompt, mask, generator=torch.Generator().manual_seed(5), **kw)
    assert out.tolist() == apart.tolist()
    check_rows(out[:, prompt.shape[1]:].tolist(), CASES[0], tok, "dkv greedy part and join", [0, 0])


DKV_DREAM = {
    "decoded un entropy": dict(config=remask.DKVCache(cache_type="decoded", cache_reloading_step=4), alg="entropy",
                               steps=16),
    "decoded right maskgit_plus": dict(config=remask.DKVCache(cache_type="decoded", shift_type="right",
                                                              cache_reloading_step=4), alg="maskgit_plus", steps=16),
    "decoded un_right topk_margin": dict(config=remask.DKVCache(cache_type="decoded", shift_type="un_right"),
                                         alg="topk_margin", steps=8),
    "prefill origin": dict(config=remask.DKVCache(cache_type="prefill"), alg="origin", steps=16,
                           generator=torch.Generator().manual_seed(0)),
}


@pytest.mark.parametrize("method", list(DKV_DREAM))
def test_dkv_dream(dream, method):
    """Dream's dKV-Cache: Dream's own commit (mask, its alg, filter) under the delayed cache."""
    from remask.diffusion.methods.dkv import dkv_dream_generate

    model, tok, _ = dream
    counts = [0, 0]
    prompt, mask = batch(PROMPTS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for params in CASES:
            out = dkv_dream_generate(model, prompt, mask, max_new_tokens=32, structured_outputs=params, tokenizer=tok,
                                     **_seeded(DKV_DREAM[method]))
            check_rows(out[:, prompt.shape[1]:].tolist(), params, tok, method, counts)
    tally(f"dream dkv {method}", *counts)


def test_cache_methods_engine_equals_drop_in(llada):
    """The engine's tokens are the drop-in call's for dKV-Cache, d2Cache and Elastic-Cache (its own
    rule and a dInfer rule) under a structure (one prompt at a time, as the engine decodes each
    request alone)."""
    model, tok = llada
    schema = SCHEMAS["flat"]
    llm = remask.LLM(model, tok)
    methods = {
        "dkv": (dict(use_cache=remask.DKVCache(cache_reloading_step=2), steps=16, block_length=8),) * 2,
        "d2cache": (dict(use_cache=remask.D2Cache(current_k=4), steps=16, block_length=8),) * 2,
        "elastic": (dict(use_cache=remask.ElasticCache(window_length=8)),
                    dict(use_cache=remask.ElasticCache(window_length=8), block_length=32)),
        "elastic + threshold": (dict(use_cache=remask.ElasticCache(), decoder=remask.ThresholdDecoding(threshold=0.7)),
                                dict(use_cache=remask.ElasticCache(), decoder=remask.ThresholdDecoding(threshold=0.7),
                                     block_length=32)),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, (engine_kw, drop_in_kw) in methods.items():
            params = remask.SamplingParams(max_tokens=32, structured_outputs=S(json=schema), **engine_kw)
            for text, c in zip(PROMPTS, _engine_rows(llm, PROMPTS, params)):
                prompt = torch.tensor([encode_chat(text)])
                ref = remask.generate(model, prompt, gen_length=32, structured_outputs=S(json=schema),
                                      **drop_in_kw)[0, prompt.shape[1]:].tolist()
                same_tokens(c, ref, name)
                if c.finish_reason == "stop":
                    jsonschema.validate(__import__("json").loads(c.text), schema)

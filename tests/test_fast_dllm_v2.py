"""Fast-dLLM v2: remask's model loads official-format checkpoints without remote code, and
`remask.compat.fast_dllm_v2.batch_sample` / `generate` reproduce the official functions token for
token (fixtures made by running NVlabs' generation_functions.py and the HF repo's modeling.py, see
tests/fixtures/fast_dllm_v2_reference.json and /work/refrun/fast_dllm_v2/), with the documented
departures where upstream mixes the rows of a batch or drops a one-block prompt."""
from __future__ import annotations

import json
import os
import types

import pytest
import torch
from transformers import AutoModelForCausalLM

import remask
from remask.compat.fast_dllm_v2 import batch_sample, generate
from remask.models import get_spec, tiny
from helpers import margin_case

MASK, STOP, PAD = 299, 298, 297
FIXTURE = json.load(open(os.path.join(os.path.dirname(__file__), "fixtures", "fast_dllm_v2_reference.json")))
TOKENIZER = types.SimpleNamespace(pad_token_id=PAD)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for name, entry in FIXTURE["checkpoints"].items():
        path = str(tmp_path_factory.mktemp(name))
        assert tiny.write_tiny_fast_dllm_v2(path, **entry["kwargs"]) == entry["digest"], "tiny weights changed"
        out[name] = AutoModelForCausalLM.from_pretrained(path).eval()
    return out


def run_case(model, case, faithful=False):
    kw = dict(case["kwargs"])
    torch.manual_seed(case["seed"])
    if case["fn"] == "generate":
        return generate(model, torch.tensor(case["prompts"]), prefill_whole_block_prompt=not faithful, **kw).tolist()
    prompts = case["prompts"]
    width = max(map(len, prompts))
    x = torch.tensor([p + [MASK] * (width - len(p)) for p in prompts])
    tok = types.SimpleNamespace(pad_token_id=kw.pop("pad_token_id"))
    res = batch_sample(model, x, tok, min_len=min(map(len, prompts)), seq_len=torch.tensor([len(p) for p in prompts]),
                       prefill_whole_block_prompt=not faithful, **kw)
    return {str(k): v.tolist() for k, v in res.items()}, [int(k) for k in res]


def test_loads_without_remote_code_with_the_official_names(models):
    model = models["fd"]
    assert type(model).__name__ == "FastDLLMV2ForCausalLM"
    assert {"model.layers.0.self_attn.q_proj.bias", "model.layers.1.mlp.down_proj.weight", "lm_head.weight",
            "model.embed_tokens.weight", "model.norm.weight"} <= set(model.state_dict())
    assert (model.config.model_type, model.config.bd_size, model.config.conplemenrary_mask) == ("Fast_dLLM_Qwen", 8, True)
    spec = get_spec(model)
    assert (spec.kind, spec.mask_id, spec.attention, spec.block_length, spec.logit_shift) == (
        "fast_dllm_v2", MASK, "block-causal", 8, True)


REPRODUCED = [c for c in FIXTURE["cases"] if c.get("reproduced_by")]


@pytest.mark.parametrize("case", REPRODUCED, ids=[c["name"] for c in REPRODUCED])
def test_reproduces_the_official_code_token_for_token(models, case):
    margin_case("fast_dllm_v2_reference.json", case)
    got = run_case(models[case["ckpt"]], case, faithful=case["reproduced_by"] == ["faithful"])
    if case["fn"] == "generate":
        assert got == case["official"]
    else:
        assert got == (case["official"], case["official_order"])


def test_where_upstream_departs_remask_is_clean(models):
    """Cases upstream crashes on (sampling a batch) or mixes rows in: remask returns the prompt
    unchanged, no mask token, and every row as it decodes alone."""
    odd = [c for c in FIXTURE["cases"] if not c.get("reproduced_by")]
    assert odd and any("official_error" in c for c in odd)
    for case in odd:
        outputs, _ = run_case(models[case["ckpt"]], case)
        for b, prompt in enumerate(case["prompts"]):
            row = outputs[str(b)]
            assert row[:len(prompt)] == prompt and MASK not in row
            alone, _ = run_case(models[case["ckpt"]], {**case, "prompts": [prompt]})
            assert row[:len(alone["0"])] == alone["0"]


def test_block_cache_agrees_with_uncached_where_upstream_does(models):
    by_name = {c["name"]: c for c in FIXTURE["cases"]}
    pairs = [(c, by_name[c["name"][:-1] + "1"]) for c in FIXTURE["cases"]
             if c["name"].endswith("_c0") and c["fn"] == "generate" and c.get("official")]
    equal = [(a, b) for a, b in pairs if a["official"] == b["official"]]
    assert len(equal) >= 5
    for a, b in equal[:6]:
        assert run_case(models[a["ckpt"]], a) == run_case(models[b["ckpt"]], b)


def test_batch_rows_do_not_depend_on_batch_mates(models):
    prompts = [[5, 17, 42], [5, 17, 42, 100, 7, 250, 31, 64, 9, 11, 12, 13, 14], [5, 17, 42, 100, 7, 250, 31, 64]]
    for cache in (False, True):
        case = {"fn": "batch_sample", "seed": 0, "prompts": prompts, "kwargs": dict(
            block_size=8, small_block_size=4, max_new_tokens=16, threshold=0.9, stop_token=STOP, mask_id=MASK,
            use_block_cache=cache, pad_token_id=PAD)}
        together, _ = run_case(models["fd"], case)
        for b, prompt in enumerate(prompts):
            alone, _ = run_case(models["fd"], {**case, "prompts": [prompt]})
            assert together[str(b)][:len(alone["0"])] == alone["0"]   # upstream's shared budget may add blocks
            assert MASK not in together[str(b)]


def test_one_block_prompt_is_in_context_by_default(models):
    """Upstream never caches a prompt of exactly one block (its answer ignores the prompt);
    remask prefills it unless prefill_whole_block_prompt=False."""
    x = torch.tensor([[5, 17, 42, 100, 7, 250, 31, 64]])
    kw = dict(max_new_tokens=16, block_size=8, small_block_size=4, threshold=0.9, mask_id=MASK, stop_token=STOP)
    faithful = generate(models["fd"], x, prefill_whole_block_prompt=False, **kw)
    other_prompt = generate(models["fd"], torch.tensor([[9, 9, 9, 9, 9, 9, 9, 9]]), prefill_whole_block_prompt=False,
                            **kw)
    assert faithful[0, 8:].tolist() == other_prompt[0, 8:].tolist()   # upstream: the prompt is not seen
    assert generate(models["fd"], x, **kw)[0, 8:].tolist() != faithful[0, 8:].tolist()


def test_patch_makes_generate_the_compat_entry_point(models):
    model = remask.patch(models["fd_s1"])
    x = torch.tensor([[5, 17, 42]])
    kw = dict(max_new_tokens=8, block_size=4, small_block_size=2, threshold=0.9, mask_id=MASK, stop_token=STOP)
    assert torch.equal(model.generate(x, **kw), generate(model, x, **kw))
    out = model.generate(x, return_dict_in_generate=True, **kw)
    assert torch.equal(out.sequences, generate(model, x, **kw))


@pytest.mark.parametrize("kw, name", [
    (dict(small_block_size=3), "small_block_size"), (dict(block_size=0), "block_size"),
    (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(use_block_cache=1), "use_block_cache"),
    (dict(threshold="high"), "threshold"), (dict(max_new_tokens=-1), "max_new_tokens"), (dict(mask_id=-2), "mask_id"),
])
def test_bad_arguments_name_the_parameter(models, kw, name):
    args = dict(max_new_tokens=8, block_size=8, small_block_size=4, mask_id=MASK, stop_token=STOP)
    args.update(kw)
    with pytest.raises(ValueError, match=name):
        generate(models["fd"], torch.tensor([[5, 17, 42]]), **args)


def test_batch_sample_checks_its_lengths(models):
    x = torch.tensor([[5, 17, 42, MASK], [5, 17, 42, 8]])
    with pytest.raises(ValueError, match="min_len"):
        batch_sample(models["fd"], x, TOKENIZER, 8, 8, 4, min_len=4, seq_len=torch.tensor([3, 4]), mask_id=MASK)
    with pytest.raises(ValueError, match="seq_len"):
        batch_sample(models["fd"], x, TOKENIZER, 8, 8, 4, min_len=3, seq_len=torch.tensor([3, 9]), mask_id=MASK)
    with pytest.raises(ValueError, match="mask id"):
        generate(models["fd"], torch.tensor([[5, MASK]]), max_new_tokens=8, block_size=8, mask_id=MASK)


@pytest.mark.parametrize("settings", [
    dict(params=dict(temperature=0.0, threshold=0.7), fast=dict(small_block_size=4)),
    dict(params=dict(temperature=0.8, top_p=0.9, threshold=0.9), fast=dict(small_block_size=2)),
    dict(params=dict(temperature=0.0), fast=dict(small_block_size=4, use_block_cache=True)),
])
def test_engine_requests_equal_generate_alone(models, settings):
    """`remask.LLM` serves Fast-dLLM v2: each request equals the official `generate` on it alone
    (`max_new_tokens` = max_tokens rounded up to whole blocks) with its seed, whatever arrives with it;
    without the sub-block cache, requests at different blocks share their whole-block forwards."""
    model = models["fd"]
    fast = settings["fast"]
    params = remask.SamplingParams(max_tokens=14, seed=5, decoder=remask.FastDLLMV2Decoding(**fast), **settings["params"])
    prompts = [[5, 17, 42, 99, 7, 8, 1, 2, 3, 4], [9, 8, 7], [11, 12, 13, 14, 15, 16, 17, 18]]
    engine = remask.LLM(model).engine
    outputs = {}
    for i, prompt in enumerate(prompts):   # staggered arrivals
        engine.add_request(str(i), prompt, params)
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    p = settings["params"]
    nfe = 0
    for i, prompt in enumerate(prompts):
        expected = generate(model, torch.tensor([prompt]), max_new_tokens=16, mask_id=MASK, stop_token=STOP,
                            block_size=8, threshold=p.get("threshold", 0.9), temperature=p["temperature"],
                            top_p=p.get("top_p", 0.95), generator=torch.Generator().manual_seed(5), **fast)
        got = outputs[str(i)].outputs[0]
        assert got.all_token_ids == expected[0, len(prompt):].tolist(), i
        assert MASK not in got.all_token_ids
        nfe += got.nfe
    if not fast.get("use_block_cache"):   # whole-block forwards of requests at different blocks were shared
        assert engine.runner.forwards < nfe
    with pytest.raises(ValueError, match="fast_dllm_v2.*block"):
        remask.SamplingParams(decoder={"name": "fast_dllm_v2", "block": 3})
    with pytest.raises(ValueError, match="top_k"):
        remask.LLM(model).generate([[1, 5]], remask.SamplingParams(top_k=3), use_tqdm=False)


@pytest.mark.parametrize("kwargs", [
    dict(temperature=0.0, threshold=0.9, small_block_size=8),
    dict(temperature=0.0, threshold=0.5, small_block_size=4),
    dict(temperature=0.9, top_p=0.9, threshold=0.9, small_block_size=8),
])
def test_cached_decoding_equals_uncached(models, kwargs):
    """The prefix cache is exact: without any cache (every forward covers the sequence up to the
    current block) the tokens are the same, with the released block size 32 (upstream's denoising
    forwards always build their mask with 32, so other block sizes differ between the two by design)."""
    model = models["fd"]
    for prompt in ([5, 17, 42, 99, 7, 8], list(range(3, 35)), list(range(40, 77))):
        runs = [generate(model, torch.tensor([prompt]), max_new_tokens=64, mask_id=MASK, stop_token=STOP,
                         block_size=32, generator=torch.Generator().manual_seed(3), use_cache=use_cache, **kwargs)
                for use_cache in (True, False)]
        assert runs[0].tolist() == runs[1].tolist()
        assert MASK not in runs[0].tolist()[0]
    with pytest.raises(ValueError, match="use_cache"):
        generate(model, torch.tensor([[5, 6]]), max_new_tokens=32, mask_id=MASK, block_size=32, use_cache=False,
                 use_block_cache=True)

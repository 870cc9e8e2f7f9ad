"""LLaDA2.0 / 2.1 (`llada2_moe`): remask's model loads official-format checkpoints without remote
code and gives the official logits; `remask.compat.llada2.generate` reproduces the official LLaDA2.0
`generate` and LLaDA2.1's editing loop token for token (fixtures made by running inclusionAI's code
outside the repository: tests/fixtures/llada2_reference.json), cached and uncached alike."""
from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.cache_utils import DynamicCache

import remask
from remask.compat.llada2 import generate
from remask.models import get_spec, tiny
from helpers import margin_case

FIXTURE = json.load(open(os.path.join(os.path.dirname(__file__), "fixtures", "llada2_reference.json")))
CASES = [c for c in FIXTURE["cases"] if c["mode"] != "logits"]
MASK, EOS = 299, 298


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("llada2")
    digest = tiny.write_tiny_llada2(str(path), **FIXTURE["meta"]["checkpoint"]["kwargs"])
    assert digest == FIXTURE["meta"]["checkpoint"]["digest"], "the tiny writer changed; remake the fixtures"
    return AutoModelForCausalLM.from_pretrained(str(path)).eval()


def test_loads_without_remote_code_with_the_official_names(model):
    assert type(model).__name__ == "LLaDA2MoeModelLM"
    names = set(model.state_dict())
    assert {"model.word_embeddings.weight", "model.layers.0.attention.query_key_value.weight",
            "model.layers.0.attention.query_layernorm.weight", "model.layers.0.mlp.gate_proj.weight",
            "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.expert_bias",
            "model.layers.1.mlp.experts.7.down_proj.weight", "model.layers.2.mlp.shared_experts.up_proj.weight",
            "model.norm.weight", "lm_head.weight"} <= names
    spec = get_spec(model)
    assert (spec.kind, spec.mask_id, spec.eos_id, spec.attention, spec.block_length) == (
        "llada2", MASK, EOS, "block-causal", 32)


@pytest.mark.parametrize("name", ["logits_full", "logits_block"])
def test_logits_top5_equal_the_official_model(model, name):
    case = next(c for c in FIXTURE["cases"] if c["name"] == name)
    margin_case("llada2_reference.json", case)
    ids = torch.tensor([case["prompt"]])
    kwargs = {}
    if case["kwargs"].get("block_length"):
        L, n = case["kwargs"]["block_length"], ids.shape[1]
        nb = (n + L - 1) // L
        blocks = torch.tril(torch.ones(nb, nb)).repeat_interleave(L, 0).repeat_interleave(L, 1)[:n, :n]
        kwargs["attention_mask"] = torch.where(blocks.bool(), 0.0, float("-inf")).to(torch.bfloat16)[None, None]
    with torch.no_grad():
        logits = model(ids, **kwargs).logits
    assert logits.dtype == torch.float32
    assert logits.topk(5, dim=-1).indices[0].tolist() == case["top5"]


def test_mask_forms_and_store_kv_convention(model):
    """Additive, 0/1 and bool block masks agree; prefill + a cached block (store_kv=False leaves the
    cache alone) equals one forward of the whole sequence under the block-causal mask."""
    torch.manual_seed(0)
    x = torch.randint(0, 290, (1, 12))
    blocks = torch.tril(torch.ones(3, 3)).repeat_interleave(4, 0).repeat_interleave(4, 1)[None, None]
    with torch.no_grad():
        full = model(x, attention_mask=blocks).logits
        torch.testing.assert_close(model(x, attention_mask=blocks.bool()).logits, full)
        torch.testing.assert_close(model(x, attention_mask=torch.where(blocks.bool(), 0.0, float("-inf"))).logits, full)
        cache = DynamicCache()
        model(x[:, :8], attention_mask=blocks[:, :, :8, :8], past_key_values=cache, use_cache=True, store_kv=True)
        last = model(x[:, 8:], position_ids=torch.arange(8, 12)[None], past_key_values=cache, use_cache=True,
                     store_kv=False).logits
        assert cache.get_seq_length() == 8
    torch.testing.assert_close(last, full[:, 8:], atol=1e-5, rtol=1e-5)


def _kwargs(case):
    kwargs = dict(case["kwargs"])
    if case["mode"] == "generate21":
        kwargs.setdefault("editing_threshold", 0.9)   # 2.1's default; remask's None means 2.0's loop
    return kwargs


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_reproduces_the_official_decoders(model, case, use_cache):
    margin_case("llada2_reference.json", case)
    torch.manual_seed(case["seed"])
    out = generate(model, torch.tensor([case["prompt"]]), use_cache=use_cache, **_kwargs(case))[0].tolist()
    expected = case["output_ids"]
    if case["name"] == "g20_eos_early_short":
        # upstream's in-block EOS stop returns the prompt too (every other exit returns the
        # continuation); remask returns the continuation there as well
        assert expected[:len(case["prompt"])] == case["prompt"]
        expected = expected[len(case["prompt"]):]
    assert out == expected
    assert MASK not in out


def test_patch_routes_generate_and_keeps_outputs_mask_free(model):
    remask.patch(model)
    prompt = torch.tensor([[1, 5, 9, 200, 33]])
    out = model.generate(inputs=prompt, gen_length=16, block_length=8, steps=8, eos_id=EOS, mask_id=MASK)
    torch.manual_seed(0)
    assert out.tolist() == generate(model, prompt, gen_length=16, block_length=8, steps=8).tolist()
    assert prompt.tolist() == [[1, 5, 9, 200, 33]]
    for seed in range(3):   # sampling, editing, tiny steps: never a mask token
        torch.manual_seed(seed)
        out = generate(model, prompt, gen_length=12, block_length=4, steps=1, temperature=1.5,
                       editing_threshold=0.0 if seed else None, max_post_steps=2)
        assert MASK not in out[0].tolist() and 1 <= out.shape[1] <= 12


def test_own_generator_is_reproducible(model):
    prompt = torch.tensor([[4, 8, 15, 16]])
    runs = [generate(model, prompt, gen_length=8, block_length=4, steps=4, temperature=1.0, reference_rng=False,
                     generator=torch.Generator().manual_seed(7)) for _ in range(2)]
    assert runs[0].tolist() == runs[1].tolist()


@pytest.mark.parametrize("kwargs, name", [
    ({"steps": 0}, "steps"), ({"block_length": 0}, "block_length"), ({"gen_length": 0}, "gen_length"),
    ({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_k": -1}, "top_k"),
    ({"minimal_topk": 0}, "minimal_topk"), ({"minimal_topk": 99}, "minimal_topk"),
    ({"max_post_steps": -1}, "max_post_steps"), ({"num_to_transfer": 0}, "num_to_transfer"),
    ({"editing_threshold": "high"}, "editing_threshold"), ({"eos_early_stop": 1}, "eos_early_stop"),
    ({"generator": torch.Generator()}, "generator"), ({"inputs": torch.tensor([[1, 2], [3, 4]])}, "inputs"),
    ({"inputs": torch.tensor([[1, MASK]])}, "inputs"), ({"bogus": 1}, "bogus"),
])
def test_bad_arguments_name_the_parameter(model, kwargs, name):
    kwargs = {"inputs": torch.tensor([[1, 2, 3]]), "gen_length": 8, **kwargs}
    with pytest.raises(ValueError, match=name):
        generate(model, **kwargs)


@pytest.mark.parametrize("settings", [
    dict(params=dict(temperature=0.0, threshold=0.8), llada2=dict(block_length=8, steps=4)),
    dict(params=dict(temperature=0.7, top_k=20), llada2=dict(block_length=8, steps=8)),
    dict(params=dict(temperature=0.0, threshold=0.7), llada2=dict(block_length=8, editing_threshold=0.5,
                                                                  max_post_steps=2)),
])
def test_engine_serves_it_with_shared_forwards_and_batch_invariance(model, settings):
    """`remask.LLM` runs LLaDA2 with its finished blocks in the engine's pages: requests at different
    blocks share one forward per step (MoE layers row by row), pages go back at the end, and each
    request's tokens equal `remask.compat.llada2.generate` on it alone with the request's seed."""
    import remask

    llada2 = settings["llada2"]
    params = remask.SamplingParams(max_tokens=20, seed=4, decoder=remask.LLaDA2Decoding(**llada2), **settings["params"])
    prompts = [[5, 17, 42, 99, 7, 8, 1, 2, 3, 4], [9, 8, 7], [5, 17, 42, 99, 7, 8, 1, 2, 30, 40, 50, 60, 70]]
    llm = remask.LLM(model, page_size=4)
    engine = llm.engine
    outputs = {}
    for i, prompt in enumerate(prompts):   # staggered: requests run at different blocks
        engine.add_request(str(i), prompt, params)
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    nfe = 0
    for i, prompt in enumerate(prompts):
        kwargs = dict(gen_length=20, steps=llada2.get("steps", llada2["block_length"]),
                      threshold=settings["params"].get("threshold", 0.95),
                      **{k: v for k, v in llada2.items() if k != "steps"},
                      **{k: v for k, v in settings["params"].items() if k != "threshold"})
        expected = generate(model, torch.tensor([prompt]), reference_rng=False,
                            generator=torch.Generator().manual_seed(4), **kwargs)[0].tolist()
        got = outputs[str(i)].outputs[0]
        assert got.all_token_ids == expected, i
        assert MASK not in got.all_token_ids
        nfe += got.nfe
    assert engine.runner.forwards < nfe                 # forwards were shared
    stats = engine.kv_stats()
    assert stats["pages_in_use"] == 0 and stats["prefix_hits"] > 0   # the two prompts' first block
    with pytest.raises(ValueError, match="llada2.*stepz"):
        remask.SamplingParams(decoder={"name": "llada2", "stepz": 3})
    with pytest.raises(ValueError, match="decoder: LLaDA2Decoding"):
        remask.LLM("tiny-llada").generate([[1, 5]], remask.SamplingParams(decoder=remask.LLaDA2Decoding(steps=2)),
                                          use_tqdm=False)

"""SDAR: remask's model loads official-format checkpoints without remote code, caches the way the
official `store_kv` convention does, and `remask.compat.sdar.block_diffusion_generate` keeps the
official signature, with the documented fixes where upstream breaks its own output.

Token-for-token reproduction of the official code is in `tests/test_reference_fixtures.py`
(`sdar_*` cases, made by running JetAstra/SDAR's own generate.py and modeling_sdar.py)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.cache_utils import DynamicCache

import remask
from remask.compat.sdar import block_diffusion_generate
from remask.models import get_spec, tiny
from helpers import margin_case

MASK = 299
PROMPT = {"input_ids": torch.tensor([[5, 17, 42, 99, 7, 8]])}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("sdar")
    tiny.write_tiny_sdar(str(path), seed=0)
    return AutoModelForCausalLM.from_pretrained(str(path)).eval()


def test_loads_without_remote_code_with_the_official_names(model):
    assert type(model).__name__ == "SDARForCausalLM"
    names = set(model.state_dict())
    assert {"model.layers.0.self_attn.q_norm.weight", "model.layers.1.mlp.down_proj.weight", "lm_head.weight",
            "model.embed_tokens.weight", "model.norm.weight"} <= names
    spec = get_spec(model)
    assert (spec.kind, spec.mask_id, spec.attention, spec.block_length, spec.noise) == (
        "sdar", MASK, "block-causal", 4, "mask")


def test_store_kv_convention_and_block_causal_equivalence(model):
    """store_kv=False reads the cache without growing it; prefill + a cached block equals one
    forward of the whole sequence under the block-causal mask (the blocks' rows)."""
    torch.manual_seed(0)
    x = torch.randint(0, 290, (1, 12))
    blocks = torch.tril(torch.ones(3, 3)).repeat_interleave(4, 0).repeat_interleave(4, 1)[None]
    positions = torch.arange(12)[None]
    with torch.no_grad():
        full = model(x, attention_mask=blocks, position_ids=positions).logits
        cache = DynamicCache()
        model(x[:, :8], attention_mask=blocks[:, :8, :8], position_ids=positions[:, :8], past_key_values=cache,
              use_cache=True, store_kv=True)
        assert cache.get_seq_length() == 8
        last = model(x[:, 8:], attention_mask=blocks[:, 8:, :12], position_ids=positions[:, 8:],
                     past_key_values=cache, use_cache=True, store_kv=False).logits
        assert cache.get_seq_length() == 8
    torch.testing.assert_close(last, full[:, 8:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("strategy", ["sequential", "low_confidence_static", "low_confidence_dynamic",
                                      "entropy_bounded"])
def test_every_strategy_decodes_without_masks_and_keeps_the_prompt(model, strategy):
    for temperature in (0.0, 1.0):
        torch.manual_seed(1)
        x = block_diffusion_generate(model, PROMPT, MASK, gen_length=12, block_length=4, denoising_steps=4,
                                     temperature=temperature, remasking_strategy=strategy, eb_threshold=0.35)
        assert x.shape == (1, 20) and not bool((x == MASK).any())
        assert torch.equal(x[:, :6], PROMPT["input_ids"])
    torch.manual_seed(1)
    again = block_diffusion_generate(model, PROMPT, MASK, gen_length=12, block_length=4, denoising_steps=4,
                                     temperature=1.0, remasking_strategy=strategy, eb_threshold=0.35)
    assert torch.equal(x, again)   # seeded: the same draws


def test_a_short_schedule_never_overwrites_the_prompt(model):
    """Two steps of two for a first block holding three prompt tokens: upstream's top-k would take
    a prompt position; remask commits only the one mask."""
    prompt = {"input_ids": torch.tensor([[5, 17, 42, 99, 7, 8, 9]])}
    for strategy in ("low_confidence_static", "low_confidence_dynamic"):
        x = block_diffusion_generate(model, prompt, MASK, gen_length=5, block_length=4, denoising_steps=2,
                                     temperature=0.0, remasking_strategy=strategy)
        assert torch.equal(x[:, :7], prompt["input_ids"]) and not bool((x == MASK).any())


def test_a_stop_ends_decoding_and_fills_the_rest(model):
    free = block_diffusion_generate(model, PROMPT, MASK, gen_length=20, block_length=4, denoising_steps=4,
                                    temperature=0.0)
    stop = int(free[0, 9])   # a token of the second decoded block
    x = block_diffusion_generate(model, PROMPT, MASK, gen_length=20, block_length=4, denoising_steps=4,
                                 temperature=0.0, stopping_criteria_idx=[stop])
    first = int((x[0, 6:] == stop).nonzero()[0]) + 6
    end = (first // 4 + 1) * 4
    assert torch.equal(x[:, :end], free[:, :end]) and bool((x[0, end:] == stop).all())
    raw = block_diffusion_generate(model, PROMPT, MASK, gen_length=20, block_length=4, denoising_steps=4,
                                   temperature=0.0, stopping_criteria_idx=[stop], fill_after_stop=False)
    assert bool((raw[0, end:] == MASK).all())   # upstream's output: masks after the stop


def test_bad_arguments_name_the_parameter(model):
    with pytest.raises(ValueError, match="remasking_strategy"):
        block_diffusion_generate(model, PROMPT, MASK, remasking_strategy="nope")
    with pytest.raises(ValueError, match="batch"):
        block_diffusion_generate(model, {"input_ids": torch.ones(2, 3, dtype=torch.long)}, MASK)
    with pytest.raises(ValueError, match="eb_threshold"):
        block_diffusion_generate(model, PROMPT, MASK, remasking_strategy="entropy_bounded")
    with pytest.raises(ValueError, match="mask id"):
        block_diffusion_generate(model, {"input_ids": torch.tensor([[5, MASK]])}, MASK)
    with pytest.raises(ValueError, match="temperature"):
        block_diffusion_generate(model, PROMPT, MASK, temperature=-1.0)


def test_reproduces_the_official_generate_token_for_token(tmp_path):
    """Fixtures from JetAstra/SDAR's own generate.py and modeling_sdar.py (remote code, float32, CPU)
    on checkpoints written by `tiny.write_tiny_sdar`: seeded sampling (its multinomial draws), the
    three strategies, top-k / top-p, prompts shorter than, equal to and longer than a block, blocks
    of 4 and 8, short and long schedules. One case shows the fixed top-k fallback: upstream
    overwrote a committed position, remask differs there and nowhere else."""
    import json
    import pathlib

    fixtures = json.loads((pathlib.Path(__file__).parent / "fixtures" / "sdar_reference.json").read_text())
    models = {}
    for name, info in fixtures["meta"]["checkpoints"].items():
        folder = tmp_path / name
        assert tiny.write_tiny_sdar(str(folder), **info["kwargs"]) == info["digest"]   # the same weights
        models[name] = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    for case in fixtures["cases"]:
        margin_case("sdar_reference.json", case)
        torch.manual_seed(case["seed"])
        got = block_diffusion_generate(models[case["checkpoint"]], {"input_ids": torch.tensor([case["prompt"]])},
                                       **case["kwargs"])[0].tolist()
        differ = [i for i, (a, b) in enumerate(zip(got, case["output_ids"])) if a != b]
        assert len(got) == len(case["output_ids"])
        assert differ == case.get("departure", {}).get("positions", []), (case["name"], differ)


def test_entry_points_for_bidirectional_models_refuse_it(model):
    with pytest.raises(ValueError, match="block-causal"):
        remask.generate(model, PROMPT["input_ids"], steps=4, gen_length=4, block_length=4)


def test_engine_requests_equal_the_function_and_ignore_their_batch(model):
    """`remask.LLM` runs SDAR per request (its own forwards): a request with seed s decodes what
    `block_diffusion_generate` does with a generator seeded s; together, alone or reordered the
    tokens are the same; stop ids end a request after their block."""
    llm = remask.LLM(model)
    prompts = [[5, 17, 42, 99, 7, 8], [9, 8, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    params = remask.SamplingParams(max_tokens=10, seed=3, temperature=1.0, top_k=50,
                                   decoder=remask.SDARDecoding(denoising_steps=2,
                                                             remasking_strategy="low_confidence_dynamic",
                                                             confidence_threshold=0.6))
    together = llm.generate(prompts, params, use_tqdm=False)
    alone = [llm.generate([p], params, use_tqdm=False)[0] for p in reversed(prompts)][::-1]
    for prompt, a, b in zip(prompts, together, alone):
        assert a.outputs[0].all_token_ids == b.outputs[0].all_token_ids
        x = block_diffusion_generate(model, {"input_ids": torch.tensor([prompt])}, MASK, gen_length=10,
                                     block_length=4, denoising_steps=2, temperature=1.0, top_k=50,
                                     remasking_strategy="low_confidence_dynamic", confidence_threshold=0.6,
                                     stopping_criteria_idx=[298], generator=torch.Generator().manual_seed(3))
        assert a.outputs[0].all_token_ids == x[0, len(prompt):len(prompt) + 10].tolist()   # max_tokens caps it
        assert MASK not in a.outputs[0].all_token_ids
    greedy = llm.generate(prompts[:1], remask.SamplingParams(max_tokens=8, threshold=0.9), use_tqdm=False)[0]
    assert greedy.outputs[0].nfe > 0
    with pytest.raises(ValueError, match="steps"):
        llm.generate(prompts[:1], remask.SamplingParams(max_tokens=8, steps=4), use_tqdm=False)
    with pytest.raises(ValueError, match="decoder: SDARDecoding"):
        remask.LLM("tiny-llada").generate([[1, 5]], remask.SamplingParams(decoder=remask.SDARDecoding(denoising_steps=2)),
                                          use_tqdm=False)


def test_family_configs_are_the_one_method_config():
    """The family's settings are `decoder=`'s config (issue 44): the JSON form resolves through the registry, nested
    `rule` included; FreeDave or a dInfer rule alone is the shorthand for `SDARDecoding(rule=...)`; the config checks
    its own values naming them; on a model without SDAR's loop, and in the drop-in `remask.generate`, it is refused
    naming `decoder`."""
    from remask.diffusion.methods import registry
    from remask.diffusion.parts.blocks import family_config

    json_form = {"name": "sdar", "denoising_steps": 4, "rule": {"name": "freedave", "draft_steps": 2}}
    config = remask.SDARDecoding(denoising_steps=4, rule=remask.FreeDave(draft_steps=2))
    assert registry.from_json("decoder", json_form) == remask.SamplingParams(decoder=json_form).decoder == config
    assert family_config(remask.FreeDave(), remask.SDARDecoding) == remask.SDARDecoding(rule=remask.FreeDave())
    assert family_config(None, remask.SDARDecoding) == remask.SDARDecoding()
    with pytest.raises(ValueError, match="decoder must be remask.SDARDecoding"):
        family_config(remask.LLaDA2Decoding(), remask.SDARDecoding)
    with pytest.raises(ValueError, match="SDARDecoding.rule"):
        remask.SDARDecoding(rule=remask.WINO())
    with pytest.raises(ValueError, match="SDARDecoding.eb_threshold"):
        remask.SDARDecoding(eb_threshold=0)
    with pytest.raises(ValueError, match="decoder \\(sdar\\)"):
        remask.SamplingParams(decoder={"name": "sdar", "rule": {"name": "sdar"}})
    llada, _ = remask.load("tiny-llada")
    with pytest.raises(ValueError, match="decoder: SDARDecoding"):
        remask.generate(llada, torch.tensor([[1, 5]]), steps=4, gen_length=4, block_length=4,
                        decoder=remask.SDARDecoding())


def test_http_request_fields_reach_sampling_params():
    from remask.serve.protocol import CompletionRequest

    request = CompletionRequest(model="m", prompt=[1, 2], max_tokens=8, temperature=0.0,
                                decoder={"name": "sdar", "denoising_steps": 2, "remasking_strategy": "sequential"})
    assert request.sampling_params().decoder == remask.SDARDecoding(denoising_steps=2, remasking_strategy="sequential")
    with pytest.raises(ValueError, match="SDARDecoding.remasking_strategy"):
        CompletionRequest(model="m", prompt=[1], decoder={"name": "sdar", "remasking_strategy": "x"}).sampling_params()


@pytest.mark.parametrize("kwargs", [
    dict(temperature=0.0, remasking_strategy="low_confidence_dynamic", confidence_threshold=0.7),
    dict(temperature=0.0, remasking_strategy="low_confidence_static", denoising_steps=2),
    dict(temperature=1.0, top_k=40, remasking_strategy="sequential", seed=5),
    dict(temperature=0.8, remasking_strategy="low_confidence_dynamic", confidence_threshold=0.5, seed=7),
])
def test_cached_decoding_equals_uncached(model, kwargs):
    """The exact cache changes nothing: the prompt's blocks prefilled and each finished block stored
    once give the tokens of forwarding the whole sequence up to the current block at every step."""
    kwargs = dict(kwargs)
    seed = kwargs.pop("seed", 0)
    for prompt in ([5, 17, 42, 99, 7, 8], [9, 8, 7, 6], [3]):
        runs = [block_diffusion_generate(model, {"input_ids": torch.tensor([prompt])}, MASK, gen_length=13,
                                         block_length=4, generator=torch.Generator().manual_seed(seed),
                                         use_cache=use_cache, **kwargs)
                for use_cache in (True, False)]
        assert runs[0].tolist() == runs[1].tolist()
        assert MASK not in runs[0].tolist()[0]


def test_engine_block_cache_shares_forwards_pages_and_prefixes(model):
    """In the engine, finished blocks live in its page store (`remask.caches.BlockKVCache`):
    requests at different blocks share one forward per step (each row against its own cache),
    prompts with the same whole blocks share their pages (verified bitwise), pages go back when a
    request ends, and the tokens are those of `block_diffusion_generate` on each request alone."""
    common = [11, 12, 13, 14, 15, 16, 17, 18]
    prompts = [common + [21, 22], common + [31], common + [41, 42, 43, 44, 45], [7, 6, 5]]
    params = remask.SamplingParams(max_tokens=9, seed=2, temperature=0.9,
                                   decoder=remask.SDARDecoding(denoising_steps=2,
                                                             remasking_strategy="low_confidence_dynamic",
                                                             confidence_threshold=0.6))
    expected = [block_diffusion_generate(model, {"input_ids": torch.tensor([p])}, MASK, gen_length=9, block_length=4,
                                         denoising_steps=2, temperature=0.9, confidence_threshold=0.6,
                                         stopping_criteria_idx=[298], generator=torch.Generator().manual_seed(2)
                                         )[0, len(p):len(p) + 9].tolist() for p in prompts]   # max_tokens caps it
    for sharing in (True, False):
        llm = remask.LLM(model, page_size=4, enable_prefix_caching=sharing)
        engine = llm.engine
        outputs, nfe = {}, 0
        for i, prompt in enumerate(prompts):   # staggered arrivals: requests run at different blocks
            engine.add_request(str(i), prompt, params)
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out
        got = [outputs[str(i)].outputs[0].all_token_ids for i in range(len(prompts))]
        assert got == expected
        nfe = sum(outputs[str(i)].outputs[0].nfe for i in range(len(prompts)))
        assert engine.runner.forwards < nfe            # forwards were shared
        stats = engine.kv_stats()
        assert stats["pages_in_use"] == 0 and stats["peak_pages_in_use"] > 0
        assert (stats["prefix_hits"] > 0) == sharing   # the common 8 tokens: two pages of 4, found twice
    with pytest.raises(ValueError, match="kv_cache_pages"):
        remask.LLM(model, kv_cache_pages=1).generate([prompts[0]], params, use_tqdm=False)


def test_patch_attaches_the_official_entry_point(model):
    """`remask.patch(model)`: `model.generate` is the family's drop-in entry point (upstream's
    `block_diffusion_generate` without the model argument)."""
    import copy

    patched = remask.patch(copy.copy(model))
    kwargs = dict(gen_length=8, block_length=4, denoising_steps=4, temperature=0.0)
    assert patched.generate(PROMPT, MASK, **kwargs).tolist() == block_diffusion_generate(model, PROMPT, MASK,
                                                                                         **kwargs).tolist()


def test_sdar_moe_loads_and_its_sparse_block_is_qwen3_moe(tmp_path):
    """SDAR-MoE (`sdar_moe`): official names load without remote code; its sparse block computes
    transformers' own Qwen3-MoE block on the same weights; it decodes through the same loop, cached
    equal to uncached, and in the engine."""
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    tiny.write_tiny_sdar_moe(str(tmp_path), seed=3, mlp_only_layers=[1])
    moe = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert type(moe).__name__ == "SDARMoeForCausalLM"
    names = set(moe.state_dict())
    assert {"model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.5.down_proj.weight",
            "model.layers.1.mlp.gate_proj.weight"} <= names                # layer 1 is dense (mlp_only_layers)
    block = moe.model.layers[0].mlp
    ref = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=64, num_experts=6, num_experts_per_tok=2,
                                                moe_intermediate_size=32, norm_topk_prob=True))
    with torch.no_grad():
        ref.gate.weight.copy_(block.gate.weight)
        ref.experts.gate_up_proj.copy_(torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight])
                                                    for e in block.experts]))
        ref.experts.down_proj.copy_(torch.stack([e.down_proj.weight for e in block.experts]))
        h = torch.randn(2, 5, 64)
        torch.testing.assert_close(block(h), ref(h), atol=1e-6, rtol=1e-5)
    kwargs = dict(gen_length=9, block_length=4, denoising_steps=2, temperature=0.0,
                  remasking_strategy="low_confidence_static", stopping_criteria_idx=[298])
    cached = block_diffusion_generate(moe, PROMPT, MASK, **kwargs)
    assert cached.tolist() == block_diffusion_generate(moe, PROMPT, MASK, use_cache=False, **kwargs).tolist()
    out = remask.LLM(moe).generate([PROMPT["input_ids"][0].tolist()],
                                   remask.SamplingParams(max_tokens=9, temperature=0.0,
                                                         decoder=remask.SDARDecoding(
                                                             denoising_steps=2,
                                                             remasking_strategy="low_confidence_static")),
                                   use_tqdm=False)[0]
    assert out.outputs[0].all_token_ids == cached[0, 6:15].tolist()   # max_tokens caps it

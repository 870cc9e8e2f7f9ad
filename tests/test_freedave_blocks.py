"""FreeDave on block-causal models (SDAR, SDAR-MoE, LLaDA2.0, Fast-dLLM v2): `decoder=remask.FreeDave(...)` on the
family's drop-in loop gives the tokens of the same call without it — greedy, one token per step —
with fewer forwards, with and without the cache, in the engine with several requests at once, and
with the loop's threshold rule under ``match_rule="exact"`` (`diffusion/methods/freedave_blocks.py`)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import remask
from remask.compat.fast_dllm_v2 import generate as fast_dllm_v2_generate
from remask.compat.llada2 import generate as llada2_generate
from remask.compat.sdar import block_diffusion_generate
from remask.diffusion.parts.stats import GenerationStats
from remask.models import get_spec, tiny

PROMPTS = [torch.randint(0, 250, (1, n), generator=torch.Generator().manual_seed(n)) for n in (3, 6, 8)]


WRITERS = {"sdar": tiny.write_tiny_sdar, "sdar_moe": tiny.write_tiny_sdar_moe, "llada2": tiny.write_tiny_llada2,
           "fast_dllm_v2": tiny.write_tiny_fast_dllm_v2}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny random checkpoints of each family (official layouts), loaded on first use."""
    loaded = {}

    def get(name):
        if name not in loaded:
            path = tmp_path_factory.mktemp(name)
            WRITERS[name](str(path), seed=0)
            loaded[name] = AutoModelForCausalLM.from_pretrained(str(path)).eval()
        return loaded[name]
    return get


@pytest.fixture(scope="module")
def sdar(models):
    return models("sdar")


@pytest.fixture(scope="module")
def llada2(models):
    return models("llada2")


@pytest.fixture(scope="module")
def fast_dllm_v2(models):
    return models("fast_dllm_v2")


def _pair(run, **kw):
    """(tokens, nfe) without and with each FreeDave config `kw["decoders"]`."""
    decoders = kw.pop("decoders")
    base_stats = GenerationStats()
    base = run(stats=base_stats, **kw)
    out = []
    for decoder in decoders:
        stats = GenerationStats()
        out.append((run(stats=stats, decoder=decoder, **kw), stats.nfe))
    return base, base_stats.nfe, out


@pytest.mark.parametrize("which", ["sdar", "sdar_moe"])
@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("block_length", [4, 8])
def test_sdar_freedave_equals_one_token_per_step(models, which, use_cache, block_length):
    model = models(which)
    mask = get_spec(model).mask_id
    saved = total = 0
    for prompt in PROMPTS:
        for strategy, rule in (("low_confidence_static", "subset"), ("low_confidence_dynamic", "exact")):
            base, base_nfe, runs = _pair(
                lambda **kw: block_diffusion_generate(model, {"input_ids": prompt}, mask, **kw),
                gen_length=16, block_length=block_length, denoising_steps=block_length, temperature=0.0,
                remasking_strategy=strategy, confidence_threshold=0.5, use_cache=use_cache,
                decoders=[remask.FreeDave(draft_steps=k, match_rule=rule, draft_mode=mode)
                          for k, mode in ((2, "tree_attention"), (4, "batch_expanding"))])
            assert not bool((base == mask).any()) and torch.equal(base[:, :prompt.shape[1]], prompt)
            for tokens, nfe in runs:
                assert torch.equal(tokens, base), (prompt.shape, strategy)
                assert nfe <= base_nfe
                saved, total = saved + base_nfe - nfe, total + base_nfe
    assert saved > 0.1 * total   # verified chains longer than one token were accepted


@pytest.mark.parametrize("use_cache", [True, False])
def test_llada2_freedave_equals_one_token_per_step(llada2, use_cache):
    saved = total = 0
    for prompt in PROMPTS:
        for threshold, rule in ((1.0, "subset"), (0.6, "exact")):
            for block_length in (4, 8):
                base, base_nfe, runs = _pair(
                    lambda **kw: llada2_generate(llada2, prompt, **kw), gen_length=16, block_length=block_length,
                    steps=block_length, threshold=threshold, use_cache=use_cache,
                    decoders=[remask.FreeDave(draft_steps=k, match_rule=rule) for k in (2, 4)])
                for tokens, nfe in runs:
                    assert torch.equal(tokens, base), (prompt.shape, threshold, block_length)
                    assert nfe <= base_nfe
                    saved, total = saved + base_nfe - nfe, total + base_nfe
    assert saved > 0.1 * total


@pytest.mark.parametrize("use_cache", [True, False])
def test_fast_dllm_v2_freedave_equals_its_generate(fast_dllm_v2, use_cache):
    """Fast-dLLM v2's `generate` loop (sub-blocks, shifted logits, stop truncation) with a batch of
    three prompts (each row decoded alone): the same tokens, fewer forwards."""
    L = fast_dllm_v2.config.bd_size
    prompts = torch.cat([torch.cat([p[0], p.new_full((8 - p.shape[1],), 5)])[None] for p in PROMPTS])
    saved = total = 0
    for sub_block in (L // 2, L):
        for threshold, rule in ((1.0, "subset"), (0.6, "exact")):
            base, base_nfe, runs = _pair(
                lambda **kw: fast_dllm_v2_generate(fast_dllm_v2, prompts, **kw), max_new_tokens=24, block_size=L,
                small_block_size=sub_block, threshold=threshold, mask_id=299, stop_token=298, use_cache=use_cache,
                decoders=[remask.FreeDave(draft_steps=k, match_rule=rule) for k in (2, 4)])
            assert base.shape[0] == 3 and not bool((base == 299).any())
            for tokens, nfe in runs:
                assert torch.equal(tokens, base), (sub_block, threshold)
                assert nfe <= base_nfe
                saved, total = saved + base_nfe - nfe, total + base_nfe
    assert saved > 0.05 * total
    with pytest.raises(ValueError, match="use_block_cache"):
        fast_dllm_v2_generate(fast_dllm_v2, prompts, max_new_tokens=8, block_size=L, mask_id=299, stop_token=298,
                              use_block_cache=True, decoder=remask.FreeDave())


@pytest.mark.parametrize("early", [False, True])
def test_llada2_freedave_stops_at_eos_as_the_loop(llada2, early):
    """With an EOS id the model predicts, the loop stops after its block (or, with `eos_early_stop`,
    inside it) and cuts the output after the first EOS: FreeDave returns the same continuation."""
    prompt = PROMPTS[1]
    free = llada2_generate(llada2, prompt, gen_length=24, block_length=4, steps=4, threshold=1.0, eos_id=None)
    assert free.shape[1] == 24
    eos = int(free[0, 9])   # a token the model commits in its third block
    kw = dict(gen_length=24, block_length=4, steps=4, threshold=1.0, eos_id=eos, eos_early_stop=early)
    base, base_nfe, runs = _pair(lambda **k: llada2_generate(llada2, prompt, **k),
                                 decoders=[remask.FreeDave(draft_steps=4)], **kw)
    assert base.shape[1] < 24 and int(base[0, -1]) == eos
    assert torch.equal(runs[0][0], base)


def test_engine_requests_equal_the_loop_alone(sdar, llada2, fast_dllm_v2):
    """`remask.LLM` with `decoder=FreeDave`: several requests at once (each its own draft forwards,
    finished blocks in the engine's pages) give each request the loop's tokens for it alone."""
    prompts = [p[0].tolist() for p in PROMPTS]
    sdar_mask = get_spec(sdar).mask_id
    params = remask.SamplingParams(max_tokens=12, temperature=0.0, decoder={
        "name": "sdar", "block_length": 4, "rule": {"name": "freedave", "draft_steps": 3}})
    plain = remask.SamplingParams(max_tokens=12, temperature=0.0, decoder=remask.SDARDecoding(block_length=4))
    llm = remask.LLM(sdar)
    together = llm.generate(prompts, params, use_tqdm=False)
    baseline = llm.generate(prompts, plain, use_tqdm=False)
    for prompt, got, ref in zip(prompts, together, baseline):
        x = block_diffusion_generate(sdar, {"input_ids": torch.tensor([prompt])}, sdar_mask, gen_length=12,
                                     block_length=4, denoising_steps=4, temperature=0.0,
                                     remasking_strategy="low_confidence_static")
        answer = x[0, len(prompt):len(prompt) + 12].tolist()   # max_tokens caps the last block
        assert got.outputs[0].all_token_ids == ref.outputs[0].all_token_ids == answer
    assert sum(o.outputs[0].nfe for o in together) < sum(o.outputs[0].nfe for o in baseline)
    assert llm.engine.kv_stats()["pages_in_use"] == 0

    # FreeDave++ in the engine: the config's threshold is the loop's threshold rule
    plus = remask.SamplingParams(max_tokens=12, temperature=0.0, decoder=remask.SDARDecoding(
        block_length=4, rule=remask.FreeDave(confidence_threshold=0.6, match_rule="exact")))
    for prompt, got in zip(prompts, llm.generate(prompts, plus, use_tqdm=False)):
        x = block_diffusion_generate(sdar, {"input_ids": torch.tensor([prompt])}, sdar_mask, gen_length=12,
                                     block_length=4, denoising_steps=4, temperature=0.0,
                                     remasking_strategy="low_confidence_dynamic", confidence_threshold=0.6)
        assert got.outputs[0].all_token_ids == x[0, len(prompt):len(prompt) + 12].tolist()

    llm2 = remask.LLM(llada2)
    for fd, threshold in ((remask.FreeDave(), 1.0), (remask.FreeDave(confidence_threshold=0.6, match_rule="exact"),
                                                     0.6)):
        params2 = remask.SamplingParams(max_tokens=12, temperature=0.0,
                                        decoder=remask.LLaDA2Decoding(block_length=4, rule=fd))
        for prompt, got in zip(prompts, llm2.generate(prompts, params2, use_tqdm=False)):
            expected = llada2_generate(llada2, torch.tensor([prompt]), gen_length=12, block_length=4, steps=4,
                                       threshold=threshold)
            assert got.outputs[0].all_token_ids == expected[0].tolist()

    spec = get_spec(fast_dllm_v2)
    params3 = remask.SamplingParams(max_tokens=16, temperature=0.0, decoder=remask.FreeDave(draft_steps=3))
    for prompt, got in zip(prompts, remask.LLM(fast_dllm_v2).generate(prompts, params3, use_tqdm=False)):
        expected = fast_dllm_v2_generate(fast_dllm_v2, torch.tensor([prompt]), max_new_tokens=16,
                                         block_size=spec.block_length, threshold=1.0, mask_id=spec.mask_id,
                                         stop_token=spec.eos_id)
        assert got.outputs[0].all_token_ids == expected[0, len(prompt):].tolist()


def test_refusals_name_the_setting(sdar, llada2):
    mask = get_spec(sdar).mask_id
    prompt = {"input_ids": PROMPTS[0]}
    base = dict(gen_length=8, block_length=4, denoising_steps=4, temperature=0.0,
                remasking_strategy="low_confidence_static")
    fd = remask.FreeDave()
    for change, name in ((dict(temperature=1.0), "temperature"), (dict(denoising_steps=2), "denoising_steps"),
                         (dict(remasking_strategy="sequential"), "remasking_strategy")):
        with pytest.raises(ValueError, match=name):
            block_diffusion_generate(sdar, prompt, mask, decoder=fd, **{**base, **change})
    with pytest.raises(ValueError, match="confidence_threshold"):
        block_diffusion_generate(sdar, prompt, mask, decoder=remask.FreeDave(confidence_threshold=0.9), **base)
    with pytest.raises(ValueError, match="decoder"):
        block_diffusion_generate(sdar, prompt, mask, decoder="freedave", **base)
    with pytest.raises(ValueError, match="editing_threshold"):
        llada2_generate(llada2, PROMPTS[0], gen_length=8, block_length=4, steps=4, editing_threshold=0.5, decoder=fd)
    with pytest.raises(ValueError, match="steps"):
        llada2_generate(llada2, PROMPTS[0], gen_length=8, block_length=4, steps=2, decoder=fd)
    llm = remask.LLM(sdar)
    with pytest.raises(ValueError, match="decoder"):
        llm.generate([[1, 2, 3]], remask.SamplingParams(max_tokens=4, decoder=remask.WINO()),   # dInfer's rules:
                     use_tqdm=False)                                              # tests/test_rules_on_blocks.py
    with pytest.raises(ValueError, match="temperature"):
        remask.SamplingParams(max_tokens=4, temperature=0.5, decoder=fd)
    with pytest.raises(ValueError, match="SDARDecoding.remasking_strategy"):
        llm.generate([[1, 2, 3]], remask.SamplingParams(max_tokens=4, temperature=0.0, decoder=remask.SDARDecoding(
            remasking_strategy="sequential", rule=fd)), use_tqdm=False)
    with pytest.raises(ValueError, match="steps"):
        remask.LLM(llada2).generate([[1, 2, 3]], remask.SamplingParams(max_tokens=8, temperature=0.0, decoder=remask.
                                                                       LLaDA2Decoding(block_length=4, steps=2, rule=fd)),
                                    use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):   # the config form: the loop refuses what FreeDave does not read
        llm.generate([[1, 2, 3]], remask.SamplingParams(max_tokens=4, temperature=0.5, decoder=remask.SDARDecoding(
            rule=fd)), use_tqdm=False)
    # LLaDA's own FreeDave has its own rule: the block families' settings stay refused there
    with pytest.raises(ValueError, match="threshold"):
        remask.LLM("tiny-llada").generate([[1, 5]], remask.SamplingParams(max_tokens=4, temperature=0.0,
                                                                          threshold=0.9, decoder=fd), use_tqdm=False)


def test_draft_steps_past_the_block_is_refused_naming_it(sdar):
    """`draft_steps` acts as the block's masked positions at most (issue 37: no silent clamp): past
    the family's block it is refused, at the call and at add_request, naming it and the block; the
    block itself passes."""
    mask = get_spec(sdar).mask_id
    prompt = {"input_ids": PROMPTS[0]}
    base = dict(gen_length=8, block_length=8, denoising_steps=8, temperature=0.0,
                remasking_strategy="low_confidence_static")
    with pytest.raises(ValueError, match=r"decoder\.draft_steps must be <= 8 \(the block length\), got 9"):
        block_diffusion_generate(sdar, prompt, mask, decoder=remask.FreeDave(draft_steps=9), **base)
    block_diffusion_generate(sdar, prompt, mask, decoder=remask.FreeDave(draft_steps=8), **base)
    params = remask.SamplingParams(max_tokens=8, temperature=0.0, decoder={
        "name": "sdar", "block_length": 4, "rule": {"name": "freedave", "draft_steps": 10**9}})
    with pytest.raises(ValueError, match=r"decoder\.draft_steps must be <= 4 "):
        remask.LLM(sdar).generate([[1, 2, 3]], params, use_tqdm=False)

"""dInfer's commit rules on the block-causal families (`remask.diffusion.parts.rules`): `decoder=
ThresholdDecoding / HierarchicalDecoding / CreditDecoding` runs SDAR's and LLaDA2.0's own loop with
the rule choosing each step's commits — combinations no paper shipped. The rules are pure functions
over a block's scores; on the loops they decode to the end, keep the prompt, are deterministic and
batch invariant in the engine, equal between the drop-in functions and the engine, and every setting
a combination does not read is refused by name."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import remask
import remask.diffusion.parts.rules as rules_module
from remask.compat.llada2 import generate as llada2_generate
from remask.compat.sdar import block_diffusion_generate
from remask.diffusion.families.llada2 import LLaDA2Decoder as LLaDA2Rules
from remask.diffusion.parts.rules import rule_commit
from remask.diffusion.families.sdar import sdar_generate
from remask.diffusion.parts.stats import GenerationStats
from remask.diffusion.parts.stepper import step_alone
from remask.models import get_spec, tiny

PROMPTS = [torch.randint(0, 250, (1, n), generator=torch.Generator().manual_seed(n)) for n in (3, 6, 8)]
RULES = {"threshold": remask.ThresholdDecoding(threshold=0.05),
         "hierarchy": remask.HierarchicalDecoding(),
         "hierarchy_low": remask.HierarchicalDecoding(threshold=0.02, low_threshold=0.005),
         "credit": remask.CreditDecoding(threshold=0.05)}


@pytest.fixture(scope="module")
def sdar(tmp_path_factory):
    path = tmp_path_factory.mktemp("sdar")
    tiny.write_tiny_sdar(str(path), seed=0)
    return AutoModelForCausalLM.from_pretrained(str(path)).eval()


@pytest.fixture(scope="module")
def llada2(tmp_path_factory):
    path = tmp_path_factory.mktemp("llada2")
    tiny.write_tiny_llada2(str(path), seed=0)
    return AutoModelForCausalLM.from_pretrained(str(path)).eval()


# --- the rules as pure functions ----------------------------------------------------------------

@pytest.mark.parametrize("name", list(RULES))
def test_rules_are_pure_functions_of_a_blocks_scores(name):
    rule, mask = RULES[name], 9
    g = torch.Generator().manual_seed(0)
    block = torch.tensor([[1, mask, mask, 4, mask, mask, mask, 2]])
    logits = torch.randn(1, 8, 12, generator=g) * 2
    kept_block, kept_logits = block.clone(), logits.clone()
    credit = rule.new_state()
    commit, tokens = rule_commit(block, logits, mask, rule, credit)
    assert torch.equal(block, kept_block) and torch.equal(logits, kept_logits)   # nothing in place
    assert commit.dtype == torch.bool and commit.shape == block.shape
    assert bool(commit.any()) and not bool((commit & (block != mask)).any())       # ≥ 1, masked only
    assert torch.equal(tokens[~commit & (block != mask)], block[~commit & (block != mask)])
    assert not bool((tokens[commit] == mask).any())
    # every candidate predicts the mask token: the fallback still commits one, with another token
    stuck = logits.clone()
    stuck[..., mask] = 100.0
    commit, tokens = rule_commit(block, stuck, mask, rule, rule.new_state())
    assert int(commit.sum()) == 1 and int(tokens[commit]) != mask
    if name == "credit":
        with pytest.raises(ValueError, match="credit"):
            rule_commit(block, logits, mask, rule)


# --- (1) ThresholdDecoding on SDAR vs SDAR's own low_confidence_dynamic -------------------------

@pytest.mark.parametrize("threshold", [0.9, 0.1, 0.01])
@pytest.mark.parametrize("block_length", [4, 8])
def test_threshold_on_sdar_equals_low_confidence_dynamic_one_per_step(sdar, threshold, block_length):
    """The two definitions differ only at measure-zero edges: SDAR commits confidences strictly
    above τ when at least the schedule's n are (else the n best), dInfer those ≥ min(τ, best − 1e-5)
    in float32 and never a mask-token prediction. With n = 1 (`denoising_steps == block_length`) on a
    float32 model with no such edge, the tokens are the same."""
    mask = get_spec(sdar).mask_id
    for prompt in PROMPTS:
        own = sdar_generate(sdar, prompt, mask_id=mask, gen_length=16, block_length=block_length,
                            denoising_steps=block_length, temperature=0.0,
                            remasking_strategy="low_confidence_dynamic", confidence_threshold=threshold)
        ruled = sdar_generate(sdar, prompt, mask_id=mask, gen_length=16, block_length=block_length, temperature=0.0,
                              decoder=remask.ThresholdDecoding(threshold=threshold))
        assert torch.equal(own, ruled)


@pytest.mark.parametrize("threshold", [0.9, 0.05, 0.01])
def test_threshold_on_sdar_commits_above_the_threshold_or_the_best(sdar, monkeypatch, threshold):
    """The rule's property, step by step: ≥ 1 commit while the block has masks; every committed
    position had (float32) confidence ≥ τ, or none did and the commits are the best one (within 1e-5)."""
    mask = get_spec(sdar).mask_id
    seen = []

    def recording(block, logits, mask_id, rule, credit=None):
        commit, tokens = rule_commit(block, logits, mask_id, rule, credit)
        conf = torch.softmax(logits.float(), dim=-1).max(dim=-1).values
        masked = block == mask_id
        assert bool(commit.any()) and not bool((commit & ~masked).any())
        above = masked & (conf >= rule.threshold)
        if bool(above.any()):
            assert bool((conf[commit] >= rule.threshold).all())
        else:
            assert bool((conf[commit] >= conf[masked].max() - 1e-5).all())
        seen.append(int(commit.sum()))
        return commit, tokens

    monkeypatch.setattr(rules_module, "rule_commit", recording)   # what commit_block calls
    stats = GenerationStats()
    x = sdar_generate(sdar, PROMPTS[1], mask_id=mask, gen_length=16, block_length=8, temperature=0.0, stats=stats,
                      decoder=remask.ThresholdDecoding(threshold=threshold))
    assert not bool((x == mask).any()) and sum(seen) == x.shape[1] - PROMPTS[1].shape[1]
    if threshold < 0.9:
        assert max(seen) > 1      # parallel commits happen on this model


# --- (2) every rule on SDAR and LLaDA2 ----------------------------------------------------------

@pytest.mark.parametrize("name", list(RULES))
@pytest.mark.parametrize("use_cache", [True, False])
def test_rules_on_sdar_decode_to_the_end(sdar, name, use_cache):
    mask = get_spec(sdar).mask_id
    for prompt in PROMPTS:
        kw = dict(mask_id=mask, gen_length=13, block_length=4, temperature=0.0, decoder=RULES[name])
        x = sdar_generate(sdar, prompt, use_cache=use_cache, **kw)
        assert x.shape == (1, -(-(prompt.shape[1] + 13) // 4) * 4)
        assert not bool((x == mask).any()) and torch.equal(x[:, :prompt.shape[1]], prompt)
        assert torch.equal(x, sdar_generate(sdar, prompt, use_cache=use_cache, **kw))        # deterministic
        assert torch.equal(x, sdar_generate(sdar, prompt, use_cache=not use_cache, **kw))    # the cache is exact
        same = block_diffusion_generate(sdar, {"input_ids": prompt}, mask, gen_length=13, block_length=4,
                                        temperature=0.0, use_cache=use_cache, decoder=RULES[name])
        assert torch.equal(x, same)                                                          # the compat entry


@pytest.mark.parametrize("name", list(RULES))
@pytest.mark.parametrize("use_cache", [True, False])
def test_rules_on_llada2_decode_to_the_end(llada2, name, use_cache):
    spec = get_spec(llada2)
    for prompt in PROMPTS:
        # without EOS every block is decoded: the whole canvas, prompt first, no mask left
        decoder = LLaDA2Rules(RULES[name], mask_id=spec.mask_id, eos_id=None, gen_length=13, block_length=4,
                              use_cache=use_cache)
        state = decoder.start(prompt)
        while not state.done:
            step_alone(decoder, llada2, state)
        assert not bool((state.x == spec.mask_id).any()) and torch.equal(state.x[:, :prompt.shape[1]], prompt)
        assert state.x.shape[1] - prompt.shape[1] >= 13
        # the drop-in generate: deterministic, no mask, up to and including the first EOS
        kw = dict(gen_length=13, block_length=4, decoder=RULES[name], use_cache=use_cache)
        out = llada2_generate(llada2, prompt, **kw)
        assert out.shape[1] <= 13 and not bool((out == spec.mask_id).any())
        assert torch.equal(out, llada2_generate(llada2, prompt, **kw))
        assert torch.equal(out, llada2_generate(llada2, prompt, **{**kw, "use_cache": not use_cache}))
        eos = (out[0] == spec.eos_id).nonzero()
        assert len(eos) == 0 or int(eos[0]) == out.shape[1] - 1
        if len(eos) == 0:
            assert torch.equal(out, state.x[:, prompt.shape[1]:prompt.shape[1] + 13])


def test_llada2_rule_keeps_eos_early_stop(llada2):
    spec = get_spec(llada2)
    for prompt in PROMPTS:
        early = llada2_generate(llada2, prompt, gen_length=16, block_length=4, eos_early_stop=True,
                                decoder=RULES["hierarchy"])
        late = llada2_generate(llada2, prompt, gen_length=16, block_length=4, decoder=RULES["hierarchy"])
        assert not bool((early == spec.mask_id).any())
        assert torch.equal(early, late[:, :early.shape[1]])


# --- (3) + (4) the engine: the drop-in function's tokens, batch invariant ----------------------

@pytest.mark.parametrize("name", ["hierarchy", "credit", "threshold"])
def test_engine_on_sdar_equals_the_function_alone_and_in_a_batch(sdar, name):
    mask = get_spec(sdar).mask_id
    prompts = [p[0].tolist() for p in PROMPTS]
    params = remask.SamplingParams(max_tokens=10, temperature=0.0,
                                   decoder=remask.SDARDecoding(block_length=4, rule=RULES[name]))
    llm = remask.LLM(sdar)
    together = llm.generate(prompts, params, use_tqdm=False)
    alone = [llm.generate([p], params, use_tqdm=False)[0] for p in reversed(prompts)][::-1]
    for prompt, a, b in zip(prompts, together, alone):
        x = sdar_generate(sdar, torch.tensor([prompt]), mask_id=mask, gen_length=10, block_length=4, temperature=0.0,
                          stopping_criteria_idx=sorted(set(llm.engine.stop_ids)), decoder=RULES[name])
        expected = x[0, len(prompt):len(prompt) + 10].tolist()   # max_tokens caps the last block
        assert a.outputs[0].all_token_ids == b.outputs[0].all_token_ids == expected
        assert mask not in expected
    assert llm.engine.kv_stats()["pages_in_use"] == 0
    # the JSON form of the decoder reaches the same loop
    as_json = remask.SamplingParams(max_tokens=10, temperature=0.0, decoder={"name": "sdar", "block_length": 4, "rule": {
        "name": "hierarchical", "threshold": 0.9, "low_threshold": 0.4}}) \
        if name == "hierarchy" else None
    if as_json is not None:
        assert [o.outputs[0].all_token_ids for o in llm.generate(prompts, as_json, use_tqdm=False)] == \
            [o.outputs[0].all_token_ids for o in together]


@pytest.mark.parametrize("name", ["hierarchy", "credit"])
def test_engine_on_llada2_equals_the_function_alone_and_in_a_batch(llada2, name):
    prompts = [p[0].tolist() for p in PROMPTS]
    params = remask.SamplingParams(max_tokens=12, temperature=0.0,
                                   decoder=remask.LLaDA2Decoding(block_length=4, rule=RULES[name]))
    llm = remask.LLM(llada2)
    together = llm.generate(prompts, params, use_tqdm=False)
    alone = [llm.generate([p], params, use_tqdm=False)[0] for p in reversed(prompts)][::-1]
    for prompt, a, b in zip(prompts, together, alone):
        expected = llada2_generate(llada2, torch.tensor([prompt]), gen_length=12, block_length=4,
                                   decoder=RULES[name])[0].tolist()
        assert a.outputs[0].all_token_ids == b.outputs[0].all_token_ids == expected


def test_refusals_name_both_parts(sdar, llada2):
    mask = get_spec(sdar).mask_id
    prompt = PROMPTS[0]
    hier = remask.HierarchicalDecoding()
    base = dict(mask_id=mask, gen_length=8, block_length=4, temperature=0.0, decoder=hier)
    for change, name in ((dict(remasking_strategy="low_confidence_static"), "remasking_strategy"),
                         (dict(confidence_threshold=0.5), "confidence_threshold"),
                         (dict(denoising_steps=4), "denoising_steps"), (dict(top_k=5), "top_k"),
                         (dict(top_p=0.9), "top_p"), (dict(eb_threshold=0.3), "eb_threshold")):
        with pytest.raises(ValueError, match=rf"HierarchicalDecoding.*SDAR.*{name}"):
            sdar_generate(sdar, prompt, **{**base, **change})
    with pytest.raises(ValueError, match=r"temperature.*HierarchicalDecoding.*SDAR"):
        sdar_generate(sdar, prompt, **{**base, "temperature": 1.0})
    with pytest.raises(ValueError, match=r"temperature.*CreditDecoding.*SDAR"):   # upstream's default T = 1
        block_diffusion_generate(sdar, {"input_ids": prompt}, mask, decoder=remask.CreditDecoding())
    with pytest.raises(ValueError, match=r"smoothing.*ThresholdDecoding.*SDAR"):
        sdar_generate(sdar, prompt, **{**base, "decoder": remask.ThresholdDecoding(
            smoothing=remask.IterationSmoothing())})
    with pytest.raises(ValueError, match="decoder"):
        sdar_generate(sdar, prompt, **{**base, "decoder": remask.WINO()})

    lbase = dict(gen_length=8, block_length=4, decoder=hier)
    for change, name in ((dict(steps=4), "steps"), (dict(threshold=0.5), "threshold"), (dict(top_p=0.9), "top_p"),
                         (dict(top_k=3), "top_k"), (dict(minimal_topk=2), "minimal_topk"),
                         (dict(editing_threshold=0.5), "editing_threshold"), (dict(max_post_steps=2), "max_post_steps"),
                         (dict(num_to_transfer=2), "num_to_transfer")):
        with pytest.raises(ValueError, match=rf"HierarchicalDecoding.*LLaDA2.*{name}"):
            llada2_generate(llada2, prompt, **{**lbase, **change})
    with pytest.raises(ValueError, match=r"temperature.*HierarchicalDecoding.*LLaDA2"):
        llada2_generate(llada2, prompt, **{**lbase, "temperature": 0.7})

    # the engine: SamplingParams refuses the sampling settings, the family the loop's own
    with pytest.raises(ValueError, match=r"HierarchicalDecoding.*temperature"):
        remask.SamplingParams(max_tokens=4, temperature=0.5, decoder=hier)
    with pytest.raises(ValueError, match=r"HierarchicalDecoding.*top_k"):
        remask.SamplingParams(max_tokens=4, top_k=5, decoder=hier)
    llm = remask.LLM(sdar)
    for setting in ("remasking_strategy", "denoising_steps", "confidence_threshold"):
        value = {"remasking_strategy": "sequential", "denoising_steps": 2, "confidence_threshold": 0.5}[setting]
        with pytest.raises(ValueError, match=rf"HierarchicalDecoding.*SDAR.*SDARDecoding\.{setting}"):
            llm.generate([[1, 2, 3]], remask.SamplingParams(max_tokens=4, decoder=remask.SDARDecoding(
                block_length=4, rule=hier, **{setting: value})), use_tqdm=False)
    with pytest.raises(ValueError, match=r"CreditDecoding.*LLaDA2.*LLaDA2Decoding\.steps"):
        remask.LLM(llada2).generate([[1, 2, 3]], remask.SamplingParams(max_tokens=8, decoder=remask.LLaDA2Decoding(
            block_length=4, steps=2, rule=remask.CreditDecoding())), use_tqdm=False)
    with pytest.raises(ValueError, match="decoder"):
        llm.generate([[1, 2, 3]], remask.SamplingParams(max_tokens=4, decoder=remask.WINO()), use_tqdm=False)

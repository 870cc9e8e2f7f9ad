"""Properties of remask.generate (LLaDA sampler, Fast-dLLM threshold/factor) and its errors."""
from __future__ import annotations

import pytest
import torch

import remask
from remask.compat import fast_dllm
from remask.diffusion.parts.selection import schedule_counts

from helpers import left_pad, random_prompt

MASK = 299  # llada_small's mask id


def test_commits_follow_integer_schedule_and_blocks_finish_in_order(load_model):
    model = load_model("llada_small")
    prompt = random_prompt(1, 5, 0)
    gen, block, steps = 24, 8, 9
    per_block = steps // (gen // block)
    stats = remask.GenerationStats()
    seen = []
    hook = model.register_forward_pre_hook(lambda mod, args, kw: seen.append(args[0].clone()), with_kwargs=True)
    try:
        out = remask.generate(model, prompt, steps=steps, gen_length=gen, block_length=block, stats=stats)
    finally:
        hook.remove()
    expected = schedule_counts(torch.ones(1, block, dtype=torch.bool), per_block)[0].tolist() * (gen // block)
    assert stats.tokens_per_step == expected
    assert stats.nfe == steps
    assert torch.equal(out[:, :5], prompt)
    assert not (out == MASK).any()
    # Blocks finish in order: while block b is decoded, earlier blocks hold no mask, later ones only masks.
    assert len(seen) == steps
    for j, x in enumerate(seen):
        b = j // per_block
        assert torch.equal(x[:, :5], prompt)
        assert not (x[:, 5:5 + b * block] == MASK).any()
        assert (x[:, 5 + (b + 1) * block:] == MASK).all()


@pytest.mark.parametrize("kwargs", [
    dict(),
    dict(cfg_scale=1.0),
    dict(threshold=0.2),
    dict(factor=2.0),
    dict(remasking="random"),
])
def test_left_padded_batch_equals_rows_alone(load_model, kwargs):
    model = load_model("llada_small")
    rows = [random_prompt(1, 4, 1)[0], random_prompt(1, 9, 2)[0]]
    ids, mask = left_pad(rows, pad_id=297)
    gen = dict(steps=8, gen_length=16, block_length=8, **kwargs)
    if kwargs.get("remasking") == "random":
        batch = remask.generate(model, ids, mask, generator=torch.Generator().manual_seed(0), **gen)
        assert not (batch == MASK).any()
        return
    batch = remask.generate(model, ids, mask, **gen)
    for i, row in enumerate(rows):
        alone = remask.generate(model, row[None], **gen)
        assert torch.equal(batch[i, -16:], alone[0, -16:]), f"row {i} differs from its solo decode"
        assert torch.equal(batch[i, ids.shape[1] - len(row):ids.shape[1]], row)


def test_cfg_zero_equals_no_cfg(load_model):
    model = load_model("llada_small")
    prompt = random_prompt(2, 6, 3)
    a = remask.generate(model, prompt, steps=8, gen_length=16, block_length=8)
    b = remask.generate(model, prompt, steps=8, gen_length=16, block_length=8, cfg_scale=0.0)
    c = remask.generate(model, prompt, steps=8, gen_length=16, block_length=8, cfg_scale=1e-12)
    assert torch.equal(a, b) and torch.equal(a, c)


def test_threshold_above_every_confidence_is_one_token_per_step(load_model):
    model = load_model("llada_small")
    prompt = random_prompt(1, 6, 4)
    stats = remask.GenerationStats()
    fast = remask.generate(model, prompt, steps=2, gen_length=16, block_length=8, threshold=1.0, stats=stats)
    assert stats.tokens_per_step == [1] * 16
    slow = remask.generate(model, prompt, steps=16, gen_length=16, block_length=8)
    assert torch.equal(fast, slow)


def test_low_threshold_commits_in_parallel_and_finishes(load_model):
    model = load_model("llada_small")
    stats = remask.GenerationStats()
    out = remask.generate(model, random_prompt(2, 6, 5), steps=16, gen_length=16, block_length=8,
                          threshold=0.05, stats=stats)
    assert not (out == MASK).any()
    assert stats.nfe < 16 and sum(stats.tokens_per_step) == 2 * 16


def test_fast_dllm_compat_signature_and_nfe(load_model):
    model = load_model("llada_small")
    prompt = random_prompt(1, 6, 6)
    x, nfe = fast_dllm.generate(model, prompt, 16, 16, 8, 0., "low_confidence", MASK, None, None)
    assert nfe == 16 and x.shape == (1, 22) and not (x == MASK).any()
    x, nfe = fast_dllm.generate(model, prompt, steps=16, gen_length=16, block_length=8, mask_id=MASK, factor=4.0)
    assert nfe <= 16 and not (x == MASK).any()


def test_sampling_is_seeded(load_model):
    model = load_model("llada_small")
    prompt = random_prompt(1, 6, 7)
    kw = dict(steps=8, gen_length=16, block_length=8, temperature=0.8)
    a = remask.generate(model, prompt, generator=torch.Generator().manual_seed(1), **kw)
    b = remask.generate(model, prompt, generator=torch.Generator().manual_seed(1), **kw)
    assert torch.equal(a, b) and not (a == MASK).any()


def test_logits_eos_inf_never_emits_eos(load_model):
    model = load_model("llada_small")
    out = remask.generate(model, random_prompt(2, 4, 8), steps=16, gen_length=16, block_length=16,
                          logits_eos_inf=True)
    assert not (out[:, 4:] == 298).any()


@pytest.mark.parametrize("mode", [True, "corrected"])
def test_confidence_eos_eot_modes_run(load_model, mode):
    model = load_model("llada_small")
    out = remask.generate(model, random_prompt(1, 4, 9), steps=8, gen_length=8, block_length=8,
                          confidence_eos_eot_inf=mode)
    assert not (out == MASK).any()


def test_corrected_eos_confidence_commits_eos_last_and_leaves_no_mask(load_model):
    model = load_model("llada_eos")
    prompt = random_prompt(2, 7, 14, high=900)
    kw = dict(steps=16, gen_length=32, block_length=8)
    faithful = remask.generate(model, prompt, confidence_eos_eot_inf=True, **kw)
    corrected = remask.generate(model, prompt, confidence_eos_eot_inf="corrected", **kw)
    assert not (corrected == 126336).any() and not (faithful == 126336).any()
    plain = remask.generate(model, prompt, **kw)
    assert (plain[:, 7:] == 126081).sum() > 0  # the checkpoint does predict EOS
    assert not torch.equal(plain, corrected)


def test_model_that_always_predicts_the_mask_terminates(tmp_path):
    """Fast-dLLM's loop runs until the block has no mask; upstream it never ends when the model keeps
    predicting the mask token (seen on a tiny random checkpoint). remask never commits the mask."""
    from transformers import AutoModel
    from remask.models import tiny

    tiny.write_tiny_llada(str(tmp_path), seed=6, vocab_size=300, embedding_size=300, mask_token_id=299,
                          eos_token_id=298, pad_token_id=297, include_bias=True, logit_bias={299: 100.0})
    model = AutoModel.from_pretrained(str(tmp_path))
    out = remask.generate(model, random_prompt(1, 5, 15), steps=8, gen_length=8, block_length=8, threshold=0.9)
    assert not (out == 299).any()


def test_early_stop_fills_with_eos_after_block_with_eos(load_model):
    model = load_model("llada_small")
    prompt = random_prompt(3, 5, 10)
    kw = dict(steps=32, gen_length=32, block_length=4)
    full = remask.generate(model, prompt, **kw)
    eos = int(full[0, 7])  # pretend the token decoded at position 7 is EOS: row 0 stops after block 0
    stopped = remask.generate(model, prompt, early_stop=True, eos_id=eos, **kw)
    assert torch.equal(stopped[0, :9], full[0, :9])
    assert (stopped[0, 9:] == eos).all()


@pytest.mark.parametrize("kwargs,match", [
    (dict(gen_length=30, block_length=8), "gen_length"),
    (dict(gen_length=32, block_length=8, steps=6), "steps"),
    (dict(threshold=0.0), "threshold"),
    (dict(threshold=1.5), "threshold"),
    (dict(threshold=0.5, factor=1.0), "threshold or factor"),
    (dict(factor=-1.0), "factor"),
    (dict(remasking="lowest"), "remasking"),
    (dict(mask_id=5000), "mask_id"),
    (dict(mask_id=297), "pad"),
    (dict(gen_length=4096, block_length=4096, steps=4096), "maximum sequence length"),
    (dict(temperature=-1.0), "temperature"),
    (dict(confidence_eos_eot_inf="yes"), "confidence_eos_eot_inf"),
])
def test_bad_input_names_the_parameter(load_model, kwargs, match):
    model = load_model("llada_small")
    args = dict(steps=8, gen_length=16, block_length=8)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        remask.generate(model, random_prompt(1, 4, 11), **args)


def test_bad_tensors_are_named(load_model):
    model = load_model("llada_small")
    with pytest.raises(ValueError, match="2-D"):
        remask.generate(model, torch.tensor([1, 2, 3]), steps=8, gen_length=8, block_length=8)
    with pytest.raises(ValueError, match="integer"):
        remask.generate(model, torch.zeros(1, 3), steps=8, gen_length=8, block_length=8)
    with pytest.raises(ValueError, match="attention_mask"):
        remask.generate(model, random_prompt(1, 4, 0), torch.ones(1, 5, dtype=torch.long), 8, 8, 8)
    with pytest.raises(ValueError, match="device"):
        remask.generate(model, random_prompt(1, 4, 0).to("meta"), steps=8, gen_length=8, block_length=8)


def test_model_without_mask_token_is_rejected():
    from transformers import LlamaConfig, LlamaForCausalLM

    ar = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(ValueError, match="ar_generate"):
        remask.generate(ar, random_prompt(1, 4, 0, high=50), steps=4, gen_length=4, block_length=4)
    with pytest.raises(ValueError, match="mask"):
        remask.diffusion_generate(ar, random_prompt(1, 4, 0, high=50), max_new_tokens=4, steps=4)


def test_dream_models_decode_with_the_llada_loop(load_model):
    """The loop is model-agnostic: a Dream model decodes through remask.generate via its spec."""
    model = load_model("dream_small")
    out = remask.generate(model, random_prompt(2, 5, 12), steps=8, gen_length=16, block_length=8)
    assert not (out == 299).any()


def test_patch_attaches_methods(load_model):
    model = load_model("llada_small")
    remask.patch(model)
    prompt = random_prompt(1, 4, 13)
    assert torch.equal(model.generate(prompt, steps=8, gen_length=8, block_length=8),
                       remask.generate(model, prompt, steps=8, gen_length=8, block_length=8))
    out = model.diffusion_generate(prompt, max_new_tokens=8, steps=8, alg="maskgit_plus")
    assert out.shape == (1, 12)

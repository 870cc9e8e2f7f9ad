"""Autoregressive decoding with the KV cache equals transformers' own greedy generate."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import remask

from helpers import left_pad, random_prompt


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=119, pad_token_id=118, bos_token_id=117)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # spread the logits so greedy choices are not decided by rounding
        model.lm_head.weight.mul_(20)
    return model


def test_greedy_equals_transformers_generate(llama):
    prompt = random_prompt(1, 6, 0, high=110)
    ours = remask.ar_generate(llama, prompt, max_new_tokens=12, eos_token_id=[])
    theirs = llama.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert torch.equal(ours, theirs)


def test_left_padded_batch_equals_rows_alone(llama):
    rows = [random_prompt(1, 3, 1, high=110)[0], random_prompt(1, 8, 2, high=110)[0]]
    ids, mask = left_pad(rows, pad_id=118)
    batch = remask.ar_generate(llama, ids, mask, max_new_tokens=10, eos_token_id=[])
    for i, row in enumerate(rows):
        alone = remask.ar_generate(llama, row[None], max_new_tokens=10, eos_token_id=[])
        assert torch.equal(batch[i, -10:], alone[0, -10:])


def test_eos_stops_rows_and_pads(llama):
    prompt = random_prompt(2, 5, 3, high=110)
    free = remask.ar_generate(llama, prompt, max_new_tokens=8, eos_token_id=[])
    eos = int(free[0, 7])
    stats = remask.GenerationStats()
    out = remask.ar_generate(llama, prompt, max_new_tokens=8, eos_token_id=eos, pad_token_id=118, stats=stats)
    first = int((free[0, 5:] == eos).nonzero()[0])
    assert torch.equal(out[0, :5 + first + 1], free[0, :5 + first + 1])
    assert (out[0, 5 + first + 1:] == 118).all()
    # Generated tokens count each row up to and including its EOS (not the padding after it).
    expected = 0
    for row in out[:, 5:]:
        hits = (row == eos).nonzero()
        expected += int(hits[0]) + 1 if len(hits) else 8
    assert stats.generated_tokens == expected < 16 and stats.nfe >= 1


def test_sampling_seeded_and_filtered(llama):
    prompt = random_prompt(1, 5, 4, high=110)
    kw = dict(max_new_tokens=8, temperature=0.9, top_k=5, top_p=0.9, eos_token_id=[])
    a = remask.ar_generate(llama, prompt, generator=torch.Generator().manual_seed(3), **kw)
    b = remask.ar_generate(llama, prompt, generator=torch.Generator().manual_seed(3), **kw)
    assert torch.equal(a, b)


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(temperature=-1.0), "temperature"),
    (dict(top_p=1.5), "top_p"), (dict(top_k=0), "top_k"), (dict(max_new_tokens=300), "max_position"),
])
def test_bad_input(llama, kwargs, match):
    with pytest.raises(ValueError, match=match):
        remask.ar_generate(llama, random_prompt(1, 5, 5, high=110), **kwargs)

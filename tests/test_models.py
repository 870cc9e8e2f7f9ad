"""LLaDA and Dream load from official-format directories through transformers, without remote code."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from remask.models import DreamModel, KVCache, LLaDAModelLM
from remask.models.hf_compat import output_cache
from remask.models.llada import LLaDAConfig

from helpers import random_prompt


def _checkpoint_tensors(path: str) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out


@pytest.mark.parametrize("name,cls", [("llada", LLaDAModelLM), ("llada_gqa_tied", LLaDAModelLM), ("dream", DreamModel)])
def test_auto_model_loads_official_layout_exactly(checkpoint_dir, name, cls):
    path, _ = checkpoint_dir(name)
    with open(os.path.join(path, "config.json")) as f:
        assert "auto_map" in json.load(f)  # the official config points at remote code; we ignore it
    model = AutoModel.from_pretrained(path)
    assert isinstance(model, cls)
    assert isinstance(AutoModelForCausalLM.from_pretrained(path), cls)
    params = dict(model.named_parameters())
    stored = _checkpoint_tensors(path)
    assert set(stored) == set(params), "parameter names must equal the checkpoint's"
    for key, tensor in stored.items():
        torch.testing.assert_close(params[key].detach(), tensor, rtol=0, atol=0)


def test_sharded_checkpoint_with_index(checkpoint_dir):
    path, _ = checkpoint_dir("llada_gqa_tied")
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    assert not os.path.exists(os.path.join(path, "model.safetensors"))
    model = AutoModel.from_pretrained(path)
    assert model.config.n_kv_heads == 2 and model.config.weight_tying
    assert "model.transformer.ff_out.weight" not in dict(model.named_parameters())


def test_official_config_keys_round_trip(checkpoint_dir):
    path, _ = checkpoint_dir("llada")
    config = AutoConfig.from_pretrained(path)
    assert isinstance(config, LLaDAConfig)
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    for key in ("d_model", "n_heads", "n_kv_heads", "n_layers", "mlp_hidden_size", "mlp_ratio", "vocab_size",
                "embedding_size", "max_sequence_length", "rope_theta", "rms_norm_eps", "include_bias",
                "weight_tying", "block_type", "activation_type", "mask_token_id"):
        assert getattr(config, key) == raw[key], key


@pytest.mark.parametrize("name", ["llada", "dream"])
def test_dtype_and_device_map_are_honoured(checkpoint_dir, name):
    path, _ = checkpoint_dir(name)
    model = AutoModel.from_pretrained(path, dtype=torch.bfloat16, device_map="cpu")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    logits = model(random_prompt(1, 5, 0)).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


@pytest.mark.parametrize("name", ["llada_gqa_tied", "dream_small"])
def test_save_load_round_trip(load_model, tmp_path, name):
    model = load_model(name)
    model.save_pretrained(tmp_path)
    again = AutoModel.from_pretrained(tmp_path)
    ids = random_prompt(2, 9, 1)
    torch.testing.assert_close(again(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_unsupported_architecture_is_named():
    with pytest.raises(ValueError, match="block_type"):
        LLaDAModelLM(LLaDAConfig(d_model=8, n_heads=2, n_layers=1, vocab_size=10, embedding_size=10,
                                 block_type="sequential"))


@pytest.mark.parametrize("name", ["llada_small", "dream_small"])
def test_bidirectional_attention(load_model, name):
    """Changing the last token changes the logits at the first position (no causal mask)."""
    model = load_model(name)
    ids = random_prompt(1, 8, 2)
    other = ids.clone()
    other[0, -1] = (other[0, -1] + 1) % 200
    assert not torch.allclose(model(ids).logits[0, 0], model(other).logits[0, 0])


@pytest.mark.parametrize("name", ["llada_small", "dream_small"])
def test_padding_mask_isolates_real_tokens(load_model, name):
    """With a padding mask, the content of padded positions does not reach real positions."""
    model = load_model(name)
    ids = random_prompt(1, 10, 3)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    other = ids.clone()
    other[0, :3] = 7
    kwargs = {"attention_mask": mask}
    if name.startswith("dream"):  # Dream's convention: 4-D mask and positions counted over real tokens
        from remask.models.spec import get_spec
        kwargs = get_spec(model).forward_inputs(mask, ids.shape[1])
    a = model(ids, **kwargs).logits[0, 3:]
    b = model(other, **kwargs).logits[0, 3:]
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["llada_gqa_tied", "dream_small"])
def test_kv_cache_prefix_and_in_place_overwrite(load_model, name):
    """A cache built by a full forward, cropped to a prefix, then fed the rest, equals the full
    forward; overwriting a range in place with the same tokens does too; new tokens refresh the range."""
    model = load_model(name)
    ids = random_prompt(2, 12, 4)
    full_out = model(ids, use_cache=True)
    full, cache = full_out.logits, output_cache(full_out)
    assert isinstance(cache, KVCache) and cache.get_seq_length() == 12
    cache.crop(5)
    tail = model(ids[:, 5:], past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(tail, full[:, 5:], rtol=1e-5, atol=1e-5)
    assert cache.get_seq_length() == 12
    part = model(ids[:, 5:8], past_key_values=cache, cache_position=torch.arange(5, 8)).logits
    torch.testing.assert_close(part, full[:, 5:8], rtol=1e-5, atol=1e-5)
    changed = ids.clone()
    changed[:, 5:8] = (changed[:, 5:8] + 3) % 200
    model(changed[:, 5:8], past_key_values=cache, cache_position=torch.arange(5, 8))
    fresh = output_cache(model(changed, use_cache=True))
    torch.testing.assert_close(cache.keys[0][:, :, 5:8], fresh.keys[0][:, :, 5:8], rtol=1e-6, atol=1e-6)
    assert cache.get_seq_length() == 12

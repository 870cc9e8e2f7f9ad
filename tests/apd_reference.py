"""Tiny Dream + Qwen2 checkpoints for the APD fixture (tests/fixtures/apd_reference.json).

Random models are nearly uniform and never agree, so drafts would never be accepted. Both models
are therefore edited to favour the same 20 ids (`FAVOURED`, in the same order). Coordinate 0 of
every embedding is set to a constant, which survives RMSNorm. Column 0 of `lm_head` is then a
per-token bias for those ids only (neither model has a bias parameter). The verifier shares 75%
of the dLLM's weights (Qwen2 layout, run causally), so the two agree often but not always.
Rebuilt bit for bit here; the fixture's digests check it.
"""
from __future__ import annotations

import hashlib
import math

import torch

from remask.models import portable_random, tiny

EOS, MASK, VERIFIER_VOCAB = 151643, 151666, 151936
PRIOR = dict(C=4.0, b0=5.0, step=0.05)
LOGIT_SCALE = 5.5
DREAMS = {   # name -> (config overrides, extra lm_head column-0 biases)
    "dream_apd": ({}, {}),
    "dream_apd_cache": ({"use_cache": True}, {}),
    "dream_apd_eos": ({}, {EOS: 8.5}),
}
VERIFIER_CONFIG = dict(
    vocab_size=VERIFIER_VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=64, tie_word_embeddings=False, eos_token_id=EOS, bos_token_id=EOS, max_position_embeddings=4096,
    rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu", use_sliding_window=False, sliding_window=None,
    max_window_layers=2, attention_dropout=0.0, initializer_range=0.02, use_cache=True)


def favoured_ids(seed: int = 20261121, n: int = 20, lo: int = 10, hi: int = 1000) -> list[int]:
    perm = torch.randperm(hi - lo, generator=torch.Generator().manual_seed(seed))[:n]
    return [int(i) + lo for i in perm]


FAVOURED = favoured_ids()


def prior_edit(sd: dict, C: float, b0: float, step: float, extra_bias: dict | None = None) -> dict:
    sd["model.embed_tokens.weight"][:, 0] = C
    sd["lm_head.weight"][:, 0] = 0.0
    for k, tok in enumerate(FAVOURED):
        sd["lm_head.weight"][tok, 0] = b0 - k * step
    for tok, b in (extra_bias or {}).items():
        sd["lm_head.weight"][int(tok), 0] = float(b)
    return sd


def write_dream(path: str, name: str) -> str:
    """Write one of `DREAMS` (official layout); returns `tiny.state_dict_digest` of the edited weights."""
    from safetensors.torch import load_file, save_file

    overrides, extra = DREAMS[name]
    tiny.write_tiny_dream(path, seed=31, logit_scale=LOGIT_SCALE, **overrides)
    f = f"{path}/model.safetensors"
    sd = prior_edit(load_file(f), extra_bias=extra, **PRIOR)
    save_file({k: sd[k].contiguous() for k in sorted(sd)}, f, metadata={"format": "pt"})
    return tiny.state_dict_digest(sd)


def _verifier_draw(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    cfg = VERIFIER_CONFIG

    def normal(shape, std):   # the AVX2 draw on every CPU (models/portable_random.py)
        return portable_random.randn(shape, generator=gen) * std

    d, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, inter, vocab = d // nh, cfg["intermediate_size"], cfg["vocab_size"]
    sd = {"model.embed_tokens.weight": normal((vocab, d), 1.0)}
    for i in range(cfg["num_hidden_layers"]):
        b = f"model.layers.{i}."
        sd[b + "input_layernorm.weight"] = 1.0 + normal((d,), 0.1)
        sd[b + "post_attention_layernorm.weight"] = 1.0 + normal((d,), 0.1)
        for nm, o in (("q_proj", nh * hd), ("k_proj", nkv * hd), ("v_proj", nkv * hd)):
            sd[b + f"self_attn.{nm}.weight"] = normal((o, d), 1.5 / math.sqrt(d))
            sd[b + f"self_attn.{nm}.bias"] = normal((o,), 0.1)
        sd[b + "self_attn.o_proj.weight"] = normal((d, nh * hd), 1.0 / math.sqrt(d))
        sd[b + "mlp.gate_proj.weight"] = normal((inter, d), 1.0 / math.sqrt(d))
        sd[b + "mlp.up_proj.weight"] = normal((inter, d), 1.0 / math.sqrt(d))
        sd[b + "mlp.down_proj.weight"] = normal((d, inter), 1.0 / math.sqrt(inter))
    sd["model.norm.weight"] = 1.0 + normal((d,), 0.1)
    sd["lm_head.weight"] = normal((vocab, d), LOGIT_SCALE / math.sqrt(d))
    return sd


def build_verifier(dream_path: str, alpha: float = 0.25, seed: int = 41):
    """The Qwen2 verifier: (1 − alpha) · the dLLM's tensors (vocabulary cut to 151 936) + alpha · a
    seeded draw, then the same edit. Returns (model, digest)."""
    from safetensors.torch import load_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    base = load_file(f"{dream_path}/model.safetensors")
    sd = _verifier_draw(seed)
    for k in sd:
        t = base[k][:VERIFIER_VOCAB] if k in ("model.embed_tokens.weight", "lm_head.weight") else base[k]
        sd[k] = (1 - alpha) * t + alpha * sd[k]
    prior_edit(sd, **PRIOR)
    h = hashlib.sha256()
    for k in sorted(sd):
        h.update(k.encode())
        h.update(sd[k].contiguous().numpy().tobytes())
    model = Qwen2ForCausalLM(Qwen2Config(**VERIFIER_CONFIG)).to(torch.float32).eval()
    model.load_state_dict(sd, strict=True)
    return model, h.hexdigest()[:16]

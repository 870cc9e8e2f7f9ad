"""Tiny random checkpoints in the *official* on-disk formats of LLaDA and Dream.

They exist so that tests, the demo and reference comparisons run offline: a directory written
here has the same `config.json` keys, `auto_map`, parameter names and safetensors layout (single
file, or shards plus `model.safetensors.index.json`) as the released checkpoints, only tiny.
The official remote code loads them with `trust_remote_code=True`; remask loads them through
`AutoModel.from_pretrained` without it.

Weights are drawn from a seeded `torch.Generator`, so a given (config, seed) always yields the
same tensors, on every CPU: torch's own normal (and uniform) draws depend on the CPU's vector
capability (AVX2/AVX512 take a vectorised Box-Muller, `ATEN_CPU_CAPABILITY=default` and ARM libm),
so the writers draw through `portable_random`, which recomputes torch's AVX2 result exactly on any
CPU; the digests, and the fixtures made on these weights, are the same everywhere. They are scaled
so that logits are spread out (a random model with the usual 0.02 init has near-uniform logits,
which makes greedy decoding decided by rounding noise).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any

import torch
from safetensors.torch import save_file

from . import portable_random

OFFICIAL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "official")


def official_config(family: str, kind: str = "config") -> dict[str, Any]:
    """A released checkpoint's `config.json` (`kind="config"`) or `generation_config.json`
    (`kind="generation_config"`), as published (models/official/README.md names each source)."""
    with open(os.path.join(OFFICIAL_DIR, f"{family}.{kind}.json")) as f:
        return json.load(f)


def _shrunk(family: str, shrink: dict[str, Any], added: dict[str, Any] | None = None,
            kind: str = "config") -> dict[str, Any]:
    """The official file of `family` with `shrink` applied to keys it has (sizes, special ids, and
    the few values listed with each family) and `added` keys it lacks (ids the release keeps in its
    tokenizer or code, which a tiny vocabulary must move): every other key as released."""
    config = official_config(family, kind)
    unknown = sorted(set(shrink) - set(config))
    if unknown:
        raise KeyError(f"{family} {kind}: {unknown} are not keys of the official file")
    return {**config, **shrink, **(added or {})}


# Every tiny checkpoint loads in float32, whatever dtype the release names: the fixtures are the
# reference code's float32 outputs, and transformers 5 loads a config's dtype by default.
LLADA_DEFAULTS: dict[str, Any] = _shrunk("llada", {
    "d_model": 32, "mlp_hidden_size": 64, "n_heads": 4, "n_kv_heads": 4, "n_layers": 2})

# Dream: the fixtures were made with these; `use_cache` is not read by the forward (an argument).
DREAM_DEFAULTS: dict[str, Any] = _shrunk("dream", {
    "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "torch_dtype": "float32", "use_cache": False})


def _normal(gen: torch.Generator, shape: tuple[int, ...], std: float) -> torch.Tensor:
    return portable_random.randn(shape, generator=gen) * std


def llada_state_dict(config: dict[str, Any], seed: int = 0, logit_scale: float = 3.0,
                     logit_bias: dict[int, float] | None = None) -> dict[str, torch.Tensor]:
    """Random weights named exactly as in the official LLaDA checkpoints.

    `logit_bias` (needs `include_bias=True`, which gives the LM head a bias as in the official
    code) raises chosen tokens' logits, e.g. to make EOS a frequent prediction.
    """
    gen = torch.Generator().manual_seed(seed)
    d = config["d_model"]
    n_heads = config["n_heads"]
    n_kv = config.get("n_kv_heads") or n_heads
    head_dim = d // n_heads
    hidden = config.get("mlp_hidden_size") or config["mlp_ratio"] * d
    emb = config.get("embedding_size") or config["vocab_size"]
    bias = bool(config.get("include_bias")) or bool(config.get("include_qkv_bias"))
    p = "model.transformer."
    sd: dict[str, torch.Tensor] = {p + "wte.weight": _normal(gen, (emb, d), 1.0)}
    for i in range(config["n_layers"]):
        b = f"{p}blocks.{i}."
        sd[b + "attn_norm.weight"] = 1.0 + _normal(gen, (d,), 0.1)
        sd[b + "ff_norm.weight"] = 1.0 + _normal(gen, (d,), 0.1)
        for name, out in (("q_proj", d), ("k_proj", n_kv * head_dim), ("v_proj", n_kv * head_dim)):
            sd[b + name + ".weight"] = _normal(gen, (out, d), 1.5 / math.sqrt(d))
            if bias:
                sd[b + name + ".bias"] = _normal(gen, (out,), 0.1)
        sd[b + "attn_out.weight"] = _normal(gen, (d, d), 1.0 / math.sqrt(d))
        sd[b + "ff_proj.weight"] = _normal(gen, (hidden, d), 1.0 / math.sqrt(d))
        sd[b + "up_proj.weight"] = _normal(gen, (hidden, d), 1.0 / math.sqrt(d))
        sd[b + "ff_out.weight"] = _normal(gen, (d, hidden), 1.0 / math.sqrt(hidden))
        if config.get("include_bias"):
            sd[b + "attn_out.bias"] = _normal(gen, (d,), 0.1)
            sd[b + "ff_proj.bias"] = _normal(gen, (hidden,), 0.1)
            sd[b + "up_proj.bias"] = _normal(gen, (hidden,), 0.1)
            sd[b + "ff_out.bias"] = _normal(gen, (d,), 0.1)
    sd[p + "ln_f.weight"] = 1.0 + _normal(gen, (d,), 0.1)
    if logit_bias and (config.get("weight_tying") or not config.get("include_bias")):
        raise ValueError("logit_bias needs include_bias=True and weight_tying=False (an LM head with a bias)")
    if not config.get("weight_tying"):
        sd[p + "ff_out.weight"] = _normal(gen, (emb, d), logit_scale / math.sqrt(d))
        if config.get("include_bias"):
            sd[p + "ff_out.bias"] = torch.zeros(emb)
            for token, value in (logit_bias or {}).items():
                sd[p + "ff_out.bias"][int(token)] = float(value)
    else:
        # Tied head: the embedding doubles as the output projection, so give it the logit scale.
        sd[p + "wte.weight"] = sd[p + "wte.weight"] * (logit_scale / math.sqrt(d))
    return sd


def dream_state_dict(config: dict[str, Any], seed: int = 0, logit_scale: float = 3.0) -> dict[str, torch.Tensor]:
    """Random weights named exactly as in the official Dream checkpoints (Qwen2 layout)."""
    gen = torch.Generator().manual_seed(seed)
    d = config["hidden_size"]
    n_heads = config["num_attention_heads"]
    n_kv = config["num_key_value_heads"]
    head_dim = d // n_heads
    inter = config["intermediate_size"]
    vocab = config["vocab_size"]
    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": _normal(gen, (vocab, d), 1.0)}
    for i in range(config["num_hidden_layers"]):
        b = f"model.layers.{i}."
        sd[b + "input_layernorm.weight"] = 1.0 + _normal(gen, (d,), 0.1)
        sd[b + "post_attention_layernorm.weight"] = 1.0 + _normal(gen, (d,), 0.1)
        for name, out in (("q_proj", n_heads * head_dim), ("k_proj", n_kv * head_dim), ("v_proj", n_kv * head_dim)):
            sd[b + f"self_attn.{name}.weight"] = _normal(gen, (out, d), 1.5 / math.sqrt(d))
            sd[b + f"self_attn.{name}.bias"] = _normal(gen, (out,), 0.1)
        sd[b + "self_attn.o_proj.weight"] = _normal(gen, (d, n_heads * head_dim), 1.0 / math.sqrt(d))
        sd[b + "mlp.gate_proj.weight"] = _normal(gen, (inter, d), 1.0 / math.sqrt(d))
        sd[b + "mlp.up_proj.weight"] = _normal(gen, (inter, d), 1.0 / math.sqrt(d))
        sd[b + "mlp.down_proj.weight"] = _normal(gen, (d, inter), 1.0 / math.sqrt(inter))
    sd["model.norm.weight"] = 1.0 + _normal(gen, (d,), 0.1)
    if not config.get("tie_word_embeddings"):
        sd["lm_head.weight"] = _normal(gen, (vocab, d), logit_scale / math.sqrt(d))
    return sd


def state_dict_digest(sd: dict[str, torch.Tensor]) -> str:
    """A short sha256 over names and bytes, so fixtures can tell if the weights they were made from changed."""
    h = hashlib.sha256()
    for name in sorted(sd):
        h.update(name.encode())
        h.update(sd[name].contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _save(path: str, config: dict[str, Any], sd: dict[str, torch.Tensor], shards: int, extra_files: dict[str, Any]) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    for name, content in extra_files.items():
        with open(os.path.join(path, name), "w") as f:
            json.dump(content, f, indent=2)
    names = sorted(sd)
    if shards <= 1:
        save_file({k: sd[k].contiguous() for k in names}, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        per = math.ceil(len(names) / shards)
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = names[s * per:(s + 1) * per]
            save_file({k: sd[k].contiguous() for k in part}, os.path.join(path, fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in part})
        total = sum(t.numel() * t.element_size() for t in sd.values())
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return state_dict_digest(sd)


def write_tiny_llada(path: str, *, seed: int = 0, shards: int = 1, logit_scale: float = 3.0,
                     logit_bias: dict[int, float] | None = None, **overrides: Any) -> str:
    """Write a tiny random LLaDA checkpoint in the official layout; returns the weights' digest.

    `overrides` replace keys of the official config.json (e.g. `n_kv_heads=2`, `weight_tying=True`,
    `vocab_size=1000, embedding_size=1000, mask_token_id=999`); `logit_bias` see `llada_state_dict`.
    """
    config = {**LLADA_DEFAULTS, **overrides}
    # the release's bos is the id below its eos (126080, 126081); a tiny vocabulary keeps that relation
    generation = _shrunk("llada", {"bos_token_id": config["eos_token_id"] - 1, "eos_token_id": config["eos_token_id"]},
                         kind="generation_config")
    return _save(path, config, llada_state_dict(config, seed, logit_scale, logit_bias), shards,
                 {"generation_config.json": generation})


def write_tiny_dream(path: str, *, seed: int = 0, shards: int = 1, logit_scale: float = 3.0, **overrides: Any) -> str:
    """Write a tiny random Dream checkpoint in the official layout; returns the weights' digest."""
    config = {**DREAM_DEFAULTS, **overrides}
    generation_config = _shrunk("dream", {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
                                           "pad_token_id": config["pad_token_id"]}, kind="generation_config")
    return _save(path, config, dream_state_dict(config, seed, logit_scale), shards,
                 {"generation_config.json": generation_config})


def write_llada_checkpoint(path: str, config: dict[str, Any], state_dict: dict[str, torch.Tensor]) -> str:
    """Write trained LLaDA weights in the official layout (`config.json` keys of the release,
    one `model.safetensors` with the release's parameter names); returns the weights' digest."""
    return _save(path, config, state_dict, 1, {})


def write_tiny_diffusion_gemma(path: str, *, seed: int = 0, vocab_size: int = 301, canvas_length: int = 8,
                               sliding_window: int = 8, embedding_scale: float = 20.0,
                               generation: dict[str, Any] | None = None, charset: Any = None) -> str:
    """Write a tiny random DiffusionGemma checkpoint in the official format (transformers'
    `save_pretrained` of `DiffusionGemmaForBlockDiffusion`, plus `generation_config.json` from a
    `DiffusionGemmaGenerationConfig`); returns the weights' digest.

    Two layers (sliding + full), 4 experts of which 2 routed, a one-layer vision tower (the config
    needs one). The tied embedding is scaled by `embedding_scale` so the tiny model's
    distributions are peaked enough for the entropy-bound sampler to accept several positions.
    Special ids: pad 0, eos 1, bos 2; the last three ids are the image markers. `charset`: a
    character set such as `remask.zoo.charset` (its `VOCAB_SIZE`, pad/bos/eos ids and
    `build_tokenizer()`), whose tokenizer is saved beside it and whose ids it uses, so text
    prompts work (the random model's answers are noise).
    """
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, DiffusionGemmaTextConfig
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import DiffusionGemmaGenerationConfig

    pad, eos, bos = 0, 1, 2
    if charset is not None:
        vocab_size, pad, eos, bos = charset.VOCAB_SIZE, charset.PAD_ID, charset.EOS_ID, charset.BOS_ID
    text = DiffusionGemmaTextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=16, sliding_window=sliding_window,
        max_position_embeddings=512, layer_types=["sliding_attention", "full_attention"], num_experts=4,
        top_k_experts=2, moe_intermediate_size=32, pad_token_id=pad, eos_token_id=eos, bos_token_id=bos)
    vision = dict(model_type="gemma4_vision", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    config = DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=canvas_length,
                                  image_token_id=vocab_size - 1, boi_token_id=vocab_size - 3,
                                  eoi_token_id=vocab_size - 2,
                                  # top-level keys of the release's config.json (its end ids shrunk to one)
                                  eos_token_id=[eos], vision_soft_tokens_per_image=280)
    with torch.random.fork_rng(), portable_random.portable_init():
        torch.manual_seed(seed)
        model = DiffusionGemmaForBlockDiffusion(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(embedding_scale)   # tied: the embeddings of encoder and decoder too
    # the release's generation_config.json (its entropy-bound sampler, 48 steps, t in [0.4, 0.8]);
    # its three end ids shrink to the tiny vocabulary's one
    released = _shrunk("diffusion_gemma", {"eos_token_id": [eos], "pad_token_id": pad}, kind="generation_config")
    released.pop("transformers_version")
    model.generation_config = DiffusionGemmaGenerationConfig(**{**released, **(generation or {})})
    model.save_pretrained(path)
    if charset is not None:
        charset.build_tokenizer().save_pretrained(path)
    return state_dict_digest(model.state_dict())


# SDAR-4B-Chat's config.json (with its `attn_implementation: flex_attention`, which remask answers
# with SDPA). Shrunk besides sizes and ids: `rope_theta` (the fixtures were made with 10000).
# Added: `block_size` and `mask_token_id`, which the release keeps in its code (4, and 151669, outside
# a 300-token vocabulary); remask's spec reads them, with the release's values as defaults.
SDAR_DEFAULTS: dict[str, Any] = _shrunk("sdar", {
    "bos_token_id": 298, "eos_token_id": 298, "head_dim": 16, "hidden_size": 64, "intermediate_size": 128,
    "max_position_embeddings": 512, "max_window_layers": 2, "num_attention_heads": 4, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "rope_theta": 10000, "torch_dtype": "float32", "vocab_size": 300,
}, added={"block_size": 4, "mask_token_id": 299})
# Keys of the release's config.json that its remote code reads or carries and remask's classes do not.
_SDAR_UNREAD = ("architectures", "auto_map", "model_type", "torch_dtype", "transformers_version", "fuse_cross_entropy",
                "debug", "ep_size", "micro_forward", "skip_checkpoint", "use_deepep", "attn_implementation")


def write_tiny_sdar(path: str, *, seed: int = 0, logit_scale: float = 40.0, **overrides: Any) -> str:
    """Write a tiny random SDAR checkpoint in the official layout (`config.json` with the release's
    keys and `auto_map`, `model.safetensors` with its parameter names, `generation_config.json`);
    returns the weights' digest. Weights are drawn from a seeded generator (normal, std 0.02; the
    LM head scaled by `logit_scale` so that predictions are peaked enough to exercise thresholds)."""
    return _write_sdar(path, {**SDAR_DEFAULTS, **overrides}, seed, logit_scale)


def _write_sdar(path: str, config: dict[str, Any], seed: int, logit_scale: float) -> str:
    from .sdar import SDARConfig, SDARForCausalLM, SDARMoeConfig, SDARMoeForCausalLM

    official = "sdar_moe" if config["model_type"] == "sdar_moe" else "sdar"
    init = {k: v for k, v in config.items() if k not in _SDAR_UNREAD}
    config_class, model_class = ((SDARMoeConfig, SDARMoeForCausalLM) if config["model_type"] == "sdar_moe"
                                 else (SDARConfig, SDARForCausalLM))
    with torch.random.fork_rng(), portable_random.portable_init():
        torch.manual_seed(seed)
        model = model_class(config_class(**init))
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
        # a trained model practically never predicts the mask token (it is never a target): logit 0
        # among logits of spread ~logit_scale·0.8 makes it negligible, as there
        model.lm_head.weight[config["mask_token_id"]].zero_()
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    # the release's generation_config.json (Qwen3's): eos [<|im_end|>, <|endoftext|>], pad <|endoftext|>
    eos = config["eos_token_id"]
    generation = _shrunk(official, {"bos_token_id": config["bos_token_id"], "eos_token_id": [eos - 2, eos],
                                    "pad_token_id": eos}, kind="generation_config")
    return _save(path, config, sd, 1, {"generation_config.json": generation})


# SDAR-30B-A3B-Chat's config.json, shrunk as SDAR's (its `rope_theta` too).
SDAR_MOE_DEFAULTS: dict[str, Any] = _shrunk("sdar_moe", {
    "bos_token_id": 298, "eos_token_id": 298, "head_dim": 16, "hidden_size": 64, "intermediate_size": 128,
    "max_position_embeddings": 512, "max_window_layers": 2, "moe_intermediate_size": 32, "num_attention_heads": 4,
    "num_experts": 6, "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_key_value_heads": 2, "rope_theta": 10000,
    "torch_dtype": "float32", "vocab_size": 300,
}, added={"block_size": 4, "mask_token_id": 299})


def write_tiny_sdar_moe(path: str, *, seed: int = 0, logit_scale: float = 40.0, **overrides: Any) -> str:
    """`write_tiny_sdar` for SDAR-MoE (Qwen3-MoE keys and names: `mlp.gate`, `mlp.experts.N.*`)."""
    return _write_sdar(path, {**SDAR_MOE_DEFAULTS, **overrides}, seed, logit_scale)


# LLaDA2.0-mini's config.json (2.1-mini's is the same file), shrunk; `dtype` as every tiny's. Added:
# `eos_token_id` and `mask_token_id`, which the release keeps in its tokenizer (outside a 300-token
# vocabulary); `use_qk_norm` is absent as released (remask's default, True, is the released model's).
LLADA2_DEFAULTS: dict[str, Any] = _shrunk("llada2", {
    "dtype": "float32", "head_dim": 16, "hidden_size": 64, "intermediate_size": 128, "max_position_embeddings": 512,
    "moe_intermediate_size": 32, "n_group": 2, "num_attention_heads": 4, "num_experts": 8, "num_experts_per_tok": 2,
    "num_hidden_layers": 3, "num_key_value_heads": 2, "pad_token_id": 298, "rotary_dim": 8, "topk_group": 1,
    "vocab_size": 300,
}, added={"eos_token_id": 298, "mask_token_id": 299})


def write_tiny_llada2(path: str, *, seed: int = 0, logit_scale: float = 40.0, router_scale: float = 50.0,
                      **overrides: Any) -> str:
    """Write a tiny random LLaDA2 (MoE) checkpoint in the official layout (`config.json` with the
    release's keys and `auto_map`, `model.safetensors` with its parameter names including each
    router's `expert_bias`, `generation_config.json`); returns the weights' digest. Weights are drawn
    from a seeded generator (normal, std 0.02); the LM head is scaled by `logit_scale` (peaked
    predictions exercise the thresholds) and the routers by `router_scale` with a random expert bias
    (so routing is decided by the weights, not by rounding)."""
    from .llada2 import LLaDA2MoeConfig, LLaDA2MoeModelLM

    config = {**LLADA2_DEFAULTS, **overrides}
    init = {k: v for k, v in config.items() if k not in ("architectures", "auto_map", "model_type", "dtype",
                                                          "transformers_version")}
    with torch.random.fork_rng(), portable_random.portable_init():
        torch.manual_seed(seed)
        model = LLaDA2MoeModelLM(LLaDA2MoeConfig(**init))
        with torch.no_grad():
            model.lm_head.weight.mul_(logit_scale)
            # a trained model practically never predicts the mask token (never a target): logit 0
            model.lm_head.weight[config["mask_token_id"]].zero_()
            for name, buffer in model.named_buffers():
                if name.endswith("mlp.gate.expert_bias"):
                    buffer.copy_(portable_random.randn(buffer.shape) * 0.05)
            for name, param in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    param.mul_(router_scale)
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    # the release ships no generation_config.json (its ids live in the tokenizer)
    return _save(path, config, sd, 1, {})


# Fast_dLLM_v2_7B's config.json (Qwen2.5 backbone, the misspelled `conplemenrary_mask` included),
# shrunk: sizes (`bd_size` and `layer_types` too), ids inside a 300-token vocabulary, `rope_theta`
# (the fixtures were made with 10000). Added: `mask_token_id` (the release's code uses the constant
# 151665 and has no such key), so remask's spec finds the tiny mask id.
FAST_DLLM_V2_DEFAULTS: dict[str, Any] = _shrunk("fast_dllm_v2", {
    "bd_size": 8, "bos_token_id": 297, "eos_token_id": 298, "hidden_size": 64, "intermediate_size": 128,
    "layer_types": ["full_attention", "full_attention"], "max_position_embeddings": 512, "max_window_layers": 2,
    "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "pad_token_id": 298,
    "rope_theta": 10000.0, "torch_dtype": "float32", "vocab_size": 300,
}, added={"mask_token_id": 299})


def write_tiny_fast_dllm_v2(path: str, *, seed: int = 0, logit_scale: float = 40.0, **overrides: Any) -> str:
    """Write a tiny random Fast-dLLM v2 checkpoint in the official layout (`config.json` with the
    release's keys and `auto_map`, `model.safetensors` with its parameter names, `generation_config.json`);
    returns the weights' digest. Weights are drawn from a seeded generator (normal, std 0.02; the q/k/v
    biases normal, std 0.1; the LM head scaled by `logit_scale` so predictions are peaked enough to
    exercise the thresholds, and the mask token's row zeroed: a trained model never predicts it)."""
    from .fast_dllm_v2 import FastDLLMV2Config, FastDLLMV2ForCausalLM

    config = {**FAST_DLLM_V2_DEFAULTS, **overrides}
    init = {k: v for k, v in config.items() if k not in ("architectures", "auto_map", "model_type", "torch_dtype",
                                                          "transformers_version")}
    with torch.random.fork_rng(), portable_random.portable_init():
        torch.manual_seed(seed)
        model = FastDLLMV2ForCausalLM(FastDLLMV2Config(**init))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("_proj.bias"):
                param.copy_(_normal(gen, tuple(param.shape), 0.1))
        model.lm_head.weight.mul_(logit_scale)
        model.lm_head.weight[config["mask_token_id"]].zero_()
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    # the release's generation_config.json (Qwen2.5's): eos [<|im_end|>, <|endoftext|>], pad <|endoftext|>
    generation = _shrunk("fast_dllm_v2", {"bos_token_id": config["bos_token_id"],
                                          "eos_token_id": [config["eos_token_id"], config["bos_token_id"]],
                                          "pad_token_id": config["bos_token_id"]}, kind="generation_config")
    return _save(path, config, sd, 1, {"generation_config.json": generation})

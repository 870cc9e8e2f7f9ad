"""Tiny random checkpoints in the *official* on-disk formats of LLaDA and Dream.

They exist so that tests, the demo and reference comparisons run offline: a directory written
here has the same `config.json` keys, `auto_map`, parameter names and safetensors layout (single
file, or shards plus `model.safetensors.index.json`) as the released checkpoints, only tiny.
The official remote code loads them with `trust_remote_code=True`; remask loads them through
`AutoModel.from_pretrained` without it.

Weights are drawn from a seeded `torch.Generator`, so a given (config, seed) always yields the
same tensors. They are scaled so that logits are spread out (a random model with the usual 0.02
init has near-uniform logits, which makes greedy decoding decided by rounding noise).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any

import torch
from safetensors.torch import save_file

LLADA_DEFAULTS: dict[str, Any] = {
    # Keys and values of the released LLaDA-8B-Instruct config.json, shapes shrunk.
    "activation_type": "silu",
    "alibi": False,
    "alibi_bias_max": 8.0,
    "architectures": ["LLaDAModelLM"],
    "attention_dropout": 0.0,
    "attention_layer_norm": False,
    "attention_layer_norm_with_affine": True,
    "auto_map": {
        "AutoConfig": "configuration_llada.LLaDAConfig",
        "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
        "AutoModel": "modeling_llada.LLaDAModelLM",
    },
    "bias_for_layer_norm": False,
    "block_group_size": 1,
    "block_type": "llama",
    "d_model": 32,
    "embedding_dropout": 0.0,
    "embedding_size": 126464,
    "eos_token_id": 126081,
    "flash_attention": False,
    "include_bias": False,
    "include_qkv_bias": False,
    "init_cutoff_factor": None,
    "init_device": "meta",
    "init_fn": "mitchell",
    "init_std": 0.02,
    "input_emb_norm": False,
    "layer_norm_type": "rms",
    "layer_norm_with_affine": True,
    "mask_token_id": 126336,
    "max_sequence_length": 4096,
    "mlp_hidden_size": 64,
    "mlp_ratio": 4,
    "model_type": "llada",
    "multi_query_attention": None,
    "n_heads": 4,
    "n_kv_heads": 4,
    "n_layers": 2,
    "pad_token_id": 126081,
    "precision": "amp_bf16",
    "residual_dropout": 0.0,
    "rms_norm_eps": 1e-05,
    "rope": True,
    "rope_full_precision": True,
    "rope_theta": 500000.0,
    "scale_logits": False,
    "transformers_version": "4.46.3",
    "use_cache": False,
    "vocab_size": 126464,
    "weight_tying": False,
}

DREAM_DEFAULTS: dict[str, Any] = {
    # Keys of the released Dream-v0-Instruct-7B config.json, shapes shrunk.
    "architectures": ["DreamModel"],
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_dream.DreamConfig",
        "AutoModel": "modeling_dream.DreamModel",
    },
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 32,
    "initializer_range": 0.02,
    "intermediate_size": 64,
    "mask_token_id": 151666,
    "max_position_embeddings": 131072,
    "max_window_layers": 28,
    "model_type": "Dream",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "pad_token_id": 151643,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "transformers_version": "4.46.2",
    "use_cache": False,
    "use_sliding_window": False,
    "vocab_size": 152064,
}


def _normal(gen: torch.Generator, shape: tuple[int, ...], std: float) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


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
    return _save(path, config, llada_state_dict(config, seed, logit_scale, logit_bias), shards, {})


def write_tiny_dream(path: str, *, seed: int = 0, shards: int = 1, logit_scale: float = 3.0, **overrides: Any) -> str:
    """Write a tiny random Dream checkpoint in the official layout; returns the weights' digest."""
    config = {**DREAM_DEFAULTS, **overrides}
    generation_config = {
        "_from_model_config": True,
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
        "transformers_version": config["transformers_version"],
    }
    return _save(path, config, dream_state_dict(config, seed, logit_scale), shards,
                 {"generation_config.json": generation_config})


def write_llada_checkpoint(path: str, config: dict[str, Any], state_dict: dict[str, torch.Tensor]) -> str:
    """Write trained LLaDA weights in the official layout (`config.json` keys of the release,
    one `model.safetensors` with the release's parameter names); returns the weights' digest."""
    return _save(path, config, state_dict, 1, {})


def write_tiny_diffusion_gemma(path: str, *, seed: int = 0, vocab_size: int = 301, canvas_length: int = 8,
                               sliding_window: int = 8, embedding_scale: float = 20.0,
                               generation: dict[str, Any] | None = None, with_tokenizer: bool = False) -> str:
    """Write a tiny random DiffusionGemma checkpoint in the official format (transformers'
    `save_pretrained` of `DiffusionGemmaForBlockDiffusion`, plus `generation_config.json` from a
    `DiffusionGemmaGenerationConfig`); returns the weights' digest.

    Two layers (sliding + full), 4 experts of which 2 routed, a one-layer vision tower (the config
    needs one). The tied embedding is scaled by `embedding_scale` so the tiny model's
    distributions are peaked enough for the entropy-bound sampler to accept several positions.
    Special ids: pad 0, eos 1, bos 2; the last three ids are the image markers. `with_tokenizer`:
    the zoo's character tokenizer is saved beside it (vocabulary 128, its pad/bos/eos ids), so
    text prompts work (the random model's answers are noise).
    """
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, DiffusionGemmaTextConfig
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import DiffusionGemmaGenerationConfig

    pad, eos, bos = 0, 1, 2
    if with_tokenizer:
        from remask.zoo import charset

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
                                  eoi_token_id=vocab_size - 2)
    fork = torch.random.fork_rng()
    with fork:
        torch.manual_seed(seed)
        model = DiffusionGemmaForBlockDiffusion(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(embedding_scale)   # tied: the embeddings of encoder and decoder too
    model.generation_config = DiffusionGemmaGenerationConfig(**{"pad_token_id": pad, "eos_token_id": eos,
                                                                "bos_token_id": bos, **(generation or {})})
    model.save_pretrained(path)
    if with_tokenizer:
        charset.build_tokenizer().save_pretrained(path)
    return state_dict_digest(model.state_dict())


SDAR_DEFAULTS: dict[str, Any] = {
    "architectures": ["SDARForCausalLM"],
    "auto_map": {"AutoConfig": "configuration_sdar.SDARConfig", "AutoModel": "modeling_sdar.SDARModel",
                 "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"},
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 298, "eos_token_id": 298,
    "block_size": 4, "mask_token_id": 299, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64,
    "initializer_range": 0.02, "intermediate_size": 128, "max_position_embeddings": 512, "max_window_layers": 2,
    "model_type": "sdar", "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "float32", "use_cache": False, "use_sliding_window": False,
    "vocab_size": 300, "transformers_version": "4.52.4",
    # keys of the official config.json that its remote code reads (fuse_cross_entropy) or carries
    "fuse_cross_entropy": True, "debug": False, "ep_size": 1, "micro_forward": False, "skip_checkpoint": False,
    "use_deepep": False,
}


def write_tiny_sdar(path: str, *, seed: int = 0, logit_scale: float = 40.0, **overrides: Any) -> str:
    """Write a tiny random SDAR checkpoint in the official layout (`config.json` with the release's
    keys and `auto_map`, `model.safetensors` with its parameter names, `generation_config.json`);
    returns the weights' digest. Weights are drawn from a seeded generator (normal, std 0.02; the
    LM head scaled by `logit_scale` so that predictions are peaked enough to exercise thresholds)."""
    from .sdar import SDARConfig, SDARForCausalLM, SDARMoeConfig, SDARMoeForCausalLM

    config = {**SDAR_DEFAULTS, **overrides}
    init = {k: v for k, v in config.items() if k not in ("architectures", "auto_map", "model_type", "torch_dtype",
                                                          "transformers_version", "fuse_cross_entropy", "debug",
                                                          "ep_size", "micro_forward", "skip_checkpoint", "use_deepep")}
    config_class, model_class = ((SDARMoeConfig, SDARMoeForCausalLM) if config["model_type"] == "sdar_moe"
                                 else (SDARConfig, SDARForCausalLM))
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_class(config_class(**init))
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
        # a trained model practically never predicts the mask token (it is never a target): logit 0
        # among logits of spread ~logit_scale·0.8 makes it negligible, as there
        model.lm_head.weight[config["mask_token_id"]].zero_()
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
                  "transformers_version": config["transformers_version"]}
    return _save(path, config, sd, 1, {"generation_config.json": generation})


SDAR_MOE_DEFAULTS: dict[str, Any] = {
    **SDAR_DEFAULTS,
    "architectures": ["SDARMoeForCausalLM"], "model_type": "sdar_moe",
    "auto_map": {"AutoConfig": "configuration_sdar_moe.SDARMoeConfig", "AutoModel": "modeling_sdar_moe.SDARMoeModel",
                 "AutoModelForCausalLM": "modeling_sdar_moe.SDARMoeForCausalLM"},
    "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "norm_topk_prob": True, "output_router_logits": False, "router_aux_loss_coef": 0.001,
}


def write_tiny_sdar_moe(path: str, *, seed: int = 0, logit_scale: float = 40.0, **overrides: Any) -> str:
    """`write_tiny_sdar` for SDAR-MoE (Qwen3-MoE keys and names: `mlp.gate`, `mlp.experts.N.*`)."""
    return write_tiny_sdar(path, seed=seed, logit_scale=logit_scale, **{**SDAR_MOE_DEFAULTS, **overrides})


LLADA2_DEFAULTS: dict[str, Any] = {
    # Keys of the released LLaDA2.0-mini / 2.1-mini config.json, shapes shrunk; the special ids (the
    # release's come from its tokenizer, outside a 300-token vocabulary) are set in the config.
    "architectures": ["LLaDA2MoeModelLM"],
    "auto_map": {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                 "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
                 "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"},
    "attention_dropout": 0.0, "embedding_dropout": 0.0, "first_k_dense_replace": 1, "head_dim": 16,
    "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128,
    "max_position_embeddings": 512, "max_window_layers": 28, "model_type": "llada2_moe",
    "moe_intermediate_size": 32, "moe_router_enable_expert_bias": True, "n_group": 2, "norm_head": False,
    "norm_softmax": False, "norm_topk_prob": True, "num_attention_heads": 4, "num_experts": 8,
    "num_experts_per_tok": 2, "num_hidden_layers": 3, "num_key_value_heads": 2, "num_shared_experts": 1,
    "output_dropout": 0.0, "output_router_logits": False, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 600000, "rotary_dim": 8, "routed_scaling_factor": 2.5,
    "router_dtype": "fp32", "score_function": "sigmoid", "tie_word_embeddings": False, "topk_group": 1,
    "torch_dtype": "float32", "transformers_version": "4.52.3", "use_bias": False, "use_cache": False,
    "use_qk_norm": True, "use_qkv_bias": False, "use_rmsnorm": True, "use_sliding_window": False,
    "using_split_qkv_in_self_attention": False, "vocab_size": 300,
    "pad_token_id": 298, "eos_token_id": 298, "mask_token_id": 299,
}


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
    init = {k: v for k, v in config.items() if k not in ("architectures", "auto_map", "model_type", "torch_dtype",
                                                          "transformers_version")}
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LLaDA2MoeModelLM(LLaDA2MoeConfig(**init))
        with torch.no_grad():
            model.lm_head.weight.mul_(logit_scale)
            # a trained model practically never predicts the mask token (never a target): logit 0
            model.lm_head.weight[config["mask_token_id"]].zero_()
            for name, buffer in model.named_buffers():
                if name.endswith("mlp.gate.expert_bias"):
                    buffer.copy_(torch.randn(buffer.shape) * 0.05)
            for name, param in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    param.mul_(router_scale)
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    generation = {"bos_token_id": None, "eos_token_id": config["eos_token_id"], "pad_token_id": config["pad_token_id"],
                  "transformers_version": config["transformers_version"]}
    return _save(path, config, sd, 1, {"generation_config.json": generation})


FAST_DLLM_V2_DEFAULTS: dict[str, Any] = {
    # Keys of the released Fast_dLLM_v2_7B config.json (Qwen2.5 backbone), shapes shrunk; the special
    # ids moved inside a 300-token vocabulary. `mask_token_id` is remask's addition (the release's code
    # uses the constant 151665 and ignores the key), so remask's spec finds the tiny mask id.
    "architectures": ["Fast_dLLM_QwenForCausalLM"],
    "auto_map": {"AutoConfig": "configuration.Fast_dLLM_QwenConfig", "AutoModel": "modeling.Fast_dLLM_QwenModel",
                 "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM"},
    "attention_dropout": 0.0, "bd_size": 8, "bos_token_id": 297, "conplemenrary_mask": True, "eos_token_id": 298,
    "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128,
    "layer_types": ["full_attention", "full_attention"], "mask_token_id": 299, "max_position_embeddings": 512,
    "max_window_layers": 2, "model_type": "Fast_dLLM_Qwen", "num_attention_heads": 4, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "pad_token_id": 298, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000.0,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "float32", "transformers_version": "4.53.1",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 300,
}


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
    with torch.random.fork_rng():
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
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": [config["eos_token_id"], config["bos_token_id"]],
                  "pad_token_id": config["bos_token_id"], "transformers_version": config["transformers_version"]}
    return _save(path, config, sd, 1, {"generation_config.json": generation})

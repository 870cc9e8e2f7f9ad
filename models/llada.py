"""LLaDA, implemented here so that official checkpoints load through current transformers.

Parameter names equal the official checkpoint's (`model.transformer.wte`,
`model.transformer.blocks.{i}.{attn_norm, ff_norm, q_proj, k_proj, v_proj, attn_out, ff_proj,
up_proj, ff_out}`, `model.transformer.ln_f`, `model.transformer.ff_out`), and the config accepts
the official `config.json` keys, so `AutoModel.from_pretrained(dir)` of a released LLaDA directory
works without `trust_remote_code` once `remask.models` is imported.

Differences from the official remote code: the forward takes a KV cache (post-RoPE keys, append
or overwrite a range; the official forward asserts that no cache is used), explicit
`position_ids`, and `cache_position`. Without a cache the arithmetic is the reference's.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configs import LLaDAConfig
from .hf_compat import lm_output
from .layers import ForwardPositions, KVCache, RMSNorm, forward_positions, init_weights, rotary_self_attention
from .registry import Family, register_family
from .spec import ModelSpec, config_id, padding_mask_inputs


class LLaDABlock(nn.Module):
    """The official `LLaDALlamaBlock`: pre-norm attention and SiLU-gated MLP."""

    def __init__(self, config: LLaDAConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.rope_full_precision = config.rope_full_precision
        d, kv, hidden = config.d_model, config.effective_n_kv_heads * config.head_dim, config.mlp_hidden
        qkv_bias = config.include_bias or config.include_qkv_bias
        self.attn_norm = RMSNorm(d, config.rms_norm_eps)
        self.ff_norm = RMSNorm(d, config.rms_norm_eps)
        self.q_proj = nn.Linear(d, d, bias=qkv_bias)
        self.k_proj = nn.Linear(d, kv, bias=qkv_bias)
        self.v_proj = nn.Linear(d, kv, bias=qkv_bias)
        self.attn_out = nn.Linear(d, d, bias=config.include_bias)
        self.ff_proj = nn.Linear(d, hidden, bias=config.include_bias)  # SiLU gate
        self.up_proj = nn.Linear(d, hidden, bias=config.include_bias)  # linear branch
        self.ff_out = nn.Linear(hidden, d, bias=config.include_bias)

    def forward(self, x, pos: ForwardPositions, mask) -> torch.Tensor:
        h = self.attn_norm(x)
        att = rotary_self_attention(self.q_proj(h), self.k_proj(h), self.v_proj(h), self.head_dim, pos.cos, pos.sin,
                                    mask, pos.cache, self.layer_idx, pos.cache_start, self.rope_full_precision)
        x = x + self.attn_out(att)
        h = self.ff_norm(x)
        return x + self.ff_out(F.silu(self.ff_proj(h)) * self.up_proj(h))


class LLaDABackbone(nn.Module):
    def __init__(self, config: LLaDAConfig):
        super().__init__()
        self.config = config
        modules = {
            "wte": nn.Embedding(config.padded_vocab_size, config.d_model),
            "blocks": nn.ModuleList([LLaDABlock(config, i) for i in range(config.n_layers)]),
            "ln_f": RMSNorm(config.d_model, config.rms_norm_eps),
        }
        if not config.weight_tying:
            modules["ff_out"] = nn.Linear(config.d_model, config.padded_vocab_size, bias=config.include_bias)
        self.transformer = nn.ModuleDict(modules)


def padding_bias(attention_mask: torch.Tensor | None, q_len: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The official LLaDA padding bias: None unless some key is padded, else an additive
    `[B, 1, q_len, k_len]` bias with `finfo(float32).min` on padded keys (query rows are not masked)."""
    if attention_mask is None or not (attention_mask == 0).any():
        return None
    B, k_len = attention_mask.shape
    keep = attention_mask.to(torch.float32)[:, None, None, :]
    bias = torch.zeros((1, 1, q_len, k_len), dtype=torch.float32, device=attention_mask.device)
    bias = bias + (1.0 - keep) * torch.finfo(torch.float32).min
    return bias.to(dtype)


class LLaDAModelLM(PreTrainedModel):
    """LLaDA mask predictor: `forward(input_ids, attention_mask)` → `.logits` `[B, L, embedding_size]`."""

    config_class = LLaDAConfig
    base_model_prefix = "model"
    _no_split_modules = ["LLaDABlock"]
    # Tensor parallel (`from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))`
    # under torchrun): Megatron's split — q/k/v and the MLP's inputs by output columns (whole heads
    # per rank), the attention output and the MLP's output by rows (one all-reduce each); the LM
    # head by vocabulary, its logits left sharded (`models/parallel.py`: scoring combines a few
    # numbers per row across ranks). On the model class: the backbone is a plain module.
    _tp_plan = {
        "model.transformer.blocks.*.q_proj": "colwise",
        "model.transformer.blocks.*.k_proj": "colwise",
        "model.transformer.blocks.*.v_proj": "colwise",
        "model.transformer.blocks.*.attn_out": "rowwise",
        "model.transformer.blocks.*.ff_proj": "colwise",
        "model.transformer.blocks.*.up_proj": "colwise",
        "model.transformer.blocks.*.ff_out": "rowwise",
        "model.transformer.ff_out": "vocab_parallel",
    }
    _supports_sdpa = True

    def __init__(self, config: LLaDAConfig):
        config.validate_architecture()
        super().__init__(config)
        self.model = LLaDABackbone(config)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        init_weights(module, self.config.init_std)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.transformer.wte

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.transformer.wte = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: KVCache | None = None,
        use_cache: bool | None = None,
        cache_position: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        attention_bias: torch.Tensor | None = None,
        output_hidden_states: bool = False,
        return_dict: bool = True,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Bidirectional forward.

        input_ids `[B, L]`; attention_mask `[B, K]` (1 = real token, 0 = padding; K = cached + new
        length) or None; position_ids `[B, L]` (default: absolute positions `cache_position`);
        past_key_values: a `KVCache` to read and write (`use_cache=True` creates one);
        cache_position `[L]`: absolute positions of the inputs — where the cache is written (appended
        when it starts at the cache length, overwritten in place when it starts earlier).
        """
        cfg = self.config
        x = self.model.transformer.wte(input_ids) if inputs_embeds is None else inputs_embeds
        if cfg.input_emb_norm:
            x = x * (cfg.d_model ** 0.5)
        B, L = x.shape[:2]
        pos = forward_positions(B, L, x.device, cfg.head_dim, cfg.rope_theta, past_key_values, use_cache,
                                cache_position, position_ids)
        mask = llada_attend_mask(dict(attention_mask=attention_mask, attention_bias=attention_bias), L, pos.k_len,
                                 x.dtype)
        hidden_states = []
        for block in self.model.transformer.blocks:
            if output_hidden_states:
                hidden_states.append(x)
            x = block(x, pos, mask)
        x = self.model.transformer.ln_f(x)
        if output_hidden_states:
            hidden_states.append(x)
        if cfg.weight_tying:
            logits = F.linear(x, self.model.transformer.wte.weight, None)
        else:
            logits = self.model.transformer.ff_out(x)
        if cfg.scale_logits:
            logits = logits * (1 / math.sqrt(cfg.d_model))
        return lm_output(
            logits=logits,
            cache=pos.cache,
            hidden_states=tuple(hidden_states) if output_hidden_states else None,
        )


def llada_attend_mask(inputs: dict, q_len: int, k_len: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The mask the layers attend with, from the forward's `attention_mask` (2-D padding) and
    `attention_bias` (bool or additive, `[B, 1, L, K]`)."""
    mask = padding_bias(inputs.get("attention_mask"), q_len, dtype)
    if mask is not None and mask.shape[-1] != k_len:
        raise ValueError(f"attention_mask covers {mask.shape[-1]} keys, but attention runs over {k_len}")
    attention_bias = inputs.get("attention_bias")
    if attention_bias is not None:
        if attention_bias.dtype == torch.bool:
            attention_bias = torch.zeros_like(attention_bias, dtype=dtype).masked_fill(
                ~attention_bias, torch.finfo(dtype).min)
        mask = attention_bias.to(dtype) if mask is None else mask + attention_bias.to(dtype)
    return mask


def llada_layers(model: LLaDAModelLM) -> nn.ModuleList:
    """The decoder blocks, for a driver's per-layer work (`ForwardRequest.layers`: Elastic-Cache)."""
    return model.model.transformer.blocks


def llada_spec(config: LLaDAConfig) -> ModelSpec:
    """LLaDA: a mask predictor without logit shift; the official ids as defaults."""
    return ModelSpec(
        kind="llada",
        mask_id=config_id(config, "mask_token_id", 126336),
        eos_id=config_id(config, "eos_token_id", 126081),
        pad_id=config_id(config, "pad_token_id", 126081),
        eot_id=config_id(config, "eot_token_id", 126348),
        vocab_size=getattr(config, "embedding_size", None) or getattr(config, "vocab_size", None),
        max_length=getattr(config, "max_sequence_length", None),
        logit_shift=False,
        attention="bidirectional",
        trained_gen_length=getattr(config, "trained_gen_length", None),
        segmented=True,       # attention through `cache.attend`, positions from `position_ids`
        attend_mask=llada_attend_mask,
        layers=llada_layers,
        _inputs=padding_mask_inputs,   # the 2-D padding mask; RoPE positions stay absolute (0..L-1)
    )


register_family(Family("llada", llada_spec, LLaDAConfig, LLaDAModelLM,
                       auto_classes=("AutoModel", "AutoModelForCausalLM")))

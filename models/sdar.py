"""SDAR (JetAstra/SDAR, `model_type: "sdar"`): a Qwen3 backbone trained for block diffusion —
causal across blocks of `block_size` tokens, bidirectional inside a block.

`SDARConfig` reads the official `config.json` keys and `SDARForCausalLM` uses the official parameter
names (Qwen3's: `model.layers.N.self_attn.{q,k,v,o}_proj`, `q_norm`, `k_norm`, `mlp.{gate,up,down}_proj`,
`input_layernorm`, `post_attention_layernorm`, `model.norm`, `lm_head`), so an official checkpoint
folder loads with `AutoModelForCausalLM.from_pretrained` without `trust_remote_code`.

The inference path follows the official `modeling_sdar.py` operation for operation: RMSNorm as
flash-attn's `rms_norm_fn` computes it (float32, `x · (1/√(mean x² + ε)) · w`), q/k RMSNorm per
head, RoPE in float32 from a matmul of the inverse frequencies with the positions, attention
without a mask when the mask is all ones (the official code calls flash-attn there) and SDPA with
the boolean mask otherwise. The cache follows the official `store_kv` convention: `store_kv=True`
appends the block's keys and values to the cache, `store_kv=False` attends over the cache and the
block without storing anything (the block is still being denoised).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configs import SDARConfig, SDARMoeConfig
from .hf_compat import lm_output
from .registry import Family, register_family
from .spec import ModelSpec, config_id, padding_mask_inputs


class SDARRMSNorm(nn.Module):
    """flash-attn's `rms_norm_fn` (which the official code calls): float32 math, `x · rstd · w`."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.float()
        rstd = 1 / torch.sqrt(x.square().mean(dim=-1, keepdim=True) + self.variance_epsilon)
        return (x * rstd * self.weight.float()).to(hidden_states.dtype)


class SDARMLP(nn.Module):
    def __init__(self, config: SDARConfig, intermediate_size: int | None = None):
        super().__init__()
        intermediate_size = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class SDARMoeSparseMoeBlock(nn.Module):
    """Qwen3-MoE's sparse block with the checkpoints' names (`gate`, `experts.N.{gate,up,down}_proj`):
    softmax router in float32, top-k, renormalised when `norm_topk_prob`; each expert runs on its
    tokens and adds its weighted output in expert order (the reference implementation's order)."""

    def __init__(self, config: SDARMoeConfig):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = (config.num_experts, config.num_experts_per_tok,
                                                             config.norm_topk_prob)
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList([SDARMLP(config, config.moe_intermediate_size) for _ in range(config.num_experts)])

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dim() == 3 and hidden_states.shape[0] > 1:
            # Row by row: an expert's GEMM over the tokens routed to it would otherwise have a shape
            # (and a rounding) that depends on the other rows of the batch.
            return torch.cat([self(hidden_states[b:b + 1]) for b in range(hidden_states.shape[0])])
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, shape[-1])
        routing = F.softmax(self.gate(flat), dim=-1, dtype=torch.float)
        weights, experts = torch.topk(routing, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(flat.dtype)
        out = torch.zeros_like(flat)
        hits = F.one_hot(experts, num_classes=self.num_experts).permute(2, 1, 0)   # [E, k, tokens]
        for expert in torch.nonzero(hits.sum(dim=(1, 2))).flatten().tolist():
            slot, token = torch.where(hits[expert])
            y = self.experts[expert](flat[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out.reshape(shape)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class SDARRotaryEmbedding(nn.Module):
    """RoPE tables as the official code computes them (transformers' default rope init, float32).
    The inverse frequencies are computed at each call, not kept in a buffer: a non-persistent
    buffer is not restored by `from_pretrained`'s meta-device loading."""

    def __init__(self, config: SDARConfig):
        super().__init__()
        self.dim, self.base = config.head_dim, float(config.rope_theta)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        arange = torch.arange(0, self.dim, 2, dtype=torch.int64, device=x.device).float()
        inv_freq = 1.0 / (self.base ** (arange / self.dim))
        inv_freq = inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        freqs = (inv_freq @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _cached_layer(cache: Cache, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The stored keys and values of one layer, or None while it has none."""
    if hasattr(cache, "cached"):   # remask.caches.BlockKVCache: the engine's paged block cache
        return cache.cached(layer_idx)
    layers = getattr(cache, "layers", None)
    if layers is not None:   # transformers 5: per-layer objects
        if layer_idx >= len(layers) or getattr(layers[layer_idx], "keys", None) is None:
            return None
        return layers[layer_idx].keys, layers[layer_idx].values
    return cache[layer_idx] if len(cache) > layer_idx else None


class SDARAttention(nn.Module):
    def __init__(self, config: SDARConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = SDARRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = SDARRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None, past_key_values: Cache | None, store_kv: bool) -> torch.Tensor:
        bsz, q_len = hidden_states.shape[:2]
        shape = (bsz, q_len, -1, self.head_dim)
        query = self.q_norm(self.q_proj(hidden_states).view(shape)).transpose(1, 2)
        key = self.k_norm(self.k_proj(hidden_states).view(shape)).transpose(1, 2)
        value = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        cos, sin = position_embeddings
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        query, key = query * cos + rotate_half(query) * sin, key * cos + rotate_half(key) * sin
        rows_attend = getattr(past_key_values, "attend", None)
        if rows_attend is not None:
            # remask.caches.BlockBatch: a forward shared by requests at different blocks; each row
            # attends over its own cache (and stores, if its block is finished) as alone
            out = rows_attend(self.layer_idx, query, key, value, self._full_attention)
            return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))
        if past_key_values is not None and store_kv:
            key, value = past_key_values.update(key, value, self.layer_idx)
        elif past_key_values is not None:
            # the official "retrieve, do not store": attend over the cache and this block
            cached = _cached_layer(past_key_values, self.layer_idx)
            if cached is not None:
                key, value = torch.cat([cached[0], key], dim=-2), torch.cat([cached[1], value], dim=-2)
        mask = attention_mask.bool() if attention_mask is not None else None
        if mask is None or bool(mask.all()):
            out = self._full_attention(query, key, value)
        else:
            if mask.dim() == 3:
                mask = mask[:, None]
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=False,
                                                 scale=self.scaling, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))

    def _full_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        # the official code calls flash_attn_func(causal=False) here: full attention, no mask
        key = key.repeat_interleave(self.num_key_value_groups, dim=1)   # flash-attn's GQA, spelled out
        value = value.repeat_interleave(self.num_key_value_groups, dim=1)
        return F.scaled_dot_product_attention(query, key, value, is_causal=False, scale=self.scaling)


class SDARDecoderLayer(nn.Module):
    def __init__(self, config: SDARConfig, layer_idx: int):
        super().__init__()
        self.self_attn = SDARAttention(config, layer_idx)
        sparse = isinstance(config, SDARMoeConfig) and config.is_sparse(layer_idx)
        self.mlp = SDARMoeSparseMoeBlock(config) if sparse else SDARMLP(config)
        self.input_layernorm = SDARRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = SDARRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, store_kv):
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), position_embeddings,
                                                       attention_mask, past_key_values, store_kv)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class SDARBackbone(nn.Module):
    def __init__(self, config: SDARConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([SDARDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = SDARRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = SDARRotaryEmbedding(config)


class SDARForCausalLM(PreTrainedModel):
    """SDAR: `forward(input_ids, attention_mask, position_ids, past_key_values, store_kv)` →
    `.logits` `[B, L, V]` (unshifted: row i scores position i). `attention_mask`: the official
    block-diffusion mask (`[B, L, K]` or `[B, 1, L, K]`, ones where a query attends; all ones
    inside the current block and its cached prefix); None attends everywhere."""

    config_class = SDARConfig
    base_model_prefix = "model"
    _no_split_modules = ["SDARDecoderLayer"]
    _supports_sdpa = True

    def __init__(self, config: SDARConfig):
        config.validate_architecture()
        super().__init__(config)
        self.model = SDARBackbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, SDARRMSNorm):
            nn.init.ones_(module.weight)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, past_key_values: Cache | None = None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None, store_kv: bool = False,
                logits_to_keep: int | torch.Tensor = 0, **kwargs: Any) -> CausalLMOutputWithPast:
        unexpected = sorted(k for k, v in kwargs.items() if v is not None and k not in (
            "output_attentions", "output_hidden_states", "return_dict", "cache_position"))
        if unexpected:
            raise TypeError(f"SDARForCausalLM.forward got unexpected arguments {unexpected}")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        hidden = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        if position_ids is None:
            seen = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = torch.arange(seen, seen + hidden.shape[1], device=hidden.device)[None]
        position_embeddings = self.model.rotary_emb(hidden, position_ids)
        for layer in self.model.layers:
            hidden = layer(hidden, position_embeddings, attention_mask, past_key_values, store_kv)
        hidden = self.model.norm(hidden)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return lm_output(logits=self.lm_head(hidden[:, keep, :]), cache=past_key_values)


def sdar_spec(config: SDARConfig) -> ModelSpec:
    """SDAR: a mask model with block-causal attention; blocks of `config.block_size`."""
    return ModelSpec(
        kind="sdar",
        mask_id=config_id(config, "mask_token_id", 151669),
        eos_id=config_id(config, "eos_token_id", 151643),
        pad_id=config_id(config, "pad_token_id", None) if getattr(config, "pad_token_id", None) is not None
        else config_id(config, "eos_token_id", 151643),
        vocab_size=config.vocab_size,
        max_length=config.max_position_embeddings,
        logit_shift=False,
        attention="block-causal",
        trained_gen_length=getattr(config, "trained_gen_length", None),
        block_length=config.block_size,
        _inputs=padding_mask_inputs,
    )


class SDARMoeForCausalLM(SDARForCausalLM):
    """SDAR-MoE: `SDARForCausalLM` whose feed-forward layers are Qwen3-MoE sparse blocks where
    `SDARMoeConfig.is_sparse` says so (the same attention, cache and decoding)."""

    config_class = SDARMoeConfig


register_family(Family("sdar_moe", sdar_spec, SDARMoeConfig, SDARMoeForCausalLM,
                       auto_classes=("AutoModel", "AutoModelForCausalLM"),
                       generate="remask.compat.sdar:block_diffusion_generate",
                       engine_decoder="remask.diffusion.families.sdar:engine_decoder"))
register_family(Family("sdar", sdar_spec, SDARConfig, SDARForCausalLM,
                       auto_classes=("AutoModel", "AutoModelForCausalLM"),
                       generate="remask.compat.sdar:block_diffusion_generate",
                       engine_decoder="remask.diffusion.families.sdar:engine_decoder"))

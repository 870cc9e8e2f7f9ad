"""LLaDA2.0 / LLaDA2.1 (inclusionAI, `model_type: "llada2_moe"`): a mixture-of-experts block
diffusion model — causal across blocks of 32 tokens, bidirectional inside one.

`LLaDA2MoeConfig` reads the keys of the official `config.json` (defaults: LLaDA2.0-mini's values)
and `LLaDA2MoeModelLM` uses the official parameter names (`model.word_embeddings`,
`model.layers.N.attention.{query_key_value, query_layernorm, key_layernorm, dense}`,
`mlp.{gate_proj, up_proj, down_proj}` in the first `first_k_dense_replace` layers,
`mlp.gate.{weight, expert_bias}`, `mlp.experts.E.{gate,up,down}_proj`, `mlp.shared_experts.*` in the
others, `input_layernorm`, `post_attention_layernorm`, `model.norm`, `lm_head`), so an official
checkpoint folder loads with `AutoModelForCausalLM.from_pretrained` without `trust_remote_code`.

The forward follows the official modeling file operation for operation in float32: a fused QKV
projection split into heads, RMSNorm on every query and key head (always: the official code builds
these norms whatever `use_qk_norm` says), RoPE on the first `head_dim · partial_rotary_factor`
channels only, grouped-query attention, then a dense SwiGLU MLP (first layers) or the MoE block:
sigmoid router scores in float32, `expert_bias` added for the choice only, group-limited top-k
(groups ranked by the sum of their two best scores), the chosen experts' *unbiased* scores
normalised and scaled by `routed_scaling_factor`, plus the shared expert. The logits come back in
float32.

Attention masks: a 4-D `[B, 1, Q, K]` mask is read as the official generators pass it — additive
(0 where attended, −inf elsewhere: LLaDA2.0's bf16 mask) or 0/1 (LLaDA2.1's); a bool mask is True
where attended; a 2-D `[B, K]` mask is a padding mask. None attends everywhere. The KV cache follows
the `store_kv` convention of remask's SDAR model: `store_kv=True` appends this forward's keys and
values to the cache, `store_kv=False` attends over the cache and the current block without storing
(the block is still being denoised).
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
from transformers.models.llama.modeling_llama import LlamaRMSNorm, repeat_kv, rotate_half

from .configs import LLaDA2MoeConfig
from .hf_compat import lm_output
from .registry import Family, register_family
from .sdar import _cached_layer
from .spec import ModelSpec, config_id, padding_mask_inputs

# The released checkpoints' special ids (LLaDA2.0-mini / 2.1-mini tokenizer).
LLADA2_MASK_ID = 156895
LLADA2_EOS_ID = 156892
LLADA2_BLOCK_LENGTH = 32


class LLaDA2MoeRotaryEmbedding(nn.Module):
    """RoPE tables over the rotary channels only (`head_dim · partial_rotary_factor`), float32, as
    transformers' default rope init computes them. The inverse frequencies are recomputed at each
    call: a non-persistent buffer is not restored by `from_pretrained`'s meta-device loading."""

    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__()
        self.dim, self.base = config.rope_dim, float(config.rope_theta)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        arange = torch.arange(0, self.dim, 2, dtype=torch.int64, device=x.device).float()
        inv_freq = 1.0 / (self.base ** (arange / self.dim))
        inv_freq = inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1)
        freqs = (inv_freq @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def apply_partial_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on the first `cos.shape[-1]` channels of each head; the rest pass through."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rot = cos.shape[-1]

    def rotate(t: torch.Tensor) -> torch.Tensor:
        t_rot, t_pass = t[..., :rot], t[..., rot:]
        return torch.cat([t_rot * cos + rotate_half(t_rot) * sin, t_pass], dim=-1)

    return rotate(q), rotate(k)


class LLaDA2MoeMLP(nn.Module):
    def __init__(self, config: LLaDA2MoeConfig, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LLaDA2MoeGate(nn.Module):
    """The official router. Unlike deepseek_v3's (same idea), masked-out groups get −inf rather than
    0 (a biased score may be negative) and the top-k keeps torch's sorted order, which fixes the
    order the experts' outputs are summed in — so it is spelled out here."""

    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__()
        self.top_k, self.num_experts = config.num_experts_per_tok, config.num_experts
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty((self.num_experts, config.hidden_size)))
        self.register_buffer("expert_bias", torch.zeros(self.num_experts))   # persistent: in the checkpoint

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert indices `[T, k]`, their weights `[T, k]`) for hidden states `[T, H]`."""
        logits = F.linear(hidden_states.float(), self.weight.float())
        scores = torch.sigmoid(logits)
        choice = scores + self.expert_bias
        tokens = choice.shape[0]
        group_scores = choice.view(tokens, self.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        expert_mask = group_mask.unsqueeze(-1).expand(tokens, self.n_group, self.num_experts // self.n_group)
        expert_mask = expert_mask.reshape(tokens, -1)
        topk_idx = torch.topk(choice.masked_fill(~expert_mask.bool(), float("-inf")), k=self.top_k, dim=-1)[1]
        weight = torch.gather(scores, 1, topk_idx)
        if self.top_k > 1:   # the official code normalises whenever k > 1 (norm_topk_prob is not read)
            weight = weight / (weight.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_idx, weight * self.routed_scaling_factor


class LLaDA2MoeSparseMoeBlock(nn.Module):
    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__()
        self.gate = LLaDA2MoeGate(config)
        self.experts = nn.ModuleList([LLaDA2MoeMLP(config, config.moe_intermediate_size)
                                      for _ in range(config.num_experts)])
        self.shared_experts = None if config.num_shared_experts is None else LLaDA2MoeMLP(
            config, config.moe_intermediate_size * config.num_shared_experts)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dim() == 3 and hidden_states.shape[0] > 1:
            # Row by row: an expert's GEMM over the tokens routed to it would otherwise have a shape
            # (and a rounding) that depends on the other rows of the batch.
            return torch.cat([self(hidden_states[b:b + 1]) for b in range(hidden_states.shape[0])])
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        topk_idx, topk_weight = self.gate(x)
        # each expert runs once on all its tokens; the weighted sum runs over the k choices in the
        # router's order, as the official `moe_infer` does
        per_choice = x.new_zeros((*topk_idx.shape, shape[-1]))
        for expert_id in topk_idx.unique().tolist():
            rows, slots = (topk_idx == expert_id).nonzero(as_tuple=True)
            per_choice[rows, slots] = self.experts[expert_id](x[rows])
        y = (per_choice.to(topk_weight.dtype) * topk_weight.unsqueeze(-1)).sum(dim=1).to(x.dtype).view(shape)
        if self.shared_experts is not None:
            y = y + self.shared_experts(hidden_states)
        return y


def _attend_mask(attention_mask: torch.Tensor | None, q_len: int, k_len: int) -> torch.Tensor | None:
    """A boolean `[B, 1, Q, K]` mask (True: attended) from any mask the official generators pass,
    or None when every query attends to every key."""
    if attention_mask is None:
        return None
    mask = attention_mask
    if mask.dim() == 2:   # padding mask over the keys
        mask = mask[:, None, None, :].bool().expand(-1, 1, q_len, -1)
    elif mask.dim() == 3:
        mask = mask[:, None]
    if mask.dtype != torch.bool:
        # additive (0 attended, −inf or a large negative masked) or 0/1; an all-zero float mask is
        # additive (a mask that attends nowhere would make every row NaN)
        additive = bool((mask < 0).any()) or not bool(mask.any())
        mask = mask == 0 if additive else mask != 0
    if tuple(mask.shape[-2:]) != (q_len, k_len):
        raise ValueError(f"attention_mask covers {tuple(mask.shape[-2:])} (queries, keys), the forward has "
                         f"({q_len}, {k_len})")
    return None if bool(mask.all()) else mask


class LLaDA2MoeAttention(nn.Module):
    def __init__(self, config: LLaDA2MoeConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.query_key_value = nn.Linear(config.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim,
                                         bias=config.use_qkv_bias)
        self.query_layernorm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.key_layernorm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.dense = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.use_bias)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None, past_key_values: Cache | None, store_kv: bool) -> torch.Tensor:
        bsz, q_len = hidden_states.shape[:2]
        qkv = self.query_key_value(hidden_states).view(bsz, q_len, -1, self.head_dim)
        query, key, value = (t.transpose(1, 2) for t in qkv.split(
            [self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=-2))
        query, key = self.query_layernorm(query), self.key_layernorm(key)
        query, key = apply_partial_rotary(query, key, *position_embeddings)
        groups = self.num_heads // self.num_kv_heads
        rows_attend = getattr(past_key_values, "attend", None)
        if rows_attend is not None:
            # remask.caches.BlockBatch: requests at different blocks in one forward, each row over
            # its own cache (storing if its block is finished), as its own forward would
            out = rows_attend(self.layer_idx, query, key, value, lambda q, k, v: F.scaled_dot_product_attention(
                q, repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=None, is_causal=False))
            return self.dense(out.transpose(1, 2).reshape(bsz, q_len, -1))
        if past_key_values is not None and store_kv:
            key, value = past_key_values.update(key, value, self.layer_idx)
        elif past_key_values is not None:
            # "retrieve, do not store": attend over the cache and this block
            cached = _cached_layer(past_key_values, self.layer_idx)
            if cached is not None:
                key, value = torch.cat([cached[0], key], dim=-2), torch.cat([cached[1], value], dim=-2)
        mask = _attend_mask(attention_mask, q_len, key.shape[-2])
        out = F.scaled_dot_product_attention(query, repeat_kv(key, groups), repeat_kv(value, groups),
                                             attn_mask=mask, is_causal=False)
        return self.dense(out.transpose(1, 2).reshape(bsz, q_len, -1))


class LLaDA2MoeDecoderLayer(nn.Module):
    def __init__(self, config: LLaDA2MoeConfig, layer_idx: int):
        super().__init__()
        self.attention = LLaDA2MoeAttention(config, layer_idx)
        dense = config.num_experts is None or layer_idx < config.first_k_dense_replace
        self.mlp = LLaDA2MoeMLP(config, config.intermediate_size) if dense else LLaDA2MoeSparseMoeBlock(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, store_kv):
        hidden_states = hidden_states + self.attention(self.input_layernorm(hidden_states), position_embeddings,
                                                       attention_mask, past_key_values, store_kv)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class LLaDA2MoeBackbone(nn.Module):
    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([LLaDA2MoeDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LLaDA2MoeRotaryEmbedding(config)


class LLaDA2MoeModelLM(PreTrainedModel):
    """LLaDA2: `forward(input_ids, attention_mask, position_ids, past_key_values, store_kv)` →
    `.logits` `[B, L, V]` float32 (unshifted: row i scores position i)."""

    config_class = LLaDA2MoeConfig
    base_model_prefix = "model"
    _no_split_modules = ["LLaDA2MoeDecoderLayer"]
    _supports_sdpa = True

    def __init__(self, config: LLaDA2MoeConfig):
        config.validate_architecture()
        super().__init__(config)
        self.model = LLaDA2MoeBackbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, LLaDA2MoeGate)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, LLaDA2MoeGate):
                nn.init.zeros_(module.expert_bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, LlamaRMSNorm):
            nn.init.ones_(module.weight)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.word_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.word_embeddings = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, past_key_values: Cache | None = None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None, store_kv: bool = False,
                logits_to_keep: int | torch.Tensor = 0, **kwargs: Any) -> CausalLMOutputWithPast:
        unexpected = sorted(k for k, v in kwargs.items() if v is not None and k not in (
            "output_attentions", "output_hidden_states", "output_router_logits", "return_dict", "cache_position"))
        if unexpected:
            raise TypeError(f"LLaDA2MoeModelLM.forward got unexpected arguments {unexpected}")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        hidden = self.model.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
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
        return lm_output(logits=self.lm_head(hidden[:, keep, :]).float(), cache=past_key_values)


def llada2_spec(config: LLaDA2MoeConfig) -> ModelSpec:
    """LLaDA2: a mask model with block-causal attention over blocks of 32."""
    eos = config_id(config, "eos_token_id", LLADA2_EOS_ID)
    return ModelSpec(
        kind="llada2",
        mask_id=config_id(config, "mask_token_id", LLADA2_MASK_ID),
        eos_id=eos,
        pad_id=config_id(config, "pad_token_id", eos),
        vocab_size=config.vocab_size,
        max_length=config.max_position_embeddings,
        logit_shift=False,
        attention="block-causal",
        trained_gen_length=getattr(config, "trained_gen_length", None),
        block_length=LLADA2_BLOCK_LENGTH,
        _inputs=padding_mask_inputs,
    )


register_family(Family("llada2_moe", llada2_spec, LLaDA2MoeConfig, LLaDA2MoeModelLM,
                       auto_classes=("AutoModel", "AutoModelForCausalLM"),
                       generate="remask.compat.llada2:generate",
                       engine_decoder="remask.diffusion.families.llada2:engine_decoder"))

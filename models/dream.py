"""Dream, implemented here so that official checkpoints load through current transformers.

Qwen2 layout (`model.embed_tokens`, `model.layers.{i}.self_attn.{q,k,v,o}_proj` with q/k/v bias,
`model.layers.{i}.mlp.{gate,up,down}_proj`, `model.layers.{i}.{input,post_attention}_layernorm`,
`model.norm`, `lm_head`), bidirectional attention with an optional 4-D padding mask and
`position_ids`, exactly as the official remote code computes it.

The model returns *unshifted* logits, like the official one: Dream predicts token i from hidden
state i-1, and that shift is applied in one place, `remask.models.spec` (`ModelSpec.logits`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configs import DreamConfig
from .hf_compat import lm_output
from .layers import ForwardPositions, KVCache, RMSNorm, forward_positions, init_weights, rotary_self_attention
from .registry import Family, register_family
from .spec import ModelSpec, config_id, extend_mask


class DreamAttention(nn.Module):
    def __init__(self, config: DreamConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        d, q_dim, kv_dim = config.hidden_size, config.hidden_size, config.num_key_value_heads * config.head_dim
        self.q_proj = nn.Linear(d, q_dim, bias=True)
        self.k_proj = nn.Linear(d, kv_dim, bias=True)
        self.v_proj = nn.Linear(d, kv_dim, bias=True)
        self.o_proj = nn.Linear(q_dim, d, bias=False)

    def forward(self, x, pos: ForwardPositions, mask) -> torch.Tensor:
        # Dream casts the RoPE tables to the model dtype and rotates in it (no float32 upcast).
        out = rotary_self_attention(self.q_proj(x), self.k_proj(x), self.v_proj(x), self.head_dim, pos.cos, pos.sin,
                                    mask, pos.cache, self.layer_idx, pos.cache_start, rope_full_precision=False)
        return self.o_proj(out)


class DreamMLP(nn.Module):
    def __init__(self, config: DreamConfig):
        super().__init__()
        d, inter = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(d, inter, bias=False)
        self.up_proj = nn.Linear(d, inter, bias=False)
        self.down_proj = nn.Linear(inter, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DreamDecoderLayer(nn.Module):
    def __init__(self, config: DreamConfig, layer_idx: int):
        super().__init__()
        self.self_attn = DreamAttention(config, layer_idx)
        self.mlp = DreamMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, pos: ForwardPositions, mask) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), pos, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DreamBaseModel(nn.Module):
    def __init__(self, config: DreamConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DreamDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


def dream_attention_mask(attention_mask, q_len: int, k_len: int) -> torch.Tensor | None:
    """Normalise the masks the official code accepts: None / "full" (attend everywhere), a 4-D
    bool or additive mask (used as is), or a 2-D `[B, k_len]` padding mask, turned into Dream's
    own bool `[B, 1, q_len, k_len]` mask (query valid AND key valid, as `diffusion_generate` builds it)."""
    if attention_mask is None or isinstance(attention_mask, str):
        return None
    if attention_mask.dim() == 4:
        return attention_mask
    if attention_mask.dim() != 2 or attention_mask.shape[-1] != k_len:
        raise ValueError(f"attention_mask must be [B, {k_len}] or 4-D, got shape {tuple(attention_mask.shape)}")
    valid = attention_mask.bool()
    return torch.logical_and(valid[:, None, None, :], valid[:, None, k_len - q_len:, None])


class DreamModel(PreTrainedModel):
    """Dream mask predictor: `forward(input_ids, attention_mask, position_ids)` → unshifted `.logits`."""

    config_class = DreamConfig
    base_model_prefix = "model"
    # Tensor parallel: Qwen2's plan (see LLaDAModelLM), on the model class (the base is a plain module).
    _tp_plan = {
        "model.layers.*.self_attn.q_proj": "colwise",
        "model.layers.*.self_attn.k_proj": "colwise",
        "model.layers.*.self_attn.v_proj": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise",
        "model.layers.*.mlp.gate_proj": "colwise",
        "model.layers.*.mlp.up_proj": "colwise",
        "model.layers.*.mlp.down_proj": "rowwise",
        "lm_head": "vocab_parallel",
    }
    _no_split_modules = ["DreamDecoderLayer"]
    _supports_sdpa = True
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: DreamConfig):
        config.validate_architecture()
        super().__init__(config)
        self.model = DreamBaseModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        init_weights(module, self.config.initializer_range)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask=None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: KVCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        cache_position: torch.LongTensor | None = None,
        output_hidden_states: bool = False,
        return_dict: bool = True,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """input_ids `[B, L]`; attention_mask None / "full" / `[B, K]` / `[B, 1, L, K]`; position_ids
        `[B, L]` (default `cache_position`); past_key_values / cache_position as in `LLaDAModelLM`."""
        cfg = self.config
        x = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, L = x.shape[:2]
        pos = forward_positions(B, L, x.device, cfg.head_dim, cfg.rope_theta, past_key_values, use_cache,
                                cache_position, position_ids)
        mask = dream_attention_mask(attention_mask, L, pos.k_len)
        hidden_states = []
        for layer in self.model.layers:
            if output_hidden_states:
                hidden_states.append(x)
            x = layer(x, pos, mask)
        x = self.model.norm(x)
        if output_hidden_states:
            hidden_states.append(x)
        return lm_output(
            logits=self.lm_head(x),
            cache=pos.cache,
            hidden_states=tuple(hidden_states) if output_hidden_states else None,
        )


def dream_inputs(spec: ModelSpec, attention_mask: torch.Tensor | None, total_len: int) -> dict:
    """Dream's diffusion_generate: with padding, a bool [B, 1, N, N] mask (query valid AND key
    valid) and positions counted over real tokens (pads get position 1); without padding, "full"."""
    if attention_mask is None or not torch.any(attention_mask == 0.0):
        return {"attention_mask": "full"}
    mask = extend_mask(attention_mask, total_len)
    position_ids = mask.long().cumsum(-1) - 1
    position_ids.masked_fill_(mask == 0, 1)
    four_d = torch.logical_and(mask[:, None, None, :].bool(), mask[:, None, :, None].bool())
    return {"attention_mask": four_d, "position_ids": position_ids}


def dream_spec(config: DreamConfig) -> ModelSpec:
    """Dream: a mask predictor whose logits are shifted by one position; the official ids as defaults."""
    return ModelSpec(
        kind="dream",
        mask_id=config_id(config, "mask_token_id", 151666),
        eos_id=config_id(config, "eos_token_id", 151643),
        pad_id=config_id(config, "pad_token_id", 151643),
        eot_id=config_id(config, "eot_token_id", 151645),
        vocab_size=getattr(config, "vocab_size", None),
        max_length=getattr(config, "max_position_embeddings", None),
        logit_shift=True,
        attention="bidirectional",
        trained_gen_length=getattr(config, "trained_gen_length", None),
        segmented=True,       # attention through `cache.attend`, positions from `position_ids`
        attend_mask=lambda inputs, q_len, k_len, dtype: dream_attention_mask(inputs.get("attention_mask"), q_len,
                                                                             k_len),
        _inputs=dream_inputs,
    )


register_family(Family("dream", dream_spec, DreamConfig, DreamModel, auto_classes=("AutoModel", "AutoModelForCausalLM")))

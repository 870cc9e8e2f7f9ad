"""Fast-dLLM v2 (NVIDIA, `model_type: "Fast_dLLM_Qwen"`): Qwen2.5 fine-tuned for block diffusion —
causal across blocks of `bd_size` tokens, bidirectional inside one, with a one-position token
shift (position i is predicted from hidden state i−1, as in the autoregressive base model).

`FastDLLMV2Config` reads the official `config.json` keys (Qwen2's, plus `bd_size` and the official
`"conplemenrary_mask"` flag, spelled as released) and `FastDLLMV2ForCausalLM` uses the official
parameter names (Qwen2's: `model.layers.N.self_attn.{q,k,v}_proj` with biases, `o_proj`,
`mlp.{gate,up,down}_proj`, `input_layernorm`, `post_attention_layernorm`, `model.norm`, `lm_head`),
so an official checkpoint folder loads with `AutoModelForCausalLM.from_pretrained` without
`trust_remote_code`.

The layers are transformers' own Qwen2 blocks (`Qwen2DecoderLayer`, `Qwen2RMSNorm`,
`Qwen2RotaryEmbedding`): the official inference path computes the same arithmetic. What is
Fast-dLLM's own is the attention mask and the two caches, which reach the layers through
`OfficialCacheView` (the object a Qwen2 attention calls `update` on):

- the prefix cache (`past_key_values`): `update_past_key_values=True` appends the forward's keys
  and values; `False` attends over the cache and the forward's tokens without storing anything
  (the block is still being denoised);
- the sub-block cache (`use_block_cache=True`): the first forward of a block stores the block's
  keys and values in `block_past_key_values`; a later forward of a sub-block writes its fresh keys
  and values over positions `[replace_position, replace_position + length)` of it, in place, and
  attends over the prefix cache and the whole (partly stale) block without a mask.

Attention is SDPA, as the official code calls it whatever the configured implementation; the mask
is the official eval mask `q // block_size >= k // block_size` over absolute positions, with
`block_size` the forward's argument (32 unless given — the official decoders pass it only when
storing a block, and remask's do the same).
"""
from __future__ import annotations

import contextvars

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RMSNorm, Qwen2RotaryEmbedding

from .configs import FastDLLMV2Config
from .hf_compat import cache_arg, with_cache_field
from .registry import Family, family_of, register_family, resolve
from .spec import ModelSpec, config_id, padding_mask_inputs

# The official decoders' constants (`generation_functions.py`, `modeling.py` defaults): the
# released config.json declares no mask id, so the code's constant is the fallback.
FAST_DLLM_V2_MASK_ID = 151665
FAST_DLLM_V2_STOP_ID = 151645


def cached_layer(cache: Cache | None, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The stored keys and values of one layer of a DynamicCache, or None while it has none."""
    if cache is None:
        return None
    layers = getattr(cache, "layers", None)
    if layers is not None:   # transformers 5: per-layer objects, possibly allocated before use
        if layer_idx >= len(layers) or getattr(layers[layer_idx], "keys", None) is None:
            return None
        keys = layers[layer_idx].keys
        return None if keys.numel() == 0 else (keys, layers[layer_idx].values)
    return cache[layer_idx] if len(cache) > layer_idx else None


class OfficialCacheView:
    """The official attention's cache rules for one forward, behind the `update(key, value,
    layer_idx)` call a Qwen2 attention makes: first the sub-block cache (store the block, or write
    the sub-block over `replace_position` in place and use the whole block), then the prefix cache
    (append when `update_prefix`, else prepend its contents without storing)."""

    def __init__(self, prefix: Cache | None, update_prefix: bool, block: Cache | None, replace_position: int | None):
        self.prefix, self.update_prefix = prefix, update_prefix
        self.block, self.replace_position = block, replace_position

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        if self.block is not None:
            stored = cached_layer(self.block, layer_idx)
            if stored is None:
                key, value = self.block.update(key, value, layer_idx)
            else:
                block_keys, block_values = stored
                at = self.replace_position or 0
                block_keys[:, :, at:at + key.shape[2]] = key
                block_values[:, :, at:at + value.shape[2]] = value
                key, value = block_keys, block_values
        if self.prefix is not None:
            if self.update_prefix:
                key, value = self.prefix.update(key, value, layer_idx)
            else:
                stored = cached_layer(self.prefix, layer_idx)
                if stored is not None:
                    key, value = torch.cat((stored[0], key), dim=-2), torch.cat((stored[1], value), dim=-2)
        return key, value


def eval_block_mask(query_length: int, block_size: int, cached_length: int,
                    device: torch.device | None = None) -> torch.Tensor:
    """The official inference mask `[Lq, cached + Lq]`: query position q (absolute) attends key k
    when `q // block_size >= k // block_size` (its own block and every earlier one)."""
    q = torch.arange(query_length, device=device) + cached_length
    k = torch.arange(query_length + cached_length, device=device)
    return (q[:, None] // block_size) >= (k[None, :] // block_size)


ROWS_ATTENTION = "remask_fast_dllm_rows"
_ROWS: contextvars.ContextVar["RowBatch | None"] = contextvars.ContextVar("remask_fast_dllm_rows", default=None)


@dataclass(eq=False)
class RowBatch:
    """The cache argument of one forward shared by several requests' whole blocks `[B, L]` (the
    engine's continuous batching): row b attends over `caches[b]` (a prefix cache; appended to when
    `stores[b]`) under its own official block mask (`block_sizes[b]`), exactly as its own forward."""

    caches: list[Cache]
    stores: list[bool]
    block_sizes: list[int]
    masks: list[torch.Tensor] | None = None
    varlen: bool = False   # the engine's varlen_attention: every row in one `varlen_attention_each` call
    plan: Any = None       # (its plan, the same for every layer)


def rows_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The attention of a `RowBatch` forward: per row, the cache rule (`OfficialCacheView`'s
    prefix part) and transformers' SDPA attention with the row's own mask — its alone call; with `varlen`
    (no sliding window) every row's in one `varlen_attention_each` call, under the same masks and scale."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from remask.kernels.varlen_attention import varlen_attention_each

    batch = _ROWS.get()
    rows = [OfficialCacheView(cache, store, None, None).update(key[b:b + 1], value[b:b + 1], module.layer_idx)
            for b, (cache, store) in enumerate(zip(batch.caches, batch.stores))]
    if batch.varlen and kwargs.get("sliding_window") is None:
        outputs, batch.plan = varlen_attention_each(
            [q.transpose(0, 1) for q in query], [k[0].transpose(0, 1) for k, _ in rows],
            [v[0].transpose(0, 1) for _, v in rows], batch.masks, batch.plan, kwargs.get("scaling"))
        return torch.stack(outputs), None
    return torch.cat([sdpa_attention_forward(module, query[b:b + 1], k, v, batch.masks[b], **kwargs)[0]
                      for b, (k, v) in enumerate(rows)]), None


class FastDLLMV2Backbone(nn.Module):
    def __init__(self, config: FastDLLMV2Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([Qwen2DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen2RotaryEmbedding(config=config)


@dataclass
class FastDLLMV2Output(CausalLMOutputWithPast):
    """The official output: logits, the prefix cache, the sub-block cache, and (as the official
    model returns it) the final normalized hidden states in `hidden_states`."""

    block_past_key_values: Cache | None = None


class FastDLLMV2ForCausalLM(PreTrainedModel):
    """Fast-dLLM v2: `forward(input_ids, past_key_values, use_cache, update_past_key_values,
    block_size, use_block_cache, block_past_key_values, replace_position)` → `.logits` `[B, L, V]`
    (unshifted: row i holds the prediction made at position i, i.e. for position i+1), with the
    official cache semantics (module docstring). `generate(...)` is the official model's
    `generate` (`remask.compat.fast_dllm_v2.generate`)."""

    config_class = FastDLLMV2Config
    base_model_prefix = "model"
    _no_split_modules = ["Qwen2DecoderLayer"]
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _supports_sdpa = True

    def __init__(self, config: FastDLLMV2Config):
        config.validate_architecture()
        super().__init__(config)
        # the official attention always calls SDPA, whatever implementation the config names
        self.config._attn_implementation = "sdpa"
        self.model = FastDLLMV2Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, past_key_values: Cache | None = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.LongTensor | None = None,
                use_cache: bool | None = None, cache_position: torch.LongTensor | None = None,
                logits_to_keep: int | torch.Tensor = 0, update_past_key_values: bool = False, block_size: int = 32,
                use_block_cache: bool = False, block_past_key_values: Cache | None = None,
                replace_position: int | None = None, mask_id: int | None = None, **kwargs: Any) -> FastDLLMV2Output:
        unexpected = sorted(k for k, v in kwargs.items() if v is not None and k not in (
            "output_attentions", "output_hidden_states", "return_dict"))
        if unexpected:
            raise TypeError(f"FastDLLMV2ForCausalLM.forward got unexpected arguments {unexpected}")
        if labels is not None:
            raise ValueError("FastDLLMV2ForCausalLM is remask's inference model: the official training forward "
                             "(complementary masks, `labels`) is not implemented")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        # attention_mask: the official inference forward overwrites it with its block mask
        hidden = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if isinstance(past_key_values, RowBatch):
            return self._rows_forward(hidden, past_key_values, logits_to_keep)
        length = hidden.shape[1]
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        if use_block_cache and block_past_key_values is None:
            block_past_key_values = DynamicCache()
        cached = past_key_values.get_seq_length() if past_key_values is not None else 0
        if cache_position is None:
            first = cached + replace_position if use_block_cache and replace_position is not None else cached
            cache_position = torch.arange(first, first + length, device=hidden.device)
        if position_ids is None:
            position_ids = cache_position.unsqueeze(0)
        if use_block_cache and block_past_key_values.get_seq_length() != 0:
            mask = None   # a sub-block against the stored block: full attention
        else:
            mask = eval_block_mask(length, block_size, cached, device=hidden.device)
        view = None
        if past_key_values is not None or block_past_key_values is not None:
            view = OfficialCacheView(past_key_values, update_past_key_values,
                                     block_past_key_values if use_block_cache else None, replace_position)
        position_embeddings = self.model.rotary_emb(hidden, position_ids)
        for layer in self.model.layers:
            hidden = layer(hidden, attention_mask=mask, position_ids=position_ids, **cache_arg(layer.forward, view),
                           position_embeddings=position_embeddings, is_causal=False)
        hidden = self.model.norm(hidden)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return FastDLLMV2Output(**with_cache_field(dict(
            logits=self.lm_head(hidden[:, keep, :]), cache=past_key_values if use_cache else None,
            hidden_states=hidden, block_past_key_values=block_past_key_values if use_block_cache else None)))

    def _rows_forward(self, hidden: torch.Tensor, rows: RowBatch, logits_to_keep: int | torch.Tensor
                      ) -> FastDLLMV2Output:
        """A forward over several requests' whole blocks (`RowBatch`): each row with the positions,
        mask and cache rule of its own forward; attention row by row (`rows_attention_forward`)."""
        from transformers import AttentionInterface

        B, length = hidden.shape[:2]
        cached = [cache.get_seq_length() for cache in rows.caches]
        position_ids = torch.stack([torch.arange(c, c + length, device=hidden.device) for c in cached])
        rows.masks = [eval_block_mask(length, size, c, device=hidden.device)
                      for size, c in zip(rows.block_sizes, cached)]
        AttentionInterface.register(ROWS_ATTENTION, rows_attention_forward)
        saved, token = self.config._attn_implementation, _ROWS.set(rows)
        try:
            self.config._attn_implementation = ROWS_ATTENTION
            position_embeddings = self.model.rotary_emb(hidden, position_ids)
            for layer in self.model.layers:
                hidden = layer(hidden, attention_mask=None, position_ids=position_ids,
                               position_embeddings=position_embeddings, is_causal=False)
        finally:
            self.config._attn_implementation = saved
            _ROWS.reset(token)
        hidden = self.model.norm(hidden)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return FastDLLMV2Output(logits=self.lm_head(hidden[:, keep, :]), hidden_states=hidden)

    def sample_with_top_p(self, logits: torch.Tensor, top_p: float = 0.95, temperature: float = 1.0):
        """The official model's sampling helper (its decoders call it as a method): (tokens `[B, L]`,
        distributions `[B, L, V]`) — `remask.diffusion.families.fast_dllm_v2.choose_tokens` without the
        mask-token fix (`remask.diffusion.parts.scoring.sample_categorical` with Fast-dLLM v2's flags)."""
        choose_tokens = resolve("remask.diffusion.families.fast_dllm_v2:choose_tokens")
        tokens, _, probs = choose_tokens(logits, top_p, temperature, None, None)
        return tokens, probs

    def generate(self, input_ids: torch.LongTensor, **kwargs: Any):
        """The official model's `generate`: its family's drop-in (`Family.generate`,
        `remask.compat.fast_dllm_v2.generate`)."""
        return family_of(self.config.model_type).entry_point()(self, input_ids, **kwargs)


def fast_dllm_v2_spec(config: FastDLLMV2Config) -> ModelSpec:
    """Fast-dLLM v2: a mask model with block-causal attention, blocks of `config.bd_size`, and
    logits shifted by one position (as Dream's)."""
    eos = config_id(config, "eos_token_id", FAST_DLLM_V2_STOP_ID)
    return ModelSpec(
        kind="fast_dllm_v2",
        mask_id=config_id(config, "mask_token_id", FAST_DLLM_V2_MASK_ID),
        eos_id=eos,
        pad_id=config_id(config, "pad_token_id", eos),
        vocab_size=config.vocab_size,
        max_length=config.max_position_embeddings,
        logit_shift=True,
        attention="block-causal",
        trained_gen_length=getattr(config, "trained_gen_length", None),
        block_length=getattr(config, "bd_size", 32),
        _inputs=padding_mask_inputs,
    )


register_family(Family("Fast_dLLM_Qwen", fast_dllm_v2_spec, FastDLLMV2Config, FastDLLMV2ForCausalLM,
                       auto_classes=("AutoModel", "AutoModelForCausalLM"),
                       generate="remask.compat.fast_dllm_v2:generate",
                       engine_decoder="remask.diffusion.families.fast_dllm_v2:engine_decoder"))

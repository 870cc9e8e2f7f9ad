"""Building blocks shared by the LLaDA and Dream implementations.

Both models are Llama-style bidirectional transformers. The arithmetic here follows the official
remote code operation for operation (RMSNorm and RoPE in float32, SDPA with the same mask shapes),
so that float32 logits are bitwise equal to the reference on the same weights, which is what
token-for-token reproduction of greedy decoding needs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, cast back to the input dtype before the weight multiply."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """Inverse frequencies `1 / theta^(2i/d)` in float32 (same expression as both references)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float) / head_dim))


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables `[B, 1, L, head_dim]` in float32 for integer positions `[B, L]`."""
    inv_freq = rope_inv_freq(head_dim, theta, position_ids.device)
    freqs = position_ids.to(torch.float32)[..., None] * inv_freq  # an outer product: one rounding, as in the references
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos()[:, None], emb.sin()[:, None]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, full_precision: bool = True) -> torch.Tensor:
    """Rotate `x` `[B, H, L, D]`.

    `full_precision=True` (LLaDA's `rope_full_precision`) rotates in float32 and casts back;
    otherwise the tables are cast to `x.dtype` first and the rotation runs in that dtype (Dream).
    """
    if full_precision:
        xf = x.float()
        return ((xf * cos) + (rotate_half(xf) * sin)).to(x.dtype)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return (x * cos) + (rotate_half(x) * sin)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Bidirectional attention. q `[B, Hq, Lq, D]`, k/v `[B, Hkv, Lk, D]` (GQA by repetition).

    `mask` is None (attend everywhere), a bool mask or an additive float bias broadcastable to
    `[B, Hq, Lq, Lk]`. Cached forwards go through the cache's `attend` instead, which is where the
    paged kernel plugs in (`remask.models.paged.PagedKVCache`).
    """
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:
        k = k.repeat_interleave(n_rep, dim=1, output_size=q.shape[1])
        v = v.repeat_interleave(n_rep, dim=1, output_size=q.shape[1])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)


def rotary_self_attention(q, k, v, head_dim: int, cos, sin, mask, cache: "KVCache | None", layer_idx: int,
                          cache_start: int, rope_full_precision: bool) -> torch.Tensor:
    """Projected `q`/`k`/`v` `[B, L, heads*head_dim]` → RoPE → (cache write/read) → attention →
    `[B, L, Hq*head_dim]`. Keys enter the cache after RoPE."""
    B, L, _ = q.shape
    q, k, v = (t.view(B, L, -1, head_dim).transpose(1, 2) for t in (q, k, v))
    q = apply_rope(q, cos, sin, rope_full_precision)
    k = apply_rope(k, cos, sin, rope_full_precision)
    out = attention(q, k, v, mask) if cache is None else cache.attend(layer_idx, q, k, v, cache_start, mask)
    return out.transpose(1, 2).contiguous().view(B, L, -1)


@dataclass
class ForwardPositions:
    """Where a forward's inputs sit: the cache to use, absolute positions, RoPE tables, key length."""

    cache: "KVCache | None"
    cache_start: int
    cos: torch.Tensor
    sin: torch.Tensor
    k_len: int


def forward_positions(batch: int, length: int, device, head_dim: int, theta: float, past_key_values,
                      use_cache, cache_position, position_ids) -> ForwardPositions:
    """Resolve cache and positions for a forward of `length` new tokens (see `LLaDAModelLM.forward`)."""
    if use_cache and past_key_values is None:
        past_key_values = KVCache()
    past_len = past_key_values.get_seq_length() if past_key_values is not None else 0
    if cache_position is None:
        cache_position = torch.arange(past_len, past_len + length, device=device)
    if position_ids is None:
        position_ids = cache_position[None].expand(batch, length)
    cos, sin = rope_cos_sin(position_ids, head_dim, theta)
    k_len = max(past_len, int(cache_position[-1]) + 1) if past_key_values is not None else length
    return ForwardPositions(past_key_values, int(cache_position[0]), cos, sin, k_len)


@torch.no_grad()
def init_weights(module: nn.Module, std: float) -> None:
    """Fresh weights for modules a checkpoint did not provide (normal(std), zero biases, unit norms)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=std)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, RMSNorm):
        nn.init.ones_(module.weight)


class KVCache:
    """Per-layer keys/values of a bidirectional model, stored after RoPE.

    `update` either appends the new positions (prefix caching) or overwrites a contiguous range
    in place (dual caching, where the block's entries are refreshed every step). Positions are
    absolute, given by `cache_position` on the model's forward.
    """

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def get_seq_length(self, layer: int = 0) -> int:
        return self.keys[layer].shape[-2] if layer < len(self.keys) else 0

    @property
    def nbytes(self) -> int:
        """Bytes of K/V held (all layers)."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        if layer == len(self.keys):
            if start != 0:
                raise ValueError(f"cache_position must start at 0 for an empty cache, got {start}")
            self.keys.append(k)
            self.values.append(v)
        else:
            length = self.keys[layer].shape[-2]
            end = start + k.shape[-2]
            if start == length:
                self.keys[layer] = torch.cat([self.keys[layer], k], dim=-2)
                self.values[layer] = torch.cat([self.values[layer], v], dim=-2)
            elif end <= length:
                self.keys[layer][:, :, start:end] = k
                self.values[layer][:, :, start:end] = v
            else:
                raise ValueError(f"cache_position [{start}, {end}) overruns a cache of length {length}")
        return self.keys[layer], self.values[layer]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               mask: torch.Tensor | None) -> torch.Tensor:
        """Write the new `k`/`v` `[B, H_kv, L, D]` at `start`, then attend `q` over the whole cache.
        Other caches (the paged one) override this to attend without a contiguous K/V."""
        k, v = self.update(layer, k, v, start)
        return attention(q, k, v, mask)

    def crop(self, length: int) -> None:
        """Keep only the first `length` positions of every layer."""
        self.keys = [k[:, :, :length] for k in self.keys]
        self.values = [v[:, :, :length] for v in self.values]

"""Building blocks shared by the LLaDA and Dream implementations.

Both models are Llama-style bidirectional transformers. The arithmetic here follows the official
remote code operation for operation (RMSNorm and RoPE in float32, SDPA with the same mask shapes),
so that float32 logits are bitwise equal to the reference on the same weights, which is what
token-for-token reproduction of greedy decoding needs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# The caches have a room of their own (`remask.caches`); the models attend through them.
from remask.caches.kv import KVCache, attention


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


def cache_span(past_key_values, length: int, device, cache_position) -> tuple[torch.Tensor, int, int, int]:
    """Where a forward of `length` new tokens goes: (`cache_position`, first and end written
    position, the cache's length before it). Reads and clears the cache's `write_start`."""
    past_len = past_key_values.get_seq_length() if past_key_values is not None else 0
    # Where the cache is written, as a Python int. A caller that knows it sets `write_start` on
    # the cache (read once here), so the step does not read `cache_position` back from the device.
    write_start = getattr(past_key_values, "write_start", None)
    if write_start is not None:
        past_key_values.write_start = None
    if cache_position is None:
        start, end = past_len, past_len + length
        cache_position = torch.arange(past_len, past_len + length, device=device)
    elif past_key_values is None:
        start, end = 0, length     # no cache: nothing is written
    elif write_start is not None:
        start, end = write_start, write_start + length   # the caller's contiguous range
    else:
        start, end = int(cache_position[0]), int(cache_position[-1]) + 1   # may not be contiguous (dKV)
    return cache_position, start, end, past_len


def forward_positions(batch: int, length: int, device, head_dim: int, theta: float, past_key_values,
                      use_cache, cache_position, position_ids) -> ForwardPositions:
    """Resolve cache and positions for a forward of `length` new tokens (see `LLaDAModelLM.forward`)."""
    if use_cache and past_key_values is None:
        past_key_values = KVCache()
    cache_position, start, end, past_len = cache_span(past_key_values, length, device, cache_position)
    if position_ids is None:
        position_ids = cache_position[None].expand(batch, length)
    cos, sin = rope_cos_sin(position_ids, head_dim, theta)
    k_len = max(past_len, end) if past_key_values is not None else length
    return ForwardPositions(past_key_values, start, cos, sin, k_len)


@torch.no_grad()
def init_weights(module: nn.Module, std: float) -> None:
    """Fresh weights for modules a checkpoint did not provide (normal(std), zero biases, unit norms)."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=std)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, RMSNorm):
        nn.init.ones_(module.weight)

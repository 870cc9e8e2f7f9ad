"""The contiguous KV cache of the bidirectional models, and their attention.

A model's attention layer hands its rotated `q`/`k`/`v` to the cache's `attend`: `KVCache` writes
the new K/V at their positions and attends over all it holds (the paged and sparse caches override
`attend`); without a cache the layer calls `attention` directly.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def repeat_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    """GQA: keys or values `[B, H_kv, L, D]` with each head repeated for its group of the `heads` query heads."""
    n_rep = heads // t.shape[1]
    return t.repeat_interleave(n_rep, dim=1, output_size=heads) if n_rep > 1 else t


def key_bias(ok: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The additive `[B, 1, 1, n]` bias hiding the False keys of `ok` `[B, n]` (None: none hidden)."""
    if ok is None or bool(ok.all()):
        return None
    bias = torch.zeros(ok.shape, dtype=dtype, device=ok.device).masked_fill(~ok, torch.finfo(dtype).min)
    return bias[:, None, None, :]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Bidirectional attention. q `[B, Hq, Lq, D]`, k/v `[B, Hkv, Lk, D]` (GQA by repetition);
    `mask`: None, a bool mask or an additive float bias broadcastable to `[B, Hq, Lq, Lk]`."""
    k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)


class KVCache:
    """Per-layer keys/values of a bidirectional model, stored after RoPE. `update` appends the new
    positions (prefix caching) or overwrites a contiguous range in place (dual caching: the block's
    entries refreshed every step); positions are absolute (`cache_position` of the forward)."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        # The first position the next forward writes, when its caller knows it as a Python int;
        # the model reads it (once) instead of `cache_position[0]`, a host sync per forward.
        self.write_start: int | None = None

    def get_seq_length(self, layer: int = 0) -> int:
        return self.keys[layer].shape[-2] if layer < len(self.keys) else 0

    @property
    def nbytes(self) -> int:
        """Bytes of K/V held (all layers)."""
        return sum(t.nbytes for t in self.keys + self.values)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        length = self.keys[layer].shape[-2] if layer < len(self.keys) else 0   # (a subclass counts get_seq_length)
        end = start + k.shape[-2]
        if layer == len(self.keys) and start != 0:
            raise ValueError(f"cache_position must start at 0 for an empty cache, got {start}")
        if start != length and end > length:
            raise ValueError(f"cache_position [{start}, {end}) overruns a cache of length {length}")
        for held, new in ((self.keys, k), (self.values, v)):
            if layer == len(held):   # the layer's first forward
                held.append(new)
            elif start == length:   # appended after what the layer holds (prefix caching)
                held[layer] = torch.cat([held[layer], new], dim=-2)
            else:   # overwritten in place (dual caching)
                held[layer][:, :, start:end] = new
        return self.keys[layer], self.values[layer]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               mask: torch.Tensor | None) -> torch.Tensor:
        """Write the new `k`/`v` `[B, H_kv, L, D]` at `start`, then attend `q` over the whole cache."""
        k, v = self.update(layer, k, v, start)
        return attention(q, k, v, mask)

    def crop(self, length: int) -> None:
        """Keep only the first `length` positions of every layer."""
        self.keys = [k[:, :, :length] for k in self.keys]
        self.values = [v[:, :, :length] for v in self.values]

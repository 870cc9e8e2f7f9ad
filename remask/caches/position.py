"""Caches of explicitly passed positions (nothing appended): dKV-Cache's delayed cache and d2Cache's
whole-sequence cache with its attention rollout (their loops: `remask.diffusion.methods.dkv`, `.d2cache`)."""
from __future__ import annotations

import math

import torch

from .kv import KVCache, attention, key_bias, repeat_kv


class PositionKVCache(KVCache):
    """Per-layer keys/values (after RoPE) `k`, `v` of explicitly passed positions (nothing is appended,
    so `get_seq_length` is 0): the base of `DelayedKVCache`, d2Cache's `D2KVCache` and `ElasticKVCache`."""

    def __init__(self) -> None:
        super().__init__()
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in list(self.k.values()) + list(self.v.values()))


class DelayedKVCache(PositionKVCache):
    """Keys/values of a chosen set of positions per row (`k[layer]` `[B, H, n_cached, D]`). Before each
    forward the decoder calls `fill(store)` (the forward covers every position; keep those in `store`
    `[B, T]`) or `reuse(forwarded, store)` (it covers the positions in `forwarded`, the others must be
    cached; keep those in `store`, fresh where forwarded), and `finish()` after it. `key_ok` `[B, T]`
    (False = padding key) hides keys."""

    def __init__(self, key_ok: torch.Tensor | None = None) -> None:
        super().__init__()
        self.key_ok = key_ok
        self.cached: torch.Tensor | None = None          # [B, T] bool: positions held
        self._plan: tuple | None = None   # the next forward's (positions forwarded, None: all; positions kept)

    def fill(self, store: torch.Tensor) -> None:
        self._plan = (None, store)

    def reuse(self, forwarded: torch.Tensor, store: torch.Tensor) -> None:
        if self.cached is None or not bool((self.cached | forwarded).all()):
            raise RuntimeError("dKV cache: every position not forwarded must be cached")
        self._plan = (forwarded, store)

    def finish(self) -> None:
        self.cached, self._plan = self._plan[1], None

    @staticmethod
    def _select(t: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Rows' kept positions of `t` `[B, H, T, D]` (equal counts per row), ascending."""
        B, H, _, D = t.shape
        idx = keep.nonzero()[:, 1].view(B, -1)
        return torch.gather(t, 2, idx[:, None, :, None].expand(B, H, idx.shape[1], D))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               mask: torch.Tensor | None) -> torch.Tensor:
        if self._plan is None:
            raise RuntimeError("dKV cache: call fill() or reuse() before the forward")
        (forwarded, store), (B, H, _, D) = self._plan, k.shape
        if forwarded is None:   # fill
            out = attention(q, k, v, key_bias(self.key_ok, q.dtype))
            self.k[layer], self.v[layer] = self._select(k, store), self._select(v, store)
            return out
        # keys: the forwarded positions' fresh ones, then the cached ones of the other positions
        # (each ascending), the reference's order
        old = ~forwarded
        old_in_cache = old[self.cached].view(B, -1)          # which cached entries are not forwarded
        old_k, old_v = self._select(self.k[layer], old_in_cache), self._select(self.v[layer], old_in_cache)
        keys, values = torch.cat([k, old_k], dim=2), torch.cat([v, old_v], dim=2)
        order = torch.cat([forwarded.nonzero()[:, 1].view(B, -1), old.nonzero()[:, 1].view(B, -1)], 1)
        ok = None if self.key_ok is None else self.key_ok.gather(1, order)   # the keys' validity, in their order
        out = attention(q, keys, values, key_bias(ok, q.dtype))
        # Back to sequence order (fresh where forwarded, else cached), then keep the `store` positions.
        index = order[:, None, :, None].expand(-1, H, -1, D)
        self.k[layer], self.v[layer] = (self._select(torch.empty_like(t).scatter_(2, index, t), store)
                                        for t in (keys, values))
        return out


class D2KVCache(PositionKVCache):
    """Every layer's keys/values (after RoPE) of the whole sequence `[B, H, T, D]`, refreshed row by row,
    plus the attention rollout of the last forward.

    Before each forward call `full()` (the forward covers every position; the cache is (re)filled) or
    `partial(rows)` (`rows` `[B, T]` bool, equal counts per row: the forwarded positions, in order).
    `key_bias` `[B, 1, 1, T]` (additive; padding keys) or None."""

    def __init__(self, key_bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.key_bias = key_bias
        self.rows: torch.Tensor | None = None
        self.rollout: torch.Tensor | None = None     # [B, T, T] after the last forward

    def full(self) -> None:
        self.rows = None

    def partial(self, rows: torch.Tensor) -> None:
        if not self.k:
            raise RuntimeError("d2Cache: the first forward must be a full one")
        self.rows = rows

    def _rollout(self, layer: int, weights: torch.Tensor) -> None:
        # head-mean attention of the recomputed rows (identity elsewhere) plus the residual identity,
        # row-normalised, multiplied through the layers
        B, _, _, T = weights.shape
        eye, step = torch.eye(T, dtype=weights.dtype, device=weights.device), weights.mean(dim=1)
        if layer == 0:
            self.rollout = eye.expand(B, -1, -1)
        if self.rows is not None:
            step = eye.repeat(B, 1, 1).index_put_((self.rows,), step.reshape(-1, T))
        step = step + eye
        step = step / step.sum(dim=-1, keepdim=True)
        self.rollout = step @ self.rollout

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               mask: torch.Tensor | None) -> torch.Tensor:
        if self.rows is None:
            self.k[layer], self.v[layer] = k, v
        else:
            B, H, n, D = k.shape
            index = self.rows.nonzero()[:, 1].view(B, 1, n, 1).expand(B, H, n, D)
            self.k[layer], self.v[layer] = self.k[layer].scatter(2, index, k), self.v[layer].scatter(2, index, v)
        keys, values = repeat_kv(self.k[layer], q.shape[1]), repeat_kv(self.v[layer], q.shape[1])
        weights = torch.matmul(q, keys.transpose(2, 3)) / math.sqrt(q.shape[-1])
        if self.key_bias is not None:
            weights = weights + self.key_bias
        weights = torch.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype)
        self._rollout(layer, weights)
        return torch.matmul(weights, values)

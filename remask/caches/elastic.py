"""Elastic-Cache's per-layer q/k/v of every position and its attention-drift check (its loop and
layer work: `remask.diffusion.methods.elastic`)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .kv import key_bias, repeat_kv
from .position import PositionKVCache


class ElasticKVCache(PositionKVCache):
    """Per-layer queries, keys and values (after RoPE) of every position of one row, and the
    Elastic-Cache drift check, behind remask's `attend` seam.

    Before each layer the driver calls `plan(full=...)`: `full=True` (the layer runs on all
    positions in order: its caches are replaced) or `full=False` (the layer runs on the rows
    `query`, ordered tracked tokens first and the `window` last: their q/k/v overwrite the caches,
    they attend over all cached keys, and the tracked tokens' old-vs-new attention cosine is
    checked against `gamma`; `triggered` tells the driver to recompute the following layers).
    After every layer `track[layer]` holds the layer's most attended non-masked positions.
    `key_ok` `[1, T]` (False = padding key) hides keys. Positions are passed explicitly: nothing is
    appended: a `PositionKVCache`, with the queries `q` too)."""

    def __init__(self, key_ok: torch.Tensor | None = None) -> None:
        super().__init__()
        self.bias = key_bias(key_ok, torch.float32)
        self.q: dict[int, torch.Tensor] = {}
        self.track: dict[int, torch.Tensor] = {}
        self.triggered = False
        self._plan: dict | None = None

    @property
    def nbytes(self) -> int:
        return super().nbytes + sum(t.nbytes for t in self.q.values())

    def plan(self, *, full: bool, query: torch.Tensor, track: torch.Tensor, window: torch.Tensor,
             masked: torch.Tensor, gamma: float, track_num: int) -> None:
        self._plan = dict(full=full, query=query, track=track, window=window, masked=masked, gamma=gamma,
                          track_num=track_num)

    def _weights(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        w = q @ repeat_kv(k, q.shape[1]).transpose(-2, -1) * (1 / math.sqrt(q.size(-1)))
        if self.bias is not None:
            w = w + self.bias.to(w.dtype)
        return torch.softmax(w, dim=-1)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               mask: torch.Tensor | None) -> torch.Tensor:
        plan = self._plan
        if plan is None:
            raise RuntimeError("elastic cache: call plan() before each layer")
        self._plan = None
        full, track = plan["full"], plan["track"]
        if full:
            self.q[layer], self.k[layer], self.v[layer] = q, k, v
        else:
            past_q, past_k = self.q[layer][:, :, track, :].clone(), self.k[layer].clone()
            for cached, fresh in ((self.q, q), (self.k, k), (self.v, v)):
                cached[layer][:, :, plan["query"], :] = fresh
        weights = self._weights(q, self.k[layer])
        out = weights @ repeat_kv(self.v[layer], weights.shape[1])
        # the window's rows: its positions (all positions queried) or the last queried (the window comes last)
        window_rows = weights[:, :, plan["window"] if full else slice(-plan["window"].shape[0], None), :]
        if not full:
            sim = F.cosine_similarity(self._weights(past_q, past_k), weights[:, :, :track.shape[0], :], dim=1).mean()
            self.triggered |= bool(sim < plan["gamma"])
        mass = window_rows.sum(dim=(0, 1, 2))
        mass[plan["masked"]] = 0.0
        self.track[layer] = mass.topk(k=plan["track_num"], dim=0, largest=True)[1]
        return out
